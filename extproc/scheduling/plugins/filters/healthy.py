"""`healthy-filter`: drop endpoints whose health probes fail or whose node agent reports a
device fault (`endpoint.node.device_fault`). No parameters."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("healthy-filter")
class HealthyFilter(Plugin):
    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        return [ep for ep in endpoints if ep.healthy and not getattr(ep.node, "device_fault", None)]
