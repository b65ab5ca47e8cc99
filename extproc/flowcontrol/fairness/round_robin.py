"""Round robin over the band's flows: one request per tenant per turn, whatever its size."""

from __future__ import annotations

from typing import Any

from extproc.flowcontrol.queues import BandQueue, Flow, Ticket

__all__ = ["RoundRobin"]


class RoundRobin:
    """The flow at the front of the ring goes, then moves to the back (O(1))."""

    def __init__(self, config: Any = None) -> None:
        pass

    def pick(self, band: BandQueue) -> Flow:
        return next(iter(band.flows.values()))

    def dispatched(self, band: BandQueue, flow: Flow, ticket: Ticket) -> None:
        if flow.id in band.flows:
            band.rotate(flow)

    def forget(self, flow: Flow) -> None:
        pass
