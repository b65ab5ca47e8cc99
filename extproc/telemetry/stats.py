"""Per-endpoint streaming statistics: latency windows, jitter-based backpressure, latency bucket.

One `EndpointStreamStats` per endpoint, stored on `Endpoint.stream_stats`; the response
observers feed it and the scorers read `snapshot()`. Everything runs on the event loop thread.

Windows are bounded by time and by count (whichever drops a sample first):

* TTFT (seconds), one sample per response that produced a first content event;
* ITL (seconds per token), one sample per completed response (its mean time per output token);
* inter-chunk gaps (seconds per token), one sample per body chunk that carried content, divided
  by the tokens it carried when known at that moment, else by its content events times
  `tokens_per_event` — learned from this endpoint's completed responses that reported usage
  (vLLM's `--stream-interval` packs several tokens into one event), 1.0 until then. Samples
  from concurrent responses on the endpoint mix: that is the endpoint's jitter.

Derived values (DESIGN section 8 and the design notes' section 4):

* pressure from the population standard deviation σ of the recent gaps: σ ≥ `light_stddev_ms`
  (15 ms) → light, σ ≥ `heavy_stddev_ms` (25 ms) → heavy; fewer than `min_gap_samples` recent
  gaps → none (too little evidence);
* latency bucket score from the mean recent gap: < 50 ms → 1.0, 50–200 ms → 0.6, > 200 ms → 0.1
  (no recent gaps → 1.0: an idle endpoint shows no slowness);
* in-flight cap factor by pressure: none/light/heavy → 1.0/0.75/0.5.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["EndpointStreamStats", "Pressure", "StreamStatsParams", "StreamStatsSnapshot"]


class Pressure(enum.IntEnum):
    """Backpressure level of an endpoint (also the value of the backpressure gauge)."""

    NONE = 0
    LIGHT = 1
    HEAVY = 2


class StreamStatsParams(BaseModel):
    """Window sizes and thresholds. Invalid values are errors, never silent defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    window_s: float = Field(60.0, gt=0, description="TTFT and ITL windows (seconds)")
    max_samples: int = Field(512, ge=1, description="TTFT and ITL windows (samples)")
    gap_window_s: float = Field(10.0, gt=0, description="recent inter-chunk gap window (seconds)")
    gap_max_samples: int = Field(256, ge=2, description="recent inter-chunk gap window (samples)")
    min_gap_samples: int = Field(8, ge=2, description="fewer recent gaps than this: no pressure")
    recent_itl_samples: int = Field(8, ge=1, description="ITL samples averaged for `itl_recent_s`")
    light_stddev_ms: float = Field(15.0, ge=0, description="σ of gaps at or above this: light pressure")
    heavy_stddev_ms: float = Field(25.0, ge=0, description="σ of gaps at or above this: heavy pressure")
    fast_gap_ms: float = Field(50.0, ge=0, description="mean recent gap below this: fast bucket")
    slow_gap_ms: float = Field(200.0, ge=0, description="mean recent gap above this: slow bucket")
    fast_score: float = Field(1.0, ge=0, le=1)
    medium_score: float = Field(0.6, ge=0, le=1)
    slow_score: float = Field(0.1, ge=0, le=1)
    light_cap_factor: float = Field(0.75, gt=0, le=1, description="in-flight cap multiplier under light pressure")
    heavy_cap_factor: float = Field(0.5, gt=0, le=1, description="in-flight cap multiplier under heavy pressure")
    snapshot_ttl_s: float = Field(0.1, ge=0, description="how long a computed snapshot is reused (seconds)")

    @model_validator(mode="after")
    def _ordered(self) -> StreamStatsParams:
        if self.light_stddev_ms > self.heavy_stddev_ms:
            raise ValueError("light_stddev_ms must not exceed heavy_stddev_ms")
        if self.fast_gap_ms > self.slow_gap_ms:
            raise ValueError("fast_gap_ms must not exceed slow_gap_ms")
        if self.min_gap_samples > self.gap_max_samples:
            raise ValueError("min_gap_samples must not exceed gap_max_samples")
        return self


@dataclass(slots=True, frozen=True)
class StreamStatsSnapshot:
    """What a scorer reads. Latencies in seconds; None where the window is empty.

    Attributes:
        ttft_p95_s: P95 TTFT (nearest rank) over the TTFT window.
        ttft_samples: samples in the TTFT window.
        itl_mean_s / itl_recent_s: mean time per output token over the window / over its
            `recent_itl_samples` newest samples.
        itl_samples: samples in the ITL window.
        gap_mean_s / gap_stddev_s: mean and population std-dev of the recent per-token gaps.
        gap_samples: samples in the gap window.
        pressure: backpressure level.
        latency_score: the latency bucket score in [0, 1].
        inflight_cap_factor: multiplier for the endpoint's in-flight cap, in (0, 1].
        completed / failed: responses recorded as complete / as ended otherwise (counts, lifetime).
    """

    ttft_p95_s: float | None
    ttft_samples: int
    itl_mean_s: float | None
    itl_recent_s: float | None
    itl_samples: int
    gap_mean_s: float | None
    gap_stddev_s: float | None
    gap_samples: int
    pressure: Pressure
    latency_score: float
    inflight_cap_factor: float
    completed: int
    failed: int


class _Window:
    """(monotonic ns, value) samples bounded by age and count."""

    __slots__ = ("_items", "_max_age_ns")

    def __init__(self, max_age_s: float, max_items: int) -> None:
        self._items: deque[tuple[int, float]] = deque(maxlen=max_items)
        self._max_age_ns = int(max_age_s * 1e9)

    def add(self, now_ns: int, value: float) -> None:
        self._items.append((now_ns, value))

    def values(self, now_ns: int) -> list[float]:
        """The samples not older than the window, oldest first (drops the expired ones)."""
        items = self._items
        horizon = now_ns - self._max_age_ns
        while items and items[0][0] < horizon:
            items.popleft()
        return [v for _, v in items]


class EndpointStreamStats:
    """Streaming latency windows and backpressure of one endpoint.

    Args:
        params: windows and thresholds (defaults: the design's 15/25 ms, 50/200 ms, 1.0/0.75/0.5).
        clock_ns: monotonic clock (ns), injectable for tests.
    """

    def __init__(self, params: StreamStatsParams | None = None, *, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.params = p = params or StreamStatsParams()
        self._clock = clock_ns
        self._ttft = _Window(p.window_s, p.max_samples)
        self._itl = _Window(p.window_s, p.max_samples)
        self._gaps = _Window(p.gap_window_s, p.gap_max_samples)
        self._completed = 0
        self._failed = 0
        self._tokens_per_event: float | None = None
        self._snapshot: StreamStatsSnapshot | None = None
        self._snapshot_ns = 0

    def record_gap(self, gap_s: float, now_ns: int | None = None) -> None:
        """One content-carrying chunk arrived `gap_s` seconds per token after the previous one."""
        self._gaps.add(self._clock() if now_ns is None else now_ns, gap_s)

    @property
    def tokens_per_event(self) -> float:
        """Output tokens per SSE content event on this endpoint (moving average over responses
        that reported usage; 1.0 before any did)."""
        return self._tokens_per_event or 1.0

    def record_end(
        self,
        *,
        ok: bool,
        ttft_s: float | None,
        itl_s: float | None,
        tokens_per_event: float | None = None,
        now_ns: int | None = None,
    ) -> None:
        """A response ended.

        Args:
            ok: it completed (False: client abort, backend or stream error).
            ttft_s: its TTFT (seconds), or None when no content event came.
            itl_s: its mean time per output token (seconds), or None when unknown.
            tokens_per_event: its `usage.completion_tokens` / content events, when it had both.
            now_ns: monotonic time of the end (ns); default: now.
        """
        now = self._clock() if now_ns is None else now_ns
        if tokens_per_event is not None and tokens_per_event > 0:
            old = self._tokens_per_event
            # An exponential moving average (weight 0.2 for the newest response): follows a
            # changed --stream-interval within a few responses, shrugs off one odd response.
            self._tokens_per_event = tokens_per_event if old is None else 0.8 * old + 0.2 * tokens_per_event
        if ttft_s is not None:
            self._ttft.add(now, ttft_s)
        if itl_s is not None:
            self._itl.add(now, itl_s)
        if ok:
            self._completed += 1
        else:
            self._failed += 1

    def snapshot(self, now_ns: int | None = None) -> StreamStatsSnapshot:
        """The derived values, recomputed at most once per `snapshot_ttl_s` (so they lag new and
        expired samples by at most that much; 0 recomputes on every call). Cost: O(window) when
        recomputed (a sort of the TTFT window, ≤ `max_samples`), O(1) otherwise."""
        now = self._clock() if now_ns is None else now_ns
        snap = self._snapshot
        if snap is not None and 0 <= now - self._snapshot_ns < self.params.snapshot_ttl_s * 1e9:
            return snap
        snap = self._compute(now)
        self._snapshot = snap
        self._snapshot_ns = now
        return snap

    def pressure(self, now_ns: int | None = None) -> Pressure:
        """The current backpressure level."""
        return self.snapshot(now_ns).pressure

    def ttft_p95_s(self, now_ns: int | None = None) -> float | None:
        """P95 TTFT over the window (seconds), or None without samples (read by
        `compute-aware-scorer` as `endpoint.stream_stats.ttft_p95_s()`)."""
        return self.snapshot(now_ns).ttft_p95_s

    def latency_score(self, now_ns: int | None = None) -> float:
        """The latency bucket score in [0, 1]."""
        return self.snapshot(now_ns).latency_score

    def inflight_cap_factor(self, now_ns: int | None = None) -> float:
        """The multiplier for the endpoint's in-flight cap, in (0, 1]."""
        return self.snapshot(now_ns).inflight_cap_factor

    def _compute(self, now: int) -> StreamStatsSnapshot:
        p = self.params
        ttft = sorted(self._ttft.values(now))
        itl = self._itl.values(now)
        gaps = self._gaps.values(now)
        mean_gap = stddev = None
        if gaps:
            mean_gap = math.fsum(gaps) / len(gaps)
            stddev = math.sqrt(math.fsum((g - mean_gap) ** 2 for g in gaps) / len(gaps))
        pressure = Pressure.NONE
        if stddev is not None and len(gaps) >= p.min_gap_samples:
            sigma_ms = stddev * 1e3
            if sigma_ms >= p.heavy_stddev_ms:
                pressure = Pressure.HEAVY
            elif sigma_ms >= p.light_stddev_ms:
                pressure = Pressure.LIGHT
        if mean_gap is None or mean_gap * 1e3 < p.fast_gap_ms:
            score = p.fast_score
        elif mean_gap * 1e3 <= p.slow_gap_ms:
            score = p.medium_score
        else:
            score = p.slow_score
        cap = {Pressure.NONE: 1.0, Pressure.LIGHT: p.light_cap_factor, Pressure.HEAVY: p.heavy_cap_factor}[pressure]
        recent = itl[-p.recent_itl_samples :]
        return StreamStatsSnapshot(
            ttft_p95_s=ttft[math.ceil(0.95 * len(ttft)) - 1] if ttft else None,
            ttft_samples=len(ttft),
            itl_mean_s=math.fsum(itl) / len(itl) if itl else None,
            itl_recent_s=math.fsum(recent) / len(recent) if recent else None,
            itl_samples=len(itl),
            gap_mean_s=mean_gap,
            gap_stddev_s=stddev,
            gap_samples=len(gaps),
            pressure=pressure,
            latency_score=score,
            inflight_cap_factor=cap,
            completed=self._completed,
            failed=self._failed,
        )
