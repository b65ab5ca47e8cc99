"""The node's routing weight, the design notes' compute-aware formula computed on the node:

    w = α·L + β·(free_kv / total_kv) + γ·(1 − gpu_util)

* L, the latency term, is 1/latency normalised by a reference: `min(1, ref_ms / ttft_p95_ms)`
  — 1 at or below the reference, ½ at twice it. The design normalises across endpoints; a
  node sees only itself, so the reference (`--latency-ref-ms`, default 200 ms, a common
  interactive TTFT target) stands in. The balancer may renormalise across nodes.
* free_kv / total_kv from the engine's block pool (`num_gpu_blocks × (1 − kv_usage)`): NVML's
  free memory hardly moves on a vLLM node, which pre-allocates its pool.
* gpu_util is the mean NVML utilisation over the node's devices (0..1).

Default α = β = γ = 1/3 (the design gives no values; equal thirds keep w in 0..1). A term
whose input is unknown (no request finished in the latency window, no `cache_config_info`, no
GPU source) is left out and the remaining weights renormalised, so an idle node is judged by
KV and GPU alone rather than punished for having no latency figure. No known input: w = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WeightParams", "node_weight"]


@dataclass(frozen=True, slots=True)
class WeightParams:
    """α (latency), β (free KV), γ (idle GPU), and the latency reference (milliseconds).

    Raises:
        ValueError: a negative coefficient, all coefficients zero, or a reference ≤ 0.
    """

    alpha: float = 1 / 3
    beta: float = 1 / 3
    gamma: float = 1 / 3
    latency_ref_ms: float = 200.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            if getattr(self, name) < 0:
                raise ValueError(f"weight coefficient {name} must be >= 0, got {getattr(self, name)}")
        if self.alpha + self.beta + self.gamma <= 0:
            raise ValueError("at least one of alpha, beta, gamma must be > 0")
        if not self.latency_ref_ms > 0:
            raise ValueError(f"latency_ref_ms must be > 0, got {self.latency_ref_ms}")


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def node_weight(
    params: WeightParams,
    *,
    ttft_p95_ms: float | None,
    kv_free_fraction: float | None,
    gpu_utilization: float | None,
) -> float:
    """The weight in 0..1 (see the module docstring).

    Args:
        ttft_p95_ms: P95 TTFT (milliseconds), None if unknown.
        kv_free_fraction: free / total KV blocks (0..1), None if unknown.
        gpu_utilization: mean GPU utilisation (0..1), None if unknown.
    """
    terms: list[tuple[float, float]] = []
    if ttft_p95_ms is not None:
        terms.append((params.alpha, 1.0 if ttft_p95_ms <= 0 else _clamp(params.latency_ref_ms / ttft_p95_ms)))
    if kv_free_fraction is not None:
        terms.append((params.beta, _clamp(kv_free_fraction)))
    if gpu_utilization is not None:
        terms.append((params.gamma, 1.0 - _clamp(gpu_utilization)))
    total = sum(coef for coef, _ in terms)
    if total <= 0:
        return 0.0
    return sum(coef * value for coef, value in terms) / total
