"""LoRA adapters in the simulated engine: GPU slots and a host cache, both LRU, and what a load
costs.

vLLM (`--enable-lora --max-loras N --max-cpu-loras M --max-lora-rank R`) keeps up to N adapters
in GPU slots and up to M (≥ N) in host memory (`LRUCacheWorkerLoRAManager`); a batch holds at
most N distinct adapters (the scheduler skips a waiting request whose adapter would be the
N+1-th and admits the next one). An adapter a step needs that is not in a slot is activated
before the forward pass, synchronously: read from disk into host memory when it is not cached
there, then copied host→GPU into a slot, evicting the least recently used adapter no running
request uses. The whole step waits for it, so every request on the engine pays the load.

Load time (`LoraLoadModel.seconds`), simulated seconds:

    fixed_s + bytes / disk_bytes_per_s   (not in host memory)   + bytes / h2d_bytes_per_s

with bytes = rank × Σ over the adapted projections of (in + out features) × layers × 2 (bf16).
For Qwen3-8B with every linear projection adapted (q, k, v, o, gate, up, down: in + out =
75,776 per layer, 36 layers) that is 5.46 MB per unit of rank: 87 MB at rank 16.

Calibration (stated, not measured here): host→GPU at 25 GB/s, the effective rate of a pinned
copy over PCIe 4.0 x16, whose published signalling rate is 32 GB/s per direction (PCI-SIG,
PCIe 4.0 base specification, 16 GT/s × 16 lanes); disk→host at 1 GB/s, a safetensors read and
the CPU-side tensor assembly vLLM's `from_local_checkpoint` does (an NVMe drive alone reads
3–7 GB/s; the parse and per-module copies dominate, an assumption of this model); a fixed 30 ms
per load for creating the adapter's per-layer tensors and the slot bookkeeping (an assumption).
Rank 16 from disk: 30 + 87 + 3.5 ≈ 121 ms; from host memory: 33 ms; rank 64 from disk ≈ 395 ms.
The `--lora-load-scale` flag multiplies every load for fleets with slower storage.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["LoraLoadModel", "LoraSlots", "QWEN3_8B_LORA_FEATURES"]

QWEN3_8B_LORA_FEATURES = 75_776 * 36
"""Σ (in + out features) of every linear projection of Qwen3-8B, over its 36 layers: q 4096+4096,
k 4096+1024, v 4096+1024, o 4096+4096, gate and up 4096+12288, down 12288+4096 (its config.json:
hidden 4096, 8 KV heads × 128, intermediate 12288)."""


@dataclass(frozen=True, slots=True)
class LoraLoadModel:
    """The cost of activating an adapter (see the module docstring for the figures).

    Attributes:
        rank: the adapters' LoRA rank.
        features: Σ (in + out) features of the adapted projections over all layers.
        bytes_per_param: 2 (bf16).
        disk_bytes_per_s / h2d_bytes_per_s: disk→host and host→GPU rates (bytes per second).
        fixed_s: per-load overhead (seconds).
        scale: multiplies the whole load time.
    """

    rank: int = 16
    features: int = QWEN3_8B_LORA_FEATURES
    bytes_per_param: int = 2
    disk_bytes_per_s: float = 1e9
    h2d_bytes_per_s: float = 25e9
    fixed_s: float = 0.030
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.rank < 1 or self.features < 1 or self.scale <= 0:
            raise ValueError("LoRA rank, features and load scale must be positive")

    @property
    def adapter_bytes(self) -> int:
        """One adapter's weights (bytes): rank × features × bytes per parameter."""
        return self.rank * self.features * self.bytes_per_param

    def seconds(self, from_host: bool) -> float:
        """Seconds to activate one adapter: from host memory (`from_host`) or from disk."""
        b = self.adapter_bytes
        t = self.fixed_s + b / self.h2d_bytes_per_s + (0.0 if from_host else b / self.disk_bytes_per_s)
        return t * self.scale


@dataclass(slots=True)
class LoraSlots:
    """GPU slots and the host cache of one engine, each an LRU.

    Args:
        max_loras: GPU slots (vLLM `--max-loras`), ≥ 1.
        max_cpu_loras: adapters kept in host memory, GPU-resident ones included (vLLM
            `--max-cpu-loras`; default `max_loras`).
        load: the load-time model.
    """

    max_loras: int
    max_cpu_loras: int
    load: LoraLoadModel = field(default_factory=LoraLoadModel)
    gpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    cpu: OrderedDict[str, None] = field(default_factory=OrderedDict)
    loads_from_disk: int = 0
    loads_from_host: int = 0
    evictions: int = 0
    load_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be ≥ 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be ≥ max_loras ({self.max_loras})")

    @property
    def loads(self) -> int:
        """Adapter activations so far (count)."""
        return self.loads_from_disk + self.loads_from_host

    def activate(self, adapters: Iterable[str], in_use: set[str]) -> float:
        """Make every adapter of `adapters` GPU-resident for the coming step; returns the load
        seconds that step waits. `in_use`: adapters of the batch (never evicted), at most
        `max_loras` of them (the scheduler's bound).

        Raises:
            RuntimeError: no slot can be freed (more adapters in use than slots: a scheduler bug).
        """
        seconds = 0.0
        for name in adapters:
            if name in self.gpu:
                self.gpu.move_to_end(name)
                self.cpu.move_to_end(name)
                continue
            from_host = name in self.cpu
            if len(self.gpu) >= self.max_loras:
                victim = next((a for a in self.gpu if a not in in_use), None)
                if victim is None:
                    raise RuntimeError("every LoRA slot holds an adapter of the batch")
                del self.gpu[victim]
                self.evictions += 1
            if not from_host:
                while len(self.cpu) >= self.max_cpu_loras:
                    victim = next((a for a in self.cpu if a not in self.gpu), None)
                    if victim is None:
                        break
                    del self.cpu[victim]
                self.loads_from_disk += 1
            else:
                self.loads_from_host += 1
            self.cpu[name] = None
            self.cpu.move_to_end(name)
            self.gpu[name] = None
            t = self.load.seconds(from_host)
            self.load_seconds += t
            seconds += t
        return seconds

    def host_only(self) -> list[str]:
        """Adapters in host memory and not in a GPU slot."""
        return [a for a in self.cpu if a not in self.gpu]

    def clear(self) -> None:
        """Forget every loaded adapter (an engine restart)."""
        self.gpu.clear()
        self.cpu.clear()
