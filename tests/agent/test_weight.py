"""The node weight: w = α·min(1, ref/TTFT P95) + β·free_kv/total_kv + γ·(1 − gpu_util)."""

from __future__ import annotations

import pytest

from extproc.agent.weight import WeightParams, node_weight

THIRDS = WeightParams()


@pytest.mark.parametrize(
    ("ttft", "kv_free", "util", "expected"),
    [
        (100.0, 1.0, 0.0, 1.0),  # fast, empty, idle: every term 1
        (400.0, 1.0, 0.0, (0.5 + 1 + 1) / 3),  # twice the 200 ms reference halves the latency term
        (200.0, 0.25, 0.8, (1 + 0.25 + 0.2) / 3),
        (None, 0.5, 0.5, 0.5),  # no latency figure: (β·0.5 + γ·0.5) / (β + γ)
        (None, None, 0.9, pytest.approx(0.1)),  # GPU only
        (None, None, None, 0.0),  # nothing known
        (0.0, 0.0, 1.0, 1 / 3),  # a zero P95 counts as fast, not as a division by zero
    ],
    ids=["all-best", "slow-ttft", "mixed", "no-latency", "gpu-only", "nothing", "zero-ttft"],
)
def test_default_thirds(ttft: float | None, kv_free: float | None, util: float | None, expected: float) -> None:
    assert node_weight(THIRDS, ttft_p95_ms=ttft, kv_free_fraction=kv_free, gpu_utilization=util) == pytest.approx(expected)


def test_coefficients_and_reference_change_the_weight() -> None:
    kv_only = WeightParams(alpha=0, beta=1, gamma=0)
    assert node_weight(kv_only, ttft_p95_ms=5000, kv_free_fraction=0.3, gpu_utilization=1.0) == pytest.approx(0.3)
    lenient = WeightParams(alpha=1, beta=0, gamma=0, latency_ref_ms=1000)
    assert node_weight(lenient, ttft_p95_ms=500, kv_free_fraction=0, gpu_utilization=1) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [{"alpha": -0.1}, {"alpha": 0, "beta": 0, "gamma": 0}, {"latency_ref_ms": 0}],
    ids=["negative", "all-zero", "zero-reference"],
)
def test_bad_parameters_are_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WeightParams(**kwargs)
