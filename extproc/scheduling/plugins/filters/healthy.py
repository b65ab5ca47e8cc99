"""`healthy-filter`: drop endpoints whose health probes fail, that outlier detection has ejected
for answering 5xx (`scheduling.outlier_detection`), or whose node agent says they must take no
traffic (`endpoint.node.usable` is False: a device fault — ECC errors, retired or remapped rows
pending, a fatal Xid — or an engine the agent finds dead). A stale agent report keeps its last
verdict. If outlier detection has ejected every endpoint that is otherwise fine, they are all
kept. No parameters.

Panic (Envoy's healthy_panic_threshold): when fewer than `ctx.panic_threshold` of the endpoints
pass their probes, the probes say more about the gateway's host or the network than about the
engines (all probes timing out in the same millisecond under CPU starvation), and refusing
everyone would turn slowness into an outage: the filter then keeps every *live* endpoint —
healthy, or failing its probes only by timing out — and notes `ctx.data["health_panic"]`
(the pipeline counts it and logs it). An endpoint that refused the connection or answered an
error status stays out, as does one its node agent calls unusable."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.types import HEALTH_PANIC, PROBE_TIMEOUT
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("healthy-filter")
class HealthyFilter(Plugin):
    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        usable = [ep for ep in endpoints if ep.node is None or ep.node.usable]
        alive = [ep for ep in usable if ep.healthy]
        if len(alive) < ctx.panic_threshold * len(endpoints):
            live = [ep for ep in usable if ep.healthy or ep.last_probe_error == PROBE_TIMEOUT]
            if len(live) > len(alive):
                ctx.data[HEALTH_PANIC] = True
                alive = live
        now = ctx.now
        # When every live endpoint is ejected, keep them all (Envoy's panic threshold does the
        # same): 5xx answers are evidence against one endpoint, not a reason to refuse everyone.
        return [ep for ep in alive if not ep.ejected(now)] or alive
