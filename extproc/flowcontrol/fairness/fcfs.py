"""Global first come, first served across the band's flows: the head that arrived first goes
(llm-d-router's default; it leaves the scheduler free to batch and reuse cache, and gives a
flooding tenant the share it floods with)."""

from __future__ import annotations

from typing import Any

from extproc.flowcontrol.queues import BandQueue, Flow, Ticket

__all__ = ["GlobalFcfs"]


class GlobalFcfs:
    """Oldest head across flows (O(flows) per pick)."""

    def __init__(self, config: Any = None) -> None:
        pass

    def pick(self, band: BandQueue) -> Flow:
        best: Flow | None = None
        best_seq = 0
        for flow in band.flows.values():
            head = flow.head()
            if head is not None and (best is None or head.seq < best_seq):
                best, best_seq = flow, head.seq
        assert best is not None, "pick on an empty band"
        return best

    def dispatched(self, band: BandQueue, flow: Flow, ticket: Ticket) -> None:
        pass

    def forget(self, flow: Flow) -> None:
        pass
