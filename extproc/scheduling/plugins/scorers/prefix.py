"""`prefix-scorer`: the share of the request's prompt each endpoint is believed to hold in its
prefix cache (0..1), from the prefix index — the Gateway API Inference Extension's prefix
scorer, for users who want weighted scoring. Alone it pins a popular prefix to one engine; weigh
it against load scorers, or prefer the default profile, where the cached prefix shortens the
TTFT estimate instead (`ttft-estimate-scorer`). 0 for every endpoint when the prompt has no
full block or prefix tracking is off. No parameters."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("prefix-scorer")
class PrefixScorer(Plugin):
    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        match = ctx.prefix
        if match is None:
            return [0.0] * len(endpoints)
        return [match.matched_fraction(ep.address) for ep in endpoints]
