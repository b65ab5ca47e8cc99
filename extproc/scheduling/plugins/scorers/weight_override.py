"""`weight-override-scorer`: an operator's lowered weight (`extproc.datastore.overrides`).

Its value is the endpoint's override factor (1 without an active override) and it is
*multiplicative* (`multiplies = True`): the profile runner multiplies the endpoint's weighted
total by it instead of adding it, so a factor of 0.25 cuts the endpoint's score to a quarter
whatever the other scorers' weights. Its configured weight is unused. No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.datastore.overrides import factor
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("weight-override-scorer")
class WeightOverrideScorer(Plugin):
    multiplies = True

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        return [factor(ep, ctx.now) for ep in endpoints]
