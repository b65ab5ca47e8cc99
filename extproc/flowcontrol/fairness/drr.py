"""Deficit round robin charged in tokens of work (Shreedhar & Varghese 1995; Dynamo's router
charges uncached prompt tokens; VTC, Sheng et al. 2024, argues fairness by tokens, not turns).

Each flow, on its turn, earns `drr_quantum_tokens × weight` of credit and sends its head
requests while its credit covers their cost — the request's uncached prompt tokens on the
endpoint the scheduler would choose plus its expected output tokens — then the turn passes.
Over a long backlog each saturating flow's share of tokens converges to its weight's share
(the error is below one largest request per flow). A flow that empties loses its credit
(classic DRR: an idle tenant does not bank a burst).

When no flow's credit covers its head, the rounds every flow would need are skipped at once
(each credited `k` quanta, `k` the fewest rounds any flow needs): one pick costs O(flows),
not O(cost / quantum).
"""

from __future__ import annotations

import math
from typing import Any

from extproc.flowcontrol.queues import BandQueue, Flow, Ticket

__all__ = ["DeficitRoundRobin"]


class DeficitRoundRobin:
    """DRR over the band's ring of flows.

    Args:
        config: `flow_control` (`drr_quantum_tokens`); a flow's quantum is that × its weight.
    """

    def __init__(self, config: Any) -> None:
        self.quantum = float(config.drr_quantum_tokens)

    def pick(self, band: BandQueue) -> Flow:
        flows = band.flows
        for _ in range(2):
            for _ in range(len(flows)):
                flow = next(iter(flows.values()))
                head = flow.head()
                if head is None:  # emptied meanwhile: the controller forgets it; skip
                    band.rotate(flow)
                    continue
                if not flow.topped:
                    flow.deficit += self.quantum * flow.weight
                    flow.topped = True
                if flow.deficit >= head.cost:
                    return flow
                flow.topped = False  # its turn is over: the next one earns a new quantum
                band.rotate(flow)
            # Nobody could pay: skip the rounds in which nobody could (the ring is where it was).
            rounds = min(
                math.ceil((h.cost - f.deficit) / (self.quantum * f.weight))
                for f in flows.values()
                if (h := f.head()) is not None
            )
            if rounds > 1:
                for f in flows.values():
                    f.deficit += (rounds - 1) * self.quantum * f.weight
        return next(iter(flows.values()))  # unreachable in practice: a round later someone pays

    def dispatched(self, band: BandQueue, flow: Flow, ticket: Ticket) -> None:
        flow.deficit -= ticket.cost

    def forget(self, flow: Flow) -> None:
        flow.deficit = 0.0
        flow.topped = False
