"""The queue structures of flow control: a ticket per waiting request, a flow per (tenant,
band), a band per priority class, a pool per model.

Removal is lazy: a ticket that leaves early (its client went away, it expired) is marked dead
and its counts given back at once; the ordering container drops it when it reaches the head.
So cancelling is O(1) whatever the queue's length, and the counts (`live`, `bytes`) are exact
at every moment — they are what the limits and the metrics read.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

__all__ = ["Ticket", "Flow", "BandQueue", "Pool"]


class Ticket:
    """One queued request.

    Attributes:
        counted: the pipeline's counted request (`extproc.pipeline.request.Counted`), scheduled
            again at dispatch.
        pool: the model pool it waits for (served model name).
        band: index of its priority band (0 = critical).
        flow: its flow (set when queued).
        cost: what fairness charges it (tokens: uncached prompt + expected output).
        nbytes: its request body (bytes), counted against the byte limits.
        arrived: `clock()` at enqueue (seconds).
        expires: when it is answered 503 `queue_timeout` if still waiting (seconds, same clock).
        deadline: what `edf` orders by (seconds, same clock): its SLO deadline, else `expires`.
        seq: arrival order (global, increasing).
        future: resolved with `Dispatched`, or failed with the `ExtProcError` to answer.
        alive: still queued (False once dispatched, expired, cancelled or failed).
        displaced: a sheddable stream was already evicted for it (one per ticket).
    """

    __slots__ = ("counted", "pool", "band", "flow", "cost", "nbytes", "arrived", "expires", "deadline", "seq", "future", "alive", "displaced")

    def __init__(
        self, counted: Any, pool: str, band: int, cost: int, nbytes: int, arrived: float, expires: float, deadline: float, seq: int, future: asyncio.Future | None
    ) -> None:
        self.counted = counted
        self.pool = pool
        self.band = band
        self.flow: Flow | None = None
        self.cost = cost
        self.nbytes = nbytes
        self.arrived = arrived
        self.expires = expires
        self.deadline = deadline
        self.seq = seq
        self.future = future
        self.alive = True
        self.displaced = False

    def __lt__(self, other: Ticket) -> bool:  # heap tie-break: arrival order
        return self.seq < other.seq


class Flow:
    """One tenant's requests in one band, in the configured order.

    Attributes:
        id: the tenant's identity (never shown: may carry a key's hash).
        label: what metrics and the admin page show (bounded set).
        weight: its fairness weight (> 0).
        order: the ordering container (`extproc.flowcontrol.ordering`).
        live, bytes: tickets queued and their body bytes (count, bytes).
        deficit: deficit round robin's credit (tokens); `topped`: credited this turn.
    """

    __slots__ = ("id", "label", "weight", "order", "live", "bytes", "deficit", "topped")

    def __init__(self, id: str, label: str, weight: float, order: Any) -> None:
        self.id = id
        self.label = label
        self.weight = weight
        self.order = order
        self.live = 0
        self.bytes = 0
        self.deficit = 0.0
        self.topped = False

    def head(self) -> Ticket | None:
        """The next ticket in this flow's order (dead ones dropped), or None."""
        return self.order.head()


class BandQueue:
    """The flows of one priority band that hold at least one ticket, in ring order (insertion
    order of the dict: round robin and DRR rotate by moving a flow to the end), and the band's
    tickets in arrival order (`arrivals`, dead ones dropped lazily: global FCFS reads its head).
    `live`: its tickets queued (count); their bytes are the sum of its flows' (no count of its own:
    only the admin page reads them)."""

    __slots__ = ("index", "name", "flows", "live", "arrivals")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name
        self.flows: dict[str, Flow] = {}
        self.live = 0
        self.arrivals: deque[Ticket] = deque()

    def oldest(self) -> Ticket:
        """The live ticket that arrived first (call only while `live` > 0)."""
        q = self.arrivals
        while not q[0].alive:
            q.popleft()
        return q[0]

    def rotate(self, flow: Flow) -> None:
        """Move `flow` to the end of the ring."""
        del self.flows[flow.id]
        self.flows[flow.id] = flow


class Pool:
    """The queues of one model pool: its bands in priority order, an expiry heap, and the
    weight and the reservations dispatched from its queues per flow id while they last (`inflight`: the
    fair-share headroom reads it; released ones are dropped when it is read, and at the latest
    when `prune_in` more have been added)."""

    __slots__ = ("key", "bands", "live", "expiry", "saturated", "inflight", "prune_in")

    def __init__(self, key: str, band_names: tuple[str, ...]) -> None:
        self.key = key
        self.bands = [BandQueue(i, n) for i, n in enumerate(band_names)]
        self.live = 0
        self.expiry: list[tuple[float, int, Ticket]] = []
        self.saturated = False
        self.inflight: dict[str, tuple[float, list[Any]]] = {}
        self.prune_in = 64
