"""`lora-affinity-scorer`: prefer endpoints where the requested LoRA adapter is already loaded.

An adapter not in a GPU slot costs a load before its request can run (from host memory when the
engine keeps it in its CPU cache, else from disk) and, when every slot is taken, an eviction that
the evicted adapter's next request pays for. Per endpoint the adapter's residency tier
(`extproc.datastore.lora.residency_tier`: the engine's residency metrics where it exports them,
else its running adapters plus the adapters this router sent there recently) scores llm-d's
scale (DESIGN section 13): GPU-resident 1.0, CPU-resident 0.7, free slot 0.6, evictable 0.3,
full 0. A request for the base model (no adapter) scores 1 everywhere: no slot is involved.

Spread rule (placement beyond "route where it is loaded", llm-d-router #709): residency alone
pins a hot adapter to the one endpoint that loaded it first while the others idle. The router's
own recent traffic per adapter (`SentAdapters`, decayed with a 30 s half-life) gives the adapter's
share of the pool's requests; an adapter whose traffic is more than `spread` endpoints' fair share
(total / endpoints) wants ⌈its traffic / a fair share⌉ endpoints, and while it is loaded on fewer,
an endpoint where loading it stalls no running adapter (CPU-resident, a free slot, or a slot an
idle adapter holds) scores as if it were loaded: the load scorers then choose, and the adapter is
loaded where there is room, evicting a colder one if need be (its load is paid once and shared by
many requests; on a fleet with more adapters than slots every slot is taken, so "free" alone would
never spread it). Cold adapters (below the threshold) keep the tiers, so they are packed where they
already are, or into a free slot before an eviction. The spread needs `min_requests` of decayed traffic first, so a handful
of requests does not load an adapter everywhere.

Parameters:
    spread (float > 0, default 1.0): how many fair shares of traffic make an adapter hot.
    min_requests (float ≥ 0, default 8): decayed requests of the adapter (across the pool)
        before the spread rule applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field

from extproc.datastore.endpoints import Endpoint
from extproc.datastore.lora import TIER_SCORES, Tier, residency_tier
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


def adapter_tiers(ctx: SchedulingContext, adapter: str, endpoints: Sequence[Endpoint]) -> list[Tier]:
    """Each endpoint's residency tier for `adapter` at `ctx.now`."""
    return [
        residency_tier(adapter, ep.engine.lora if ep.engine is not None else None, ep.lora_sent, ctx.now, ctx.lora_max_loras)
        for ep in endpoints
    ]


def endpoints_wanted(adapter: str, endpoints: Sequence[Endpoint], now: float, spread: float, min_requests: float) -> int:
    """How many endpoints `adapter`'s recent traffic fills (count, ≥ 1): ⌈its decayed requests /
    a fair share⌉ once they pass `spread` fair shares and `min_requests`, else 1. A fair share is
    the pool's decayed requests over its endpoints."""
    mine = total = 0.0
    for ep in endpoints:
        if ep.lora_sent is not None:
            mine += ep.lora_sent.rate(adapter, now)
            total += ep.lora_sent.total(now)
    if len(endpoints) < 2 or total <= 0 or mine < min_requests:
        return 1
    share = total / len(endpoints)
    return min(len(endpoints), math.ceil(mine / share)) if mine > spread * share else 1


@register("lora-affinity-scorer")
class LoraAffinityScorer(Plugin):
    class Params(Params):
        spread: float = Field(default=1.0, gt=0)
        min_requests: float = Field(default=8.0, ge=0)

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        adapter = ctx.request.adapter
        if adapter is None:
            return [1.0] * len(endpoints)
        tiers = adapter_tiers(ctx, adapter, endpoints)
        scores = [TIER_SCORES[t] for t in tiers]
        p = self.params
        wanted = endpoints_wanted(adapter, endpoints, ctx.now, p.spread, p.min_requests)  # type: ignore[attr-defined]
        if wanted > 1 and tiers.count("gpu") < wanted:
            scores = [1.0 if t in ("cpu", "free", "evictable") else s for t, s in zip(tiers, scores)]
        ctx.data["lora_tiers"] = dict(zip((ep.address for ep in endpoints), tiers))
        return scores
