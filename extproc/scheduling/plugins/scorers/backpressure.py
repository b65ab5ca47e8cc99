"""`backpressure-scorer`: prefer endpoints whose token rhythm is steady.

Reads the endpoint's response-path statistics (`endpoint.stream_stats`, fed by the stream
observers): the standard deviation of recent inter-token gaps gives a pressure level (σ ≥ 15 ms
light, ≥ 25 ms heavy; thresholds in `telemetry.stats`). Score: none → 1.0, light →
`light_score`, heavy → `heavy_score`. An endpoint without statistics scores 1.0 (no evidence).

Parameters:
    light_score (float 0..1, default 0.5), heavy_score (float 0..1, default 0.0).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


@register("backpressure-scorer")
class BackpressureScorer(Plugin):
    class Params(Params):
        light_score: float = Field(default=0.5, ge=0, le=1)
        heavy_score: float = Field(default=0.0, ge=0, le=1)

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        by_level = (1.0, self.params.light_score, self.params.heavy_score)
        out = []
        for ep in endpoints:
            stats = ep.stream_stats
            out.append(1.0 if stats is None else by_level[int(stats.pressure())])
        return out
