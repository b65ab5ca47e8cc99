"""First come, first served inside a flow."""

from __future__ import annotations

from collections import deque

from extproc.flowcontrol.queues import Ticket

__all__ = ["FcfsOrder"]


class FcfsOrder:
    """Tickets in arrival order (a deque; O(1) push and pop)."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Ticket] = deque()

    def push(self, t: Ticket) -> None:
        self._q.append(t)

    def head(self) -> Ticket | None:
        """The oldest live ticket, or None (dead ones at the front are dropped)."""
        q = self._q
        while q and not q[0].alive:
            q.popleft()
        return q[0] if q else None

    def pop(self) -> Ticket:
        """Remove and return `head()` (call only after it returned a ticket)."""
        return self._q.popleft()

    def __len__(self) -> int:
        return len(self._q)
