"""`healthy-filter`: drop endpoints whose health probes fail, that outlier detection has ejected
for answering 5xx (`scheduling.outlier_detection`), or whose node agent says they must take no
traffic (`endpoint.node.usable` is False: a device fault — ECC errors, retired or remapped rows
pending, a fatal Xid — or an engine the agent finds dead). A stale agent report keeps its last
verdict. No parameters."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("healthy-filter")
class HealthyFilter(Plugin):
    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        now = ctx.now
        return [ep for ep in endpoints if ep.healthy and not ep.ejected(now) and (ep.node is None or ep.node.usable)]
