"""`weight-override-filter`: drop endpoints an operator drained (override factor 0,
`extproc.datastore.overrides`) — unless every candidate is drained, when it keeps them all (a
drain is a preference, not an outage switch). Its twin `weight-override-scorer` applies a
lowered factor. No parameters; an expired override reads as no override.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.datastore.overrides import factor
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("weight-override-filter")
class WeightOverrideFilter(Plugin):
    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        kept = [ep for ep in endpoints if factor(ep, ctx.now) > 0.0]
        return kept if kept else list(endpoints)
