"""Means, 95 % bootstrap intervals and verdicts over repeated runs (seeds) of a benchmark.

A figure measured once per seed (p99 TTFT of each run, goodput of each run, ...) is reported as
the mean over seeds with a percentile-bootstrap interval of that mean (Efron & Tibshirani, An
Introduction to the Bootstrap, 1993, ch. 13: resample the seeds with replacement, take the
2.5th and 97.5th percentiles of the resampled means). Two policies compare through the interval
of the difference of their means: paired over seeds when both ran the same seeds (seed k replays
the same requests on the same simulator draws for every policy, so the per-seed difference
removes the workload's own variation), independent resampling otherwise. The verdict is
"ahead" or "behind" when that interval excludes 0, else "within noise".

With 3 seeds a bootstrap interval is coarse (10 distinct resampled means): it errs towards
"within noise" only as far as the seeds disagree; llm-d-latency-predictor asks for >= 10 seeds
before an A/B counts, the issue for >= 3 (5 where the intervals overlap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["Comparison", "Interval", "bootstrap_interval", "compare"]

RESAMPLES = 10_000
"""Bootstrap resamples per interval: the percentile endpoints move by < 1 % of the spread between
reruns at this count (and it costs ~1 ms for 10 seeds)."""

Verdict = Literal["ahead", "behind", "within noise", "one run"]


@dataclass(frozen=True, slots=True)
class Interval:
    """A mean over runs and its bootstrap interval, in the figure's own unit.

    Attributes:
        mean: the mean over the runs.
        low / high: the interval's ends (equal to `mean` for a single run: no interval).
        n: how many runs (seeds) it is over.
        confidence: the interval's level (0.95).
    """

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    def as_dict(self) -> dict[str, float | int]:
        """`{"mean", "low", "high", "n"}`, for JSON result files."""
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n}

    def fmt(self, digits: int = 0, scale: float = 1.0) -> str:
        """`"1,234 [1,100, 1,400]"` (values × `scale`), or the mean alone for one run."""
        m, lo, hi = (v * scale for v in (self.mean, self.low, self.high))
        if self.n < 2:
            return f"{m:,.{digits}f}"
        return f"{m:,.{digits}f} [{lo:,.{digits}f}, {hi:,.{digits}f}]"


@dataclass(frozen=True, slots=True)
class Comparison:
    """Policy A against policy B on one figure.

    Attributes:
        difference: the interval of mean(A) − mean(B) (paired over seeds when `paired`).
        verdict: "ahead" (A better beyond noise), "behind", "within noise" (the interval holds 0),
            or "one run" (a single seed on either side: no interval, no verdict).
        paired: the difference was taken seed by seed.
    """

    difference: Interval
    verdict: Verdict
    paired: bool


def _clean(values: Sequence[float | None], what: str) -> np.ndarray:
    data = [v for v in values if v is not None]
    if not data:
        raise ValueError(f"{what}: no values")
    arr = np.asarray(data, dtype=float)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what}: values must be finite, got {list(values)}")
    return arr


def bootstrap_interval(
    values: Sequence[float | None], *, confidence: float = 0.95, resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
    """Mean of `values` (one per run; Nones, runs without the figure, are left out) and its
    percentile-bootstrap interval.

    The resampling's generator is seeded (`seed`), so a result file regenerates the same
    interval. One value gives an interval of zero width (n = 1: say so, do not read it as exact).

    Raises:
        ValueError: no value, a non-finite one, or `confidence` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    arr = _clean(values, "bootstrap_interval")
    mean = float(arr.mean())
    if arr.size == 1 or np.all(arr == arr[0]):
        return Interval(mean, mean, mean, int(arr.size), confidence)
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(resamples, arr.size))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(mean, float(low), float(high), int(arr.size), confidence)


def compare(
    a: Sequence[float | None],
    b: Sequence[float | None],
    *,
    higher_is_better: bool,
    paired: bool = True,
    confidence: float = 0.95,
    seed: int = 0,
) -> Comparison:
    """Is A ahead of, behind, or within noise of B on one figure?

    Args:
        a / b: the figure per run (seed) of each policy; with `paired`, `a[k]` and `b[k]` are the
            same seed (lists of equal length; a seed missing on either side, None, is dropped
            from both).
        higher_is_better: goodput, throughput, hit rate (True); latencies, hotspot (False).
        paired: resample per-seed differences; False: resample each side on its own.

    Raises:
        ValueError: paired lists of different lengths, or no value on a side.
    """
    if paired:
        if len(a) != len(b):
            raise ValueError(f"paired comparison needs one value per seed on both sides ({len(a)} and {len(b)})")
        pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
        if not pairs:
            raise ValueError("compare: no seed with a value on both sides")
        diff = bootstrap_interval([x - y for x, y in pairs], confidence=confidence, seed=seed)
        n = len(pairs)
    else:
        aa, bb = _clean(a, "compare (A)"), _clean(b, "compare (B)")
        mean = float(aa.mean() - bb.mean())
        n = min(aa.size, bb.size)
        if n < 2:
            diff = Interval(mean, mean, mean, int(n), confidence)
        else:
            rng = np.random.default_rng(seed)
            ma = aa[rng.integers(0, aa.size, size=(RESAMPLES, aa.size))].mean(axis=1)
            mb = bb[rng.integers(0, bb.size, size=(RESAMPLES, bb.size))].mean(axis=1)
            tail = (1 - confidence) / 2 * 100
            low, high = np.percentile(ma - mb, [tail, 100 - tail])
            diff = Interval(mean, float(low), float(high), int(n), confidence)
    if n < 2:
        return Comparison(diff, "one run", paired)
    if diff.low <= 0 <= diff.high:
        verdict: Verdict = "within noise"
    else:
        verdict = "ahead" if (diff.mean > 0) == higher_is_better else "behind"
    return Comparison(diff, verdict, paired)
