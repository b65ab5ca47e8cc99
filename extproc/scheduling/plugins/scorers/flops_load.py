"""`flops-load-scorer`: prefer endpoints with less FLOPs-weighted in-flight load.

Load = 3 × requests we routed there still before their first token (prefill is compute-bound)
+ 1 × requests after it (decode), per the design notes' weighting; min-max normalised across
candidates (least load → 1).

Parameters:
    token_weighted (bool, default false): load = 3 × (prompt tokens in prefill) / 1000 + 1 ×
        requests in decode, instead of a flat 3 per prefill request (a 30k-token prompt is not
        the same work as a 30-token one).
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import DECODE_WEIGHT, PREFILL_WEIGHT, Endpoint
from extproc.scheduling.framework import SchedulingContext, min_max_inverted
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


@register("flops-load-scorer")
class FlopsLoadScorer(Plugin):
    class Params(Params):
        token_weighted: bool = False

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        if self.params.token_weighted:
            loads = [PREFILL_WEIGHT * ep.prefill_tokens / 1000 + DECODE_WEIGHT * ep.decode_inflight for ep in endpoints]
        else:
            loads = [float(ep.flops_load) for ep in endpoints]
        return min_max_inverted(loads)
