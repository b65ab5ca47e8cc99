"""`stale-metrics-filter`: drop endpoints whose engine metrics are older than the staleness
bound (`scheduling.metrics.stale_after_s`): a hanging `/metrics` usually means a sick engine,
and scores computed from old numbers are wrong either way.

Parameters:
    keep_all_if_all_stale (bool, default true): when every candidate is stale, keep them all
        rather than refuse the request — scores then come from old data, but the fleet keeps
        serving through a metrics outage.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


@register("stale-metrics-filter")
class StaleMetricsFilter(Plugin):
    class Params(Params):
        keep_all_if_all_stale: bool = True

    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        fresh = [ep for ep in endpoints if not ctx.is_stale(ep)]
        if not fresh and self.params.keep_all_if_all_stale:
            return list(endpoints)
        return fresh
