"""Global first come, first served across the band's flows: the flow holding the band's oldest
waiting request goes (llm-d-router's default; it leaves the scheduler free to batch and reuse
cache, and gives a flooding tenant the share it floods with). With `fcfs` ordering inside flows
that request is the one dispatched; with `edf`, its flow's earliest deadline is."""

from __future__ import annotations

from typing import Any

from extproc.flowcontrol.queues import BandQueue, Flow, Ticket

__all__ = ["GlobalFcfs"]


class GlobalFcfs:
    """The band's oldest live ticket's flow (`BandQueue.oldest`: O(1) amortised; scanning the
    flows' heads cost 117 µs per pick with 1,000 tenants, docs/benchmarks/flow-control-cost.md)."""

    def __init__(self, config: Any = None) -> None:
        pass

    def pick(self, band: BandQueue) -> Flow:
        flow = band.oldest().flow
        assert flow is not None
        return flow

    def dispatched(self, band: BandQueue, flow: Flow, ticket: Ticket) -> None:
        pass

    def forget(self, flow: Flow) -> None:
        pass
