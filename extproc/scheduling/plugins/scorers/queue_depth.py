"""`queue-depth-scorer`: prefer endpoints with fewer requests waiting in the engine.

Waiting = `vllm:num_requests_waiting` from the last scrape plus the requests we routed there
after that scrape started (`Endpoint.unseen`: the engine's numbers cannot include them yet,
and a burst must not all land on the endpoint that looked emptiest). Scores are min-max
normalised across candidates (fewest waiting → 1). No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext, min_max_inverted
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


def waiting(ep: Endpoint) -> int:
    """Engine-reported waiting requests plus ours it cannot have seen yet (count)."""
    base = ep.engine.waiting if ep.engine is not None else 0
    return base + ep.unseen


@register("queue-depth-scorer")
class QueueDepthScorer(Plugin):
    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        return min_max_inverted([waiting(ep) for ep in endpoints])
