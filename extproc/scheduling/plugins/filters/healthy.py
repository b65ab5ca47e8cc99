"""`healthy-filter`: drop endpoints whose health probes fail, that outlier detection has ejected
for answering 5xx (`scheduling.outlier_detection`), or whose node agent says they must take no
traffic (`endpoint.node.usable` is False: a device fault — ECC errors, retired or remapped rows
pending, a fatal Xid — or an engine the agent finds dead). A stale agent report keeps its last
verdict. If outlier detection has ejected every endpoint that is otherwise fine, they are all
kept. No parameters."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("healthy-filter")
class HealthyFilter(Plugin):
    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        alive = [ep for ep in endpoints if ep.healthy and (ep.node is None or ep.node.usable)]
        now = ctx.now
        # When every live endpoint is ejected, keep them all (Envoy's panic threshold does the
        # same): 5xx answers are evidence against one endpoint, not a reason to refuse everyone.
        return [ep for ep in alive if not ep.ejected(now)] or alive
