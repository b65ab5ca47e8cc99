"""`max-score-picker`: the highest total wins; ties (within `tie_epsilon`) are broken uniformly
at random so equal endpoints share a burst instead of the first one taking it all.

Parameters:
    tie_epsilon (float ≥ 0, default 1e-9): totals this close count as equal.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from extproc.scheduling.framework import PickResult, SchedulingContext, ScoredEndpoint
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


@register("max-score-picker")
class MaxScorePicker(Plugin):
    class Params(Params):
        tie_epsilon: float = Field(default=1e-9, ge=0)

    def pick(self, ctx: SchedulingContext, scored: Sequence[ScoredEndpoint]) -> PickResult:
        if not scored:
            raise ValueError("no candidates")
        order = sorted(scored, key=lambda s: s.total, reverse=True)
        best = order[0].total
        ties = [s for s in order if best - s.total <= self.params.tie_epsilon]
        chosen = ties[0] if len(ties) == 1 else ctx.rng.choice(ties)
        return PickResult(chosen, [s for s in order if s is not chosen])
