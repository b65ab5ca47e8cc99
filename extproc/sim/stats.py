"""Engine counters and histograms as plain data (no Prometheus objects).

The engine records here; `extproc.sim.metrics` renders it as vLLM's `/metrics` at scrape time.
Histograms take bulk observations (`observe(value, count)`), so a multi-step decode of n
sequences over k steps costs k calls, not n·k. Bucket bounds are vLLM's (`vllm/v1/metrics/loggers.py`).
All times are simulated seconds.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

__all__ = [
    "Histogram",
    "EngineStats",
    "TTFT_BUCKETS",
    "ITL_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
]

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)


class Histogram:
    """A cumulative-on-render histogram (counts per bucket, sum, count).

    Args:
        bounds: upper bounds (inclusive, Prometheus `le`), ascending; +Inf is implicit.
    """

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, count: int = 1) -> None:
        """Record `count` observations of `value`."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count
        self.count += count

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, cumulative count)] including `+Inf`, as Prometheus exposes it."""
        out: list[tuple[str, int]] = []
        acc = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):  # counts[-1] is +Inf
            acc += n
            out.append((repr(float(bound)), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out

    @property
    def mean(self) -> float:
        """Mean of the observations (0 when empty)."""
        return self.sum / self.count if self.count else 0.0


@dataclass
class EngineStats:
    """What the engine counted since start (or the last restart).

    Attributes:
        prompt_tokens: prompt tokens of requests that produced their first token (tokens).
        generation_tokens: output tokens produced (tokens).
        preemptions: requests preempted (recompute) for lack of KV blocks.
        prefix_queries, prefix_hits: prefix-cache lookups and hits (tokens), one lookup per
            admission from the waiting queue.
        finished: finished requests by reason (`stop`, `length`, `abort`).
        steps: engine steps executed; busy_s: simulated GPU-busy seconds.
        last_batch_tokens: tokens (prefill + decode sequences) in the last step.
        ttft, itl, e2e, queue: latency histograms (simulated seconds).
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    busy_s: float = 0.0
    last_batch_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    _busy_log: deque[tuple[float, float]] = field(default_factory=deque, repr=False)

    def record_busy(self, start: float, end: float) -> None:
        """Log a busy interval [start, end] (simulated seconds) for `utilization`."""
        self.busy_s += end - start
        log = self._busy_log
        log.append((start, end))
        while len(log) > 4096:
            log.popleft()

    def utilization(self, now: float, window: float = 1.0) -> float:
        """Busy fraction of the last `window` simulated seconds before `now`, 0..1."""
        since = now - window
        busy = 0.0
        for start, end in reversed(self._busy_log):
            if end <= since:
                break
            busy += min(end, now) - max(start, since)
        return max(0.0, min(1.0, busy / window))
