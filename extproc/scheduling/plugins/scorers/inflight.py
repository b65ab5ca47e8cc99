"""`inflight-scorer`: prefer endpoints with fewer in-flight requests counted by this server
(the least-request baseline, as a scorer). Min-max normalised (fewest → 1). No parameters."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext, min_max_inverted
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("inflight-scorer")
class InflightScorer(Plugin):
    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        return min_max_inverted([float(ep.inflight) for ep in endpoints])
