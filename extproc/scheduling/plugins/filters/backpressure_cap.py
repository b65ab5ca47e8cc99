"""`backpressure-cap-filter`: cap each endpoint's in-flight requests, lower under backpressure.

An endpoint is kept while its in-flight requests (counted by this server) stay below
`max_inflight × inflight_cap_factor`, where the factor comes from its stream statistics
(none 1.0, light 0.75, heavy 0.5 by default; `telemetry.stats`). When every candidate is at its
cap, all are kept (the cap steers load; refusing is admission's job).

Parameters:
    max_inflight (int ≥ 1, default 256): the cap without pressure (requests).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


@register("backpressure-cap-filter")
class BackpressureCapFilter(Plugin):
    class Params(Params):
        max_inflight: int = Field(default=256, ge=1)

    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        cap = self.params.max_inflight
        kept = [
            ep
            for ep in endpoints
            if ep.inflight < cap * (1.0 if ep.stream_stats is None else ep.stream_stats.inflight_cap_factor())
        ]
        return kept or list(endpoints)
