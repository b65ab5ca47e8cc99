"""The flow controller: bounded queues per model pool, (tenant, band) flows, and the dispatch
cycle that empties them as the gate opens.

A request enters only when it cannot be dispatched at once (the servicer's fast path: no queue
holds anything for its pool and the gate admits the scheduler's choice). It then waits on a
future inside its ext_proc stream; the cycle resolves that future with the routed request and
its reservation — scheduled and reserved in one synchronous step, as the fast path does — or
fails it with the error to answer.

The cycle is a callback on the event loop, not a task: `wake()` schedules it (on arrival, on a
reservation's release or first token, on a scrape), and while anything waits a timer re-runs it
every `tick_s` (prefill credited by time passing, scrapes, expiries). Each pool: drop expired
tickets (503 `queue_timeout`), then dispatch heads — band by strict priority, flow by the
fairness policy, ticket by the flow's ordering — until the gate refuses or the pool is empty;
when it refuses, the band's other flows below their weighted share of the pool's in-flight
requests go past it (the fair-share headroom, decision 0311).
A refused head stops only its own pool. At most `MAX_PER_CYCLE` dispatches per callback, so a
long queue never stalls the loop; the rest go on the next callback.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from extproc.errors import ExtProcError, NoEndpointError, RateLimitedError
from extproc.flowcontrol.config import BANDS, FlowControlConfig
from extproc.flowcontrol.fairness import FAIRNESS
from extproc.flowcontrol.gate import Gate
from extproc.flowcontrol.identity import FlowIdentity, IdentityResolver
from extproc.flowcontrol.metrics import FlowMetrics
from extproc.flowcontrol.ordering import ORDERINGS
from extproc.flowcontrol.queues import Flow, Pool, Ticket

__all__ = ["Dispatched", "FlowController", "NOT_NOW", "not_now", "MAX_PER_CYCLE"]

log = logging.getLogger(__name__)

NOT_NOW = frozenset({"kv_cache_full", "shed_sheddable", "shed_standard"})
"""Error codes of the scheduler that mean "not now" (no KV room, saturation shedding): with flow
control on, such a request waits in its queue instead of being refused."""

MAX_PER_CYCLE = 512
"""Most dispatches in one callback (the next callback follows at once)."""


def not_now(err: ExtProcError) -> bool:
    """True when the scheduler's refusal is about capacity now, not about the request."""
    return err.code in NOT_NOW


class Dispatched(NamedTuple):
    """A queued request's decision: the routed request and its reservation (None in tier mode)."""

    routed: Any
    reservation: Any


class FlowController:
    """Queues and dispatch (see the module docstring).

    Args:
        config: `flow_control`.
        gate: the saturation gate.
        schedule: `RequestPipeline.schedule` (counted → routed; raises `ExtProcError`).
        reserve: `RequestPipeline.reserve` (routed → reservation); called right after
            `schedule`, with no await between.
        metrics: flow metrics, or None.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        config: FlowControlConfig,
        gate: Gate,
        schedule: Callable[[Any], Any],
        reserve: Callable[[Any], Any],
        metrics: FlowMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.gate = gate
        self.identity = IdentityResolver(config)
        self._schedule = schedule
        self._reserve = reserve
        self._metrics = metrics
        self._clock = clock
        self._fairness = FAIRNESS[config.fairness](config)
        self._order = ORDERINGS[config.ordering]
        self._pools: dict[str, Pool] = {}
        self._band_live = [0] * len(BANDS)
        self._band_bytes = [0] * len(BANDS)
        self.live = 0
        """Requests queued now (count)."""
        self.bytes = 0
        """Their body bytes (bytes)."""
        self._seq = 0
        self._soon: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._headroom_on = config.gate.fair_share_headroom and config.gate.max_inflight is not None
        """The fair-share headroom acts (it needs `max_inflight` to bound its overcommit)."""
        self.evictable: dict[Any, str] = {}
        """Displacement: in-flight sheddable streams that can be evicted → their pool, oldest first."""

    # -- the request side ----------------------------------------------------------------------
    def idle(self, pool: str) -> bool:
        """Nothing queued for `pool` (the fast path's first test; a dict lookup)."""
        p = self._pools.get(pool)
        return p is None or p.live == 0

    def enqueue(self, counted: Any, pool: str, ident: FlowIdentity, nbytes: int, cost: int) -> Ticket:
        """Queue a request; await `ticket.future` for its `Dispatched` (or its error).

        Args:
            counted: the pipeline's counted request.
            pool: its model pool (served model name).
            ident: its flow (`IdentityResolver.resolve`).
            nbytes: its body (bytes). cost: what fairness charges (tokens).

        Raises:
            RateLimitedError: a queue bound is reached (429 `queue_full`, with retry-after).
            NoEndpointError: the server is shutting down (503 `shutting_down`).
        """
        cfg = self.config
        if self._closed:
            raise NoEndpointError("the gateway is shutting down; retry", code="shutting_down")
        band_name = BANDS[ident.band]
        limits = cfg.bands[band_name]
        full = None
        if self.live >= cfg.max_requests or self.bytes + nbytes > cfg.max_bytes:
            full = f"the gateway's queues are full ({self.live} requests, {self.bytes} bytes)"
        elif (limits.max_requests is not None and self._band_live[ident.band] >= limits.max_requests) or (
            limits.max_bytes is not None and self._band_bytes[ident.band] + nbytes > limits.max_bytes
        ):
            full = f"the gateway's {band_name} queue is full ({self._band_live[ident.band]} requests)"
        if full is not None:
            self._count(band_name, "queue_full")
            raise RateLimitedError(f"{full}; retry after {cfg.retry_after_s} s", retry_after_s=cfg.retry_after_s, code="queue_full")
        now = self._clock()
        self._seq += 1
        expires = now + ident.ttl_s
        deadline = now + ident.slo_s if ident.slo_s is not None else expires
        t = Ticket(counted, pool, ident.band, cost, nbytes, now, expires, deadline, self._seq, asyncio.get_running_loop().create_future())
        p = self._pools.get(pool)
        if p is None:
            p = self._pools[pool] = Pool(pool, BANDS)
        band = p.bands[ident.band]
        flow = band.flows.get(ident.id)
        if flow is None:
            flow = band.flows[ident.id] = Flow(ident.id, ident.label, ident.weight, self._order())
        t.flow = flow
        flow.order.push(t)
        band.arrivals.append(t)
        flow.live += 1
        flow.bytes += nbytes
        band.live += 1
        p.live += 1
        self.live += 1
        self.bytes += nbytes
        self._band_live[ident.band] += 1
        self._band_bytes[ident.band] += nbytes
        heapq.heappush(p.expiry, (expires, t.seq, t))
        if len(p.expiry) > 2 * p.live + 64:  # dispatched tickets wait there for their expiry: compact
            p.expiry = [e for e in p.expiry if e[2].alive]
            heapq.heapify(p.expiry)
        m = self._metrics
        if m is not None:
            m.child(m.queued, band_name, flow.label).inc()
            m.child(m.queued_bytes, band_name, flow.label).inc(nbytes)
            self._count(band_name, "queued")
        self.wake()
        return t

    def cancel(self, t: Ticket) -> None:
        """The waiter is gone (client disconnect, stream cancelled): remove its ticket at once,
        or, when it was dispatched but the waiter never resumed, release the reservation made
        for it. Idempotent."""
        if t.alive:
            self._remove(t, "cancelled")
            return
        fut = t.future
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            reservation = fut.result().reservation
            if reservation is not None:
                reservation.release()
            t.future = None

    def route(self, counted: Any) -> tuple[Any, bool]:
        """Schedule `counted` and ask the gate: `(routed, admitted)`. When the gate refuses the
        scheduler's choice, schedule once more among that choice's runners-up (the endpoints its
        filters kept) that are healthy and pass the gate's per-endpoint test
        (`Gate.endpoint_open`; the request's own subset still applies): a prefix-affine
        favourite busy in prefill must not hold a request another endpoint can take now, nor —
        as the head of its pool's queue — every request queued behind it. `routed` is the first
        choice when nothing is admitted (what fairness charges).

        Raises:
            ExtProcError: the scheduler's refusal of the first choice ("not now" included: the
                caller queues on it).
        """
        routed = self._schedule(counted)
        if self.gate.admits(routed):
            return routed, True
        is_open = self.gate.endpoint_open
        if is_open is None or getattr(routed, "endpoint", None) is None:
            return routed, False
        # Among the first run's runners-up only (they passed its filters): an endpoint a filter
        # removed (drained, ejected, stale, unhealthy) is idle because nothing goes there, and
        # alone in a narrowed pool the filters' keep-all fallbacks and health panic let it back in.
        pick = routed.result.pick if getattr(routed, "result", None) is not None else None
        runners_up = {id(s.endpoint) for s in pick.fallbacks if s.endpoint.healthy and is_open(s.endpoint)} if pick is not None else set()
        if not runners_up:  # a closed gate everywhere: no second scheduling
            return routed, False
        own = counted.subset
        counted.subset = lambda ep: id(ep) in runners_up and (own is None or own(ep))
        try:
            other = self._schedule(counted)
        except ExtProcError as err:
            if not_now(err) or err.code == "no_endpoint_in_subset":
                return routed, False
            raise
        finally:
            counted.subset = own
        return (other, True) if self.gate.admits(other) else (routed, False)

    def track(self, stream: Any, pool: str) -> None:
        """Displacement: `stream` (an in-flight sheddable request whose response we see) may be
        evicted for a critical request of `pool`; it sets `stream.evict` when chosen."""
        self.evictable[stream] = pool

    def untrack(self, stream: Any) -> None:
        """The stream ended (or was evicted): no longer a candidate."""
        self.evictable.pop(stream, None)

    def _displace(self, pool: str) -> bool:
        """Evict the most recently started tracked stream of `pool` (its next response chunk is
        answered with an ImmediateResponse, and its end frees its endpoint); False: none."""
        victim = next((s for s in reversed(self.evictable) if self.evictable[s] == pool), None)
        if victim is None:
            return False
        del self.evictable[victim]
        victim.evict = True
        self._count(BANDS[-1], "displaced")
        log.info("displacement: a sheddable request in flight is evicted for a waiting critical one (model %s)", pool)
        return True

    # -- the dispatch cycle --------------------------------------------------------------------
    def wake(self) -> None:
        """Run a dispatch cycle soon (no-op when nothing waits or one is already scheduled)."""
        if self.live and self._soon is None and not self._closed:
            self._soon = asyncio.get_running_loop().call_soon(self._cycle)

    def _on_timer(self) -> None:
        self._timer = None
        self.wake()

    def _cycle(self) -> None:
        self._soon = None
        started = time.perf_counter()
        now = self._clock()
        budget = MAX_PER_CYCLE
        for p in list(self._pools.values()):
            if not p.live:
                continue
            self._expire(p, now)
            budget = self._drain(p, budget)
        m = self._metrics
        if m is not None:
            m.dispatch_cycle_seconds.observe(time.perf_counter() - started)
        if not self.live:
            return
        if budget <= 0:
            self.wake()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.config.tick_s, self._on_timer)

    def run_cycle(self) -> None:
        """One dispatch cycle now (tests and the benchmark; the loop runs it by `wake()`)."""
        if self._soon is not None:
            self._soon.cancel()
        self._cycle()

    def _expire(self, p: Pool, now: float) -> None:
        heap = p.expiry
        while heap and heap[0][0] <= now:
            t = heapq.heappop(heap)[2]
            if not t.alive:
                continue
            waited = now - t.arrived
            self._remove(t, "expired")
            if t.future is not None and not t.future.done():
                t.future.set_exception(
                    NoEndpointError(
                        f"no endpoint could take this request within its {waited:.1f} s queue deadline "
                        f"({BANDS[t.band]} band); retry later",
                        code="queue_timeout",
                    )
                )

    def _drain(self, p: Pool, budget: int) -> int:
        blocked: Ticket | None = None  # the head the gate (or "not now") refused
        while p.live and budget > 0:
            band = next(b for b in p.bands if b.live)  # strict priority
            flow = self._fairness.pick(band)
            t = flow.head()
            assert t is not None
            if t.future is None or t.future.done():  # its waiter was cancelled a moment ago
                self._remove(t, "cancelled")
                continue
            try:
                routed, admitted = self.route(t.counted)
            except ExtProcError as err:
                if not_now(err):
                    blocked = t
                    break
                self._fail(t, err)
                continue
            except Exception:
                log.exception("scheduling a queued request failed")
                self._fail(t, ExtProcError("internal error while routing the request"))
                continue
            if not admitted:
                shares = self._shares(p, band) if self._headroom_on else None
                if shares is None or not (self._room_over(routed) and self._below_fair_share(flow, shares)):
                    blocked = t
                    if shares is not None:
                        budget = self._headroom(p, band, flow, budget, shares)
                    break
            if self._dispatch(p, band, flow, t, routed):
                budget -= 1
        saturated = blocked is not None
        if blocked is not None and blocked.band == 0 and not blocked.displaced and self.config.displacement:
            blocked.displaced = self._displace(p.key)
        if saturated != p.saturated:
            p.saturated = saturated
            m = self._metrics
            if m is not None:
                m.child(m.pool_saturated, p.key).set(1 if saturated else 0)
        return budget

    def _dispatch(self, p: Pool, band: Any, flow: Flow, t: Ticket, routed: Any) -> bool:
        """Reserve `routed` for `t` and hand both to its waiter; False when reserving failed
        (the ticket is answered 500)."""
        try:
            reservation = self._reserve(routed)
        except Exception:
            log.exception("reserving a queued request failed")
            self._fail(t, ExtProcError("internal error while routing the request"))
            return False
        flow.order.pop()
        self._fairness.dispatched(band, flow, t)
        self._remove(t, "dispatched")
        if reservation is not None and self._headroom_on:
            p.inflight.setdefault(flow.id, (flow.weight, []))[1].append(reservation)
            p.prune_in -= 1
            if p.prune_in <= 0:  # the cycle reads them only when the gate refuses: never let them pile up
                self._held(p)
        assert t.future is not None
        t.future.set_result(Dispatched(routed, reservation))
        return True

    def _held(self, p: Pool) -> dict[str, tuple[float, int]]:
        """Per flow id: (its weight, its requests dispatched from `p`'s queues and not yet
        released (count)); released reservations are dropped here, and the next prune comes
        after as many dispatches again plus 64 (amortised O(1) per dispatch)."""
        out = {}
        for fid, (weight, held) in list(p.inflight.items()):
            held[:] = [r for r in held if not r.released]
            if held:
                out[fid] = (weight, len(held))
            else:
                del p.inflight[fid]
        p.prune_in = sum(n for _, n in out.values()) + 64
        return out

    def _shares(self, p: Pool, band: Any) -> tuple[dict[str, tuple[float, int]], int, float]:
        """The headroom's view of `p`: per flow id (weight, held), the held total (count), and
        Σ weights of the flows holding some or queued in `band`."""
        held = self._held(p)
        weights = sum(f.weight for f in band.flows.values())
        weights += sum(w for fid, (w, _) in held.items() if fid not in band.flows)
        return held, sum(n for _, n in held.values()), weights

    def _room_over(self, routed: Any) -> bool:
        """The overcommit's own bound: the routed endpoint holds fewer than twice `max_inflight`
        (no `max_inflight`: no headroom, an overcommit with nothing to bound it)."""
        cap = self.config.gate.max_inflight
        ep = getattr(routed, "endpoint", None)
        return ep is not None and cap is not None and ep.inflight < 2 * cap

    @staticmethod
    def _below_fair_share(flow: Flow, shares: tuple[dict[str, tuple[float, int]], int, float]) -> bool:
        """The fair-share headroom (decision 0311): `flow` holds fewer of the pool's in-flight
        requests (those dispatched from its queues) than its weighted share of them, weight /
        Σ weights of the flows holding some or queued in the band (`shares`: `_shares`). Such a
        request goes past a closed gate — a light tenant never waits behind a flooder's queue —
        but never past twice the endpoint's `max_inflight` (`_room_over`, the caller's test).
        A flow alone holds its whole share: it never goes past the gate."""
        held, total, weights = shares
        return held.get(flow.id, (flow.weight, 0))[1] < total * flow.weight / weights

    def _headroom(self, p: Pool, band: Any, refused: Flow, budget: int, shares: tuple[dict[str, tuple[float, int]], int, float]) -> int:
        """The gate refused `refused`'s head: dispatch the heads of the band's other flows that
        are below their fair share (`_below_fair_share`), each as long as it stays below, routed
        as the cycle routes (`route`: an open runner-up first, else past the closed gate); stops
        at the first endpoint at twice its bound. One pass over the band's flows and one `route`
        per head dispatched (plus the one that stops it). `shares`: `_shares(p, band)`, read
        when the gate refused. Returns the budget left."""
        held, total, weights = shares
        for flow in list(band.flows.values()):
            if flow is refused:
                continue
            mine = held.get(flow.id, (flow.weight, 0))[1]
            while budget > 0 and flow.live and mine < total * flow.weight / weights:
                t = flow.head()
                if t is None or t.future is None or t.future.done():
                    break
                try:
                    routed, admitted = self.route(t.counted)  # an open runner-up before an overcommit
                except ExtProcError:
                    break  # "not now" or its own error: its turn in the cycle answers it
                if not admitted and not self._room_over(routed):
                    return budget
                if not self._dispatch(p, band, flow, t, routed):
                    break
                budget -= 1
                mine += 1
                total += 1
        return budget

    def _fail(self, t: Ticket, err: ExtProcError) -> None:
        self._remove(t, "failed")
        if t.future is not None and not t.future.done():
            t.future.set_exception(err)

    def _remove(self, t: Ticket, outcome: str) -> None:
        """Take a live ticket out of every count (its container drops it lazily)."""
        t.alive = False
        flow = t.flow
        assert flow is not None
        p = self._pools[t.pool]
        band = p.bands[t.band]
        flow.live -= 1
        flow.bytes -= t.nbytes
        band.live -= 1
        p.live -= 1
        self.live -= 1
        self.bytes -= t.nbytes
        self._band_live[t.band] -= 1
        self._band_bytes[t.band] -= t.nbytes
        if flow.live == 0:
            if band.flows.get(flow.id) is flow:
                del band.flows[flow.id]
            self._fairness.forget(flow)
        m = self._metrics
        if m is not None:
            name = band.name
            m.child(m.queued, name, flow.label).dec()
            m.child(m.queued_bytes, name, flow.label).dec(t.nbytes)
            m.child(m.queue_seconds, name, outcome).observe(max(0.0, self._clock() - t.arrived))
            self._count(name, outcome)
        if not band.live:
            band.arrivals.clear()
        elif len(band.arrivals) > 2 * band.live + 64:
            # Only global FCFS pops its head; under the other policies dispatched tickets stay
            # there (holding their counted request) while the band never empties: compact.
            band.arrivals = deque(a for a in band.arrivals if a.alive)
        if not p.live:
            p.expiry.clear()

    def _count(self, band: str, outcome: str) -> None:
        m = self._metrics
        if m is not None:
            m.child(m.requests, band, outcome).inc()

    def count_immediate(self, band: str) -> None:
        """Count a request dispatched by the fast path (never queued)."""
        self._count(band, "immediate")

    # -- lifecycle and views -------------------------------------------------------------------
    def close(self) -> int:
        """Shutdown: answer every queued request 503 `shutting_down` and refuse new ones.
        Returns how many were answered."""
        self._closed = True
        for handle in (self._soon, self._timer):
            if handle is not None:
                handle.cancel()
        self._soon = self._timer = None
        answered = 0
        for p in self._pools.values():
            for _, _, t in list(p.expiry):
                if not t.alive:
                    continue
                self._remove(t, "shutdown")
                answered += 1
                if t.future is not None and not t.future.done():
                    t.future.set_exception(NoEndpointError("the gateway is shutting down; retry", code="shutting_down"))
        return answered

    def snapshot(self, now: float | None = None, max_flows: int = 50) -> dict[str, Any]:
        """The queues as the admin page shows them: totals, then per pool and band the flows
        with the most requests waiting (labels only; oldest wait in seconds)."""
        now = self._clock() if now is None else now
        pools = []
        for p in self._pools.values():
            bands = []
            for b in p.bands:
                flows = sorted(b.flows.values(), key=lambda f: -f.live)[:max_flows]
                rows = []
                for f in flows:
                    head = f.head()
                    rows.append(
                        {
                            "tenant": f.label,
                            "queued": f.live,
                            "bytes": f.bytes,
                            "weight": f.weight,
                            "deficit_tokens": round(f.deficit, 1),
                            "head_wait_s": round(now - head.arrived, 3) if head is not None else None,
                        }
                    )
                bands.append({"band": b.name, "queued": b.live, "bytes": sum(f.bytes for f in b.flows.values()), "flows": len(b.flows), "top_flows": rows})
            pools.append({"model": p.key, "queued": p.live, "saturated": p.saturated, "bands": bands})
        cfg = self.config
        return {
            "enabled": True,
            "fairness": cfg.fairness,
            "ordering": cfg.ordering,
            "gate": cfg.gate.mode,
            "queued": self.live,
            "bytes": self.bytes,
            "max_requests": cfg.max_requests,
            "max_bytes": cfg.max_bytes,
            "pools": pools,
        }
