"""Capacity at equal latency on every objective: p99 TTFT *and* p99 TPOT.

A policy's capacity on one objective is the highest offered rate at which its p99 stays within
a bound (the same bound in ms for every policy: the baseline's p99 at the reference load),
interpolated linearly between the two loads that straddle it (the method of
`scripts/bench_scheduling.py` and `scripts/bench_prefix.py`). Capacity on TTFT alone can be
bought by starving decode (admitting prefills ahead of running decodes), so the capacity that
counts is the lower of the two: the highest rate at which *both* p99s hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Capacity", "LoadPoint", "capacity_at_bound", "two_objective_capacity"]


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """One load of one policy: offered rate (req/s) and its p99 TTFT and p99 TPOT (ms; mean over
    seeds when repeated). A None p99 (nothing succeeded) breaks any bound."""

    offered_rps: float
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None


@dataclass(frozen=True, slots=True)
class Capacity:
    """Capacities (req/s) of one policy; None when even its lightest load breaks the bound.

    Attributes:
        ttft_rps / tpot_rps: on p99 TTFT alone / p99 TPOT alone.
        both_rps: the lower of the two (both objectives hold).
        holds_at_top: the bound held at the heaviest load run, so the capacity is at least that
            (a lower bound, printed with ≥).
    """

    ttft_rps: float | None
    tpot_rps: float | None
    both_rps: float | None
    holds_at_top: bool


def capacity_at_bound(points: Sequence[tuple[float, float | None]], limit: float) -> float | None:
    """Highest rate at which `value <= limit`, from `(rate, value)` points (any order).

    Walks up from the lightest load; the first load over the limit ends the walk, interpolating
    between it and the load before. None when the lightest load is already over the limit (a
    None value counts as over).
    """
    ordered = sorted(points, key=lambda p: p[0])
    best: float | None = None
    for (rate, value), nxt in zip(ordered, [*ordered[1:], None]):
        if value is None or value > limit:
            break
        best = rate
        if nxt is not None and (nxt[1] is None or nxt[1] > limit):
            if nxt[1] is not None and nxt[1] != value:
                best = rate + (limit - value) / (nxt[1] - value) * (nxt[0] - rate)
            break
    return best


def two_objective_capacity(points: Sequence[LoadPoint], ttft_bound_ms: float, tpot_bound_ms: float) -> Capacity:
    """Capacity on p99 TTFT, on p99 TPOT, and on both, of one policy's loads.

    Raises:
        ValueError: no load point, or a bound that is not > 0.
    """
    if not points:
        raise ValueError("no load to compute a capacity from")
    if not (ttft_bound_ms > 0 and tpot_bound_ms > 0):
        raise ValueError(f"bounds must be > 0 ms, got TTFT {ttft_bound_ms} and TPOT {tpot_bound_ms}")
    ttft = capacity_at_bound([(p.offered_rps, p.ttft_p99_ms) for p in points], ttft_bound_ms)
    tpot = capacity_at_bound([(p.offered_rps, p.tpot_p99_ms) for p in points], tpot_bound_ms)
    both = None if ttft is None or tpot is None else min(ttft, tpot)
    top = max(p.offered_rps for p in points)
    return Capacity(ttft, tpot, both, both is not None and both >= top)
