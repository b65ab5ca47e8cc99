"""Named GPU × model profiles: step-time coefficients, KV pool size, scheduler defaults.

Every number comes from published vLLM measurements, collected in the calibration notes whose
sections are cited below as "§" (sources listed in docs/simulator.md, "Profiles and their
sources"). The
Llama-3(.1) rows are the calibration's own suggested coefficients (§10); the Qwen3 rows are scaled
from them as DESIGN 5b says: the weight-bound terms (a, a_c, b, c) by parameters per GPU, the
attention terms by what they read or compute per GPU (d by KV bytes per token, q by attention
FLOPs, i.e. layers × heads × head_dim).

KV pool (§1): ``kv_tokens = (util·HBM − weights/TP − reserve) / (kv_bytes_per_token/TP)``,
``num_gpu_blocks = kv_tokens // block_size``. ``reserve`` (activation peak + non-torch memory per
GPU) is what the two read capacities imply: 6.1 GiB for Qwen3-8B on one H100 (366,400 tokens) and
6.8 GiB for Llama-3.1-70B TP4 (420,208 tokens); TP1 profiles use the first, TP>1 the second.

Scheduler defaults (§11, vLLM `EngineArgs.get_batch_defaults`): H100 `max_num_batched_tokens`
8192 and `max_num_seqs` 1024; A100 2048 and 256. Block size 16, `gpu_memory_utilization` 0.9.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from extproc.models import builtin_architecture_path
from extproc.pipeline.kv import ModelArchitecture, load_architecture

__all__ = [
    "GPU",
    "GPUS",
    "StepCoefficients",
    "Profile",
    "PROFILES",
    "DEFAULT_PROFILE",
    "SIM_TOKENIZER",
    "get_profile",
    "architecture",
]

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator type.

    Attributes:
        name: short name used in profile names (`h100`, `a100`).
        memory_bytes: HBM visible to CUDA (bytes): nvidia-smi's total for the 80 GB parts.
        max_num_batched_tokens, max_num_seqs: vLLM's OpenAI-server defaults on it (§11).
    """

    name: str
    memory_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int


GPUS: dict[str, GPU] = {
    "h100": GPU("h100", 81559 * MIB, 8192, 1024),
    "a100": GPU("a100", 81920 * MIB, 2048, 256),
}


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """The step-time model's coefficients (calibration §10, fuller form), in seconds.

    ``step = max(a, a_c + b·N) + c·decode_seqs + d·Σ decode ctx + q·Σ m·(2p + m)``
    with N = prefill tokens + decode sequences in the step, and for each prefill chunk m new
    tokens after p tokens already in the KV cache (cached prefix or earlier chunks).

    Attributes:
        a: step floor (weights read once per step), seconds.
        a_c: intercept of the compute-bound linear fit, seconds.
        b: per batched token, seconds/token.
        c: per decode sequence (sampler, bookkeeping), seconds/sequence.
        d: decode attention per context token, seconds/token.
        q: prefill attention, seconds/token².
    """

    a: float
    a_c: float
    b: float
    c: float
    d: float
    q: float

    def scaled(self, *, linear: float, kv: float, attn: float) -> StepCoefficients:
        """Scale the weight-bound terms by `linear`, `d` by `kv` and `q` by `attn`."""
        return StepCoefficients(
            a=self.a * linear, a_c=self.a_c * linear, b=self.b * linear, c=self.c * linear,
            d=self.d * kv, q=self.q * attn,
        )


def _ms(x: float) -> float:
    return x * 1e-3


def _us(x: float) -> float:
    return x * 1e-6


def _ns(x: float) -> float:
    return x * 1e-9


@dataclass(frozen=True, slots=True)
class Profile:
    """One simulated engine: a GPU type, a model, a TP degree and its calibration.

    Attributes:
        name: e.g. `h100-qwen3-8b`.
        gpu: the accelerator.
        model: the served model name (`--served-model-name`), e.g. `Qwen/Qwen3-8B`.
        arch_name: built-in architecture (`extproc/models/architectures/<arch_name>.json`).
        tensor_parallel: TP degree (GPUs per engine).
        coefficients: the step-time model.
        source: where the coefficients come from (calibration sections and their sources).
        reserve_bytes: activation peak + non-torch memory per GPU (bytes), see module docstring.
        gpu_memory_utilization: vLLM's fraction of HBM it may use (0.9 default).
        block_size: KV block size (tokens).
    """

    name: str
    gpu: GPU
    model: str
    arch_name: str
    tensor_parallel: int
    coefficients: StepCoefficients
    source: str
    reserve_bytes: int
    gpu_memory_utilization: float = 0.9
    block_size: int = 16

    @property
    def arch(self) -> ModelArchitecture:
        return architecture(self.arch_name)

    @property
    def max_model_len(self) -> int:
        """vLLM's default: the model's `max_position_embeddings` (tokens)."""
        return self.arch.max_position_embeddings

    @property
    def max_num_seqs(self) -> int:
        return self.gpu.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.gpu.max_num_batched_tokens

    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies on each GPU (bytes)."""
        return self.arch.kv_bytes_per_token(tensor_parallel=self.tensor_parallel)

    def weight_bytes(self) -> int:
        """Weight memory per GPU (bytes)."""
        return self.arch.weight_bytes(tensor_parallel=self.tensor_parallel)

    def kv_capacity_tokens(self, gpu_memory_utilization: float | None = None) -> int:
        """KV pool size in tokens (calibration §1 formula), per engine.

        Raises:
            ValueError: the weights and reserve do not fit in the usable memory.
        """
        util = self.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
        spare = util * self.gpu.memory_bytes - self.weight_bytes() - self.reserve_bytes
        if spare <= 0:
            raise ValueError(
                f"profile {self.name}: weights ({self.weight_bytes() / GIB:.1f} GiB/GPU) and reserve "
                f"do not fit in {util:.2f} × {self.gpu.memory_bytes / GIB:.1f} GiB"
            )
        return int(spare // self.kv_bytes_per_token())

    def num_gpu_blocks(self, block_size: int | None = None, gpu_memory_utilization: float | None = None) -> int:
        """KV pool size in blocks of `block_size` tokens."""
        return self.kv_capacity_tokens(gpu_memory_utilization) // (block_size or self.block_size)

    def summary(self) -> str:
        """One line for `--help` and logs."""
        return (
            f"{self.name}: {self.model} on {self.tensor_parallel}×{self.gpu.name.upper()}-80GB, "
            f"{self.num_gpu_blocks()} blocks of {self.block_size}"
        )


@cache
def architecture(name: str) -> ModelArchitecture:
    """A built-in architecture by name (cached)."""
    return load_architecture(builtin_architecture_path(name))


# --- Llama-3(.1) rows: calibration §10 table, fuller (max) form --------------------------------
# a_c for TP>1 adds the fixed cost of 2 all-reduces per layer (~160 calls × ~0.05 ms ≈ 8 ms, §4,
# Vidur NCCL profile); the large-message all-reduce cost is inside b (§10 "a_c, b"). c is the
# per-sequence sampler/bookkeeping cost of the max() form (≈0–5 µs in V1, §10 "c"); the batch
# growth of the GEMMs is carried by max(a, a_c + b·N).
_LLAMA: dict[tuple[str, str, int], tuple[StepCoefficients, str]] = {
    ("h100", "llama-3.1-8b", 1): (
        StepCoefficients(a=_ms(6.4), a_c=_ms(1.5), b=_us(23), c=_us(5), d=_ns(43.7), q=_ns(0.453)),
        "calibration §2/§10: a = 6.44 ms and d = 43.7 ns/token read from the vLLM FP8-KV blog "
        "(BLOG-FP8KV, batch-1 ITL fit); b = 23 µs/token from 43.5k prefill tok/s (BLOG-OFFLOAD); "
        "q from the quadratic TTFT fit (BLOG-OFFLOAD fig. 1)",
    ),
    ("a100", "llama-3.1-8b", 1): (
        StepCoefficients(a=_ms(10.5), a_c=_ms(7.6), b=_us(66), c=_us(5), d=_ns(72), q=_ns(1.4)),
        "calibration §3/§10: Vidur A100 Llama-3-8B kernel profile (a, a_c, b); d = H100 d × HBM "
        "ratio 3.35/2.04; q by attention throughput (~190 TFLOP/s)",
    ),
    ("h100", "llama-3.1-70b", 4): (
        StepCoefficients(a=_ms(22), a_c=_ms(4.3 + 8), b=_us(66), c=_us(5), d=_ns(27), q=_ns(0.57)),
        "calibration §4/§10: Vidur H100 Llama-2-70B TP4 kernels + NCCL all-reduce; low-load TPOT "
        "22–24 ms (SGL-060); d = 8B d × 80/128 KiB per GPU",
    ),
    ("a100", "llama-3.1-70b", 4): (
        StepCoefficients(a=_ms(31), a_c=_ms(18 + 8), b=_us(175), c=_us(5), d=_ns(45), q=_ns(1.7)),
        "calibration §5/§10: Vidur A100 Llama-3-70B TP4 kernels + NCCL; published TPOT ≈40 ms at "
        "QPS 2 (BLOG-060)",
    ),
    ("h100", "llama-3.1-70b", 8): (
        StepCoefficients(a=_ms(16), a_c=_ms(6.3 + 8), b=_us(32), c=_us(5), d=_ns(14), q=_ns(0.29)),
        "calibration §4/§10: TP8 estimate from Vidur kernels (no published run)",
    ),
    ("a100", "llama-3.1-70b", 8): (
        StepCoefficients(a=_ms(22), a_c=_ms(10.6 + 8), b=_us(92), c=_us(5), d=_ns(23), q=_ns(0.85)),
        "calibration §5/§10: TP8 estimate from Vidur kernels (no published run)",
    ),
}

_MODEL_NAMES = {
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
}


def _attn_flops_per_token(arch: ModelArchitecture, tp: int) -> float:
    return arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim / tp


def _scaled(gpu: str, arch_name: str, tp: int, base_arch_name: str, base_tp: int) -> tuple[StepCoefficients, str]:
    """Coefficients of (arch, tp) scaled from a Llama row, as DESIGN 5b says."""
    base, base_src = _LLAMA[(gpu, base_arch_name, base_tp)]
    arch, base_arch = architecture(arch_name), architecture(base_arch_name)
    linear = (arch.num_parameters / tp) / (base_arch.num_parameters / base_tp)
    kv = arch.kv_bytes_per_token(tensor_parallel=tp) / base_arch.kv_bytes_per_token(tensor_parallel=base_tp)
    attn = _attn_flops_per_token(arch, tp) / _attn_flops_per_token(base_arch, base_tp)
    src = (
        f"scaled from {gpu}-{base_arch_name}" + (f"-tp{base_tp}" if base_tp > 1 else "")
        + f" (parameters/GPU ×{linear:.3f}, KV bytes/token/GPU ×{kv:.3f}, attention FLOPs ×{attn:.3f}); "
        + f"base: {base_src}"
    )
    return base.scaled(linear=linear, kv=kv, attn=attn), src


def _profile(gpu: str, arch_name: str, tp: int, coeffs: tuple[StepCoefficients, str]) -> Profile:
    name = f"{gpu}-{arch_name}" + (f"-tp{tp}" if tp > 1 else "")
    return Profile(
        name=name,
        gpu=GPUS[gpu],
        model=_MODEL_NAMES[arch_name],
        arch_name=arch_name,
        tensor_parallel=tp,
        coefficients=coeffs[0],
        source=coeffs[1],
        reserve_bytes=int((6.1 if tp == 1 else 6.8) * GIB),
    )


def _build() -> dict[str, Profile]:
    out: list[Profile] = []
    for gpu in ("h100", "a100"):
        out.append(_profile(gpu, "qwen3-8b", 1, _scaled(gpu, "qwen3-8b", 1, "llama-3.1-8b", 1)))
        out.append(_profile(gpu, "qwen3-32b", 2, _scaled(gpu, "qwen3-32b", 2, "llama-3.1-70b", 4)))
        out.append(_profile(gpu, "llama-3.1-8b", 1, _LLAMA[(gpu, "llama-3.1-8b", 1)]))
        out.append(_profile(gpu, "llama-3.1-70b", 4, _LLAMA[(gpu, "llama-3.1-70b", 4)]))
        out.append(_profile(gpu, "llama-3.1-70b", 8, _LLAMA[(gpu, "llama-3.1-70b", 8)]))
    return {p.name: p for p in out}


PROFILES: dict[str, Profile] = _build()
DEFAULT_PROFILE = "h100-qwen3-8b"
SIM_TOKENIZER = "builtin:qwen3"
"""The tokenizer a simulator counts with unless given another (`llm-extproc sim --tokenizer`),
whatever its profile's model: a simulated Llama fleet tokenizes as Qwen3, and a router in front
of it must be configured with this tokenizer to count as it does."""


def get_profile(name: str) -> Profile:
    """A profile by name.

    Raises:
        KeyError: unknown name (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known profiles: {', '.join(PROFILES)}") from None


