"""KV-cache arithmetic: bytes per token and blocks per request.

Formulas (../DESIGN section 5; vLLM's own accounting):

* standard attention (MHA/GQA):
  ``kv_bytes_per_token = 2 × num_hidden_layers × num_key_value_heads × head_dim × dtype_bytes``
  with ``head_dim = hidden_size / num_attention_heads`` when the config omits it.
  Qwen3-8B: 2·36·8·128·2 = 147,456 B; Llama-3.1-8B: 131,072 B; Llama-3.1-70B: 327,680 B.
* multi-head latent attention (DeepSeek-V2/V3, `kv_lora_rank` in the config):
  ``num_hidden_layers × (kv_lora_rank + qk_rope_head_dim) × dtype_bytes``.
* blocks a request may occupy: ``ceil(prompt/bs) + n × ceil(output/bs)`` at most —
  with n > 1 the prompt blocks are shared and the decode blocks multiply by n.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_BYTES", "MAX_CONFIG_JSON_BYTES", "ModelArchitecture", "load_architecture", "blocks_for_tokens", "blocks_for_request"]

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
}


@dataclass(frozen=True, slots=True)
class ModelArchitecture:
    """The numbers of an HF `config.json` that KV and compute arithmetic need.

    Attributes:
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, hidden_size:
            as in the HF config.
        kv_lora_rank, qk_rope_head_dim: MLA fields (0 for standard attention).
        num_parameters: total parameter count (for weight memory and compute scaling), 0 if unknown.
        max_position_embeddings: the model's own context limit (tokens).
        torch_dtype: weights dtype name.
    """

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    num_parameters: int = 0
    max_position_embeddings: int = 0
    torch_dtype: str = "bfloat16"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchitecture:
        """Build from a parsed HF `config.json` (multimodal configs: its `text_config`).

        Raises:
            ValueError: a required field is missing or not a positive integer.
        """
        if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"]}

        def need(key: str) -> int:
            value = cfg.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json field {key!r} must be a positive integer, got {value!r}")
            return value

        layers = need("num_hidden_layers")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            hidden_size=hidden,
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            num_parameters=int(cfg.get("num_parameters") or 0),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )

    def kv_bytes_per_token(self, dtype: str = "auto", tensor_parallel: int = 1) -> int:
        """KV-cache bytes one token occupies (bytes), per GPU when `tensor_parallel` > 1.

        Args:
            dtype: KV-cache dtype; "auto" means the weights' dtype (vLLM's default).
            tensor_parallel: TP degree; KV heads are sharded across GPUs (MLA is replicated).

        Raises:
            ValueError: unknown dtype.
        """
        name = self.torch_dtype if dtype == "auto" else dtype
        try:
            width = DTYPE_BYTES[name]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}") from None
        if self.kv_lora_rank:
            return self.num_hidden_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * width
        kv_heads_per_gpu = max(1, self.num_key_value_heads // max(1, tensor_parallel))
        return 2 * self.num_hidden_layers * kv_heads_per_gpu * self.head_dim * width

    def weight_bytes(self, tensor_parallel: int = 1) -> int:
        """Weight memory per GPU (bytes), from `num_parameters` and the weights' dtype."""
        return self.num_parameters * DTYPE_BYTES.get(self.torch_dtype, 2) // max(1, tensor_parallel)


# An HF config.json is a few KB (a multimodal one's nested configs some tens of KB); a larger
# file is not one (a weights file named by mistake), and is refused before it is read whole.
MAX_CONFIG_JSON_BYTES = 4 << 20


def load_architecture(path: str | Path) -> ModelArchitecture:
    """Read a `config.json` (or a directory holding one), at most `MAX_CONFIG_JSON_BYTES`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file (a FIFO or a device would block or never end the
            read), over `MAX_CONFIG_JSON_BYTES`, not UTF-8 JSON (nesting too deep for the
            parser included), or a required field is missing.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if p.exists() and not p.is_file():
        raise ValueError(f"{p}: not a regular file")
    with p.open("rb") as f:
        raw = f.read(MAX_CONFIG_JSON_BYTES + 1)
    if len(raw) > MAX_CONFIG_JSON_BYTES:
        raise ValueError(f"{p}: over {MAX_CONFIG_JSON_BYTES} bytes; a model's config.json is a few KB")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: not valid UTF-8 JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{p}: not a model's config.json (JSON nested too deep)") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return ModelArchitecture.from_hf_config(cfg)


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """ceil(tokens / block_size): blocks that `tokens` tokens occupy (blocks)."""
    return -(-max(0, tokens) // block_size)


def blocks_for_request(prompt_tokens: int, output_tokens: int, block_size: int, n: int = 1) -> int:
    """Blocks a request may occupy at most (blocks).

    Prompt blocks are shared by the n choices (prefix sharing); each choice decodes its own.
    The last prompt block is partially filled and copied on write per choice, hence the
    conservative form: shared full prompt blocks + n × blocks of (prompt tail + output).
    """
    full_prompt = prompt_tokens // block_size
    tail = prompt_tokens - full_prompt * block_size
    return full_prompt + max(1, n) * blocks_for_tokens(tail + output_tokens, block_size)


def blocks_for_prompts(prompt_lengths: Sequence[int], output_tokens: int, block_size: int, n: int = 1) -> tuple[int, int]:
    """`(all, largest)` blocks of a batched completion (blocks): every prompt of it is its own
    engine request with its own n choices (`blocks_for_request` each), so the batch may occupy
    their sum at most, while the engine can start it once the largest prompt fits (it admits
    the prompts one by one). One prompt (`prompt_lengths` of one entry) gives the same number
    twice. Counting the batch's prompt tokens as one prompt with one set of outputs reserved 8
    blocks where 4 prompts needed 14.

    Raises:
        ValueError: `prompt_lengths` is empty.
    """
    if not prompt_lengths:
        raise ValueError("a batch has at least one prompt")
    each = [blocks_for_request(p, output_tokens, block_size, n) for p in prompt_lengths]
    return sum(each), max(each)


