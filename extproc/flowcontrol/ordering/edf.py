"""Earliest deadline first inside a flow: a request's deadline is its arrival plus its SLO
(`x-slo-ttft-ms` when trusted, an objective's `ttft_slo_ms`) or else its TTL; ties go by arrival."""

from __future__ import annotations

import heapq

from extproc.flowcontrol.queues import Ticket

__all__ = ["EdfOrder"]


class EdfOrder:
    """Tickets by (deadline, arrival) in a binary heap (O(log n) push and pop)."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h: list[tuple[float, int, Ticket]] = []

    def push(self, t: Ticket) -> None:
        heapq.heappush(self._h, (t.deadline, t.seq, t))

    def head(self) -> Ticket | None:
        """The live ticket with the earliest deadline, or None."""
        h = self._h
        while h and not h[0][2].alive:
            heapq.heappop(h)
        return h[0][2] if h else None

    def pop(self) -> Ticket:
        """Remove and return `head()` (call only after it returned a ticket)."""
        return heapq.heappop(self._h)[2]

    def __len__(self) -> int:
        return len(self._h)
