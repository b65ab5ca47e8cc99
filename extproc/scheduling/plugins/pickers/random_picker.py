"""`random-picker`: uniform choice among the candidates (a baseline). No parameters."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.framework import PickResult, SchedulingContext, ScoredEndpoint
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("random-picker")
class RandomPicker(Plugin):
    def pick(self, ctx: SchedulingContext, scored: Sequence[ScoredEndpoint]) -> PickResult:
        if not scored:
            raise ValueError("no candidates")
        chosen = ctx.rng.choice(list(scored))
        return PickResult(chosen, [s for s in scored if s is not chosen])
