"""`stream-latency-scorer`: the design notes' streaming latency bucket.

Recent mean inter-chunk latency of the endpoint's streams (`endpoint.stream_stats`): < 50 ms →
1.0, 50–200 ms → 0.6, > 200 ms → 0.1 (bounds and values in `telemetry.stats`). An endpoint
without statistics scores 1.0 (no evidence). No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("stream-latency-scorer")
class StreamLatencyScorer(Plugin):
    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        return [1.0 if ep.stream_stats is None else ep.stream_stats.latency_score() for ep in endpoints]
