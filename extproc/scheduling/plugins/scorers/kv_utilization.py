"""`kv-utilization-scorer`: prefer endpoints with more free KV cache.

Score = 1 − (used + our unsettled reserved blocks) / num_gpu_blocks, from the engine's
`kv_cache_usage_perc` and `cache_config_info`; an endpoint without those scores by
`kv_cache_usage_perc` alone, and one never scraped scores 0.5 (unknown). No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint, effective_kv_usage
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register

__all__ = ["KVUtilizationScorer"]


@register("kv-utilization-scorer")
class KVUtilizationScorer(Plugin):
    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        out = []
        for ep in endpoints:
            usage = effective_kv_usage(ep)
            out.append(0.5 if usage is None else 1.0 - usage)
        return out
