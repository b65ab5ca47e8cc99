"""The running-load bound and the fair-share headroom together (decision 0311), on real
datastore endpoints and the real router gate: a flooder fills the endpoint up to
`max_inflight`, its decodes included, and waits in the gateway queue; a light tenant's request
behind that queue goes at once while its share of the in-flight requests is below its weighted
share, never past twice the bound; every reservation is returned."""

from __future__ import annotations

from types import SimpleNamespace

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.flowcontrol.config import FlowControlConfig
from extproc.flowcontrol.controller import FlowController
from extproc.flowcontrol.gate import Gate
from extproc.flowcontrol.identity import FlowIdentity

A, B = "127.0.0.1:18011", "127.0.0.1:18012"
MODEL = "m"


def setup(decode: bool = True, **gate) -> tuple[FlowController, Datastore]:
    ds = Datastore([EndpointConfig(address=A, models=[MODEL])])
    ep = ds.get(A)
    cfg = FlowControlConfig(enabled=True, gate={"max_prefill_requests": 8, "max_inflight": 2, **gate})

    def schedule(counted):
        request = SimpleNamespace(prompt_tokens=100, sequences=1, served_model=MODEL)
        return SimpleNamespace(endpoint=ep, request=request, prefill_tokens=100, decode_tokens=50, predicted_ttft_s=None, tenant=counted)

    def reserve(routed):
        r = ds.reserve(ep, prompt_tokens=100)
        if decode:
            r.mark_first_token()  # decoding at once: only the running-load bound holds them
        return r

    return FlowController(cfg, Gate(cfg.gate), schedule=schedule, reserve=reserve), ds


def ident(tenant: str, weight: float = 1.0) -> FlowIdentity:
    return FlowIdentity(tenant, tenant, 1, weight, None, 30.0)


def done(tickets) -> list:
    return [t.future.result() for t in tickets if t.future.done()]


async def test_a_light_tenant_goes_past_a_flooders_queue_and_the_bound_holds_the_flood():
    fc, ds = setup()
    ep = ds.get(A)
    flood = [fc.enqueue("flood", MODEL, ident("flood"), 10, 100) for _ in range(10)]
    fc.run_cycle()
    assert len(done(flood)) == 2 and ep.inflight == 2  # decoding requests hold the bound
    steady = [fc.enqueue("steady", MODEL, ident("steady"), 10, 100) for _ in range(3)]
    fc.run_cycle()
    # Below its fair share, the light tenant goes past the closed gate, up to twice the bound.
    assert len(done(steady)) == 2 and ep.inflight == 4
    assert len(done(flood)) == 2  # the flood still waits in the gateway queue
    for d in done(flood) + done(steady):
        d.reservation.release()
    assert ep.inflight == 0
    fc.close()


async def test_without_headroom_the_light_tenant_waits_for_the_bound():
    fc, ds = setup(fair_share_headroom=False)
    ep = ds.get(A)
    flood = [fc.enqueue("flood", MODEL, ident("flood"), 10, 100) for _ in range(10)]
    fc.run_cycle()
    steady = fc.enqueue("steady", MODEL, ident("steady"), 10, 100)
    fc.run_cycle()
    assert not steady.future.done() and ep.inflight == 2
    for d in done(flood):
        d.reservation.release()
    fc.close()
    assert ep.inflight == 0


async def test_no_headroom_without_a_bound_to_overcommit():
    fc, ds = setup(decode=False, max_inflight=None, max_prefill_requests=1)
    ep = ds.get(A)
    flood = [fc.enqueue("flood", MODEL, ident("flood"), 10, 100) for _ in range(5)]
    fc.run_cycle()
    steady = fc.enqueue("steady", MODEL, ident("steady"), 10, 100)
    fc.run_cycle()
    assert len(done(flood)) == 1 and not steady.future.done() and ep.inflight == 1
    for d in done(flood):
        d.reservation.release()
    fc.close()
    assert ep.inflight == 0


async def test_the_headroom_takes_an_open_runner_up_before_overcommitting_a_closed_endpoint():
    # A light tenant below its share whose favourite is full goes to an open runner-up, as the
    # cycle's own `route` would send it, not past the gate on its favourite.
    ds = Datastore([EndpointConfig(address=a, models=[MODEL]) for a in (A, B)])
    a, b = ds.get(A), ds.get(B)
    cfg = FlowControlConfig(enabled=True, gate={"max_prefill_requests": 8, "max_inflight": 2})

    def schedule(counted):
        choices = [a] if counted.who == "flood" else [a, b]  # the flooder's filters keep only A
        ep, *rest = [e for e in choices if counted.subset is None or counted.subset(e)]
        request = SimpleNamespace(prompt_tokens=100, sequences=1, served_model=MODEL)
        pick = SimpleNamespace(fallbacks=[SimpleNamespace(endpoint=e) for e in rest])
        return SimpleNamespace(
            endpoint=ep, request=request, prefill_tokens=100, decode_tokens=50, predicted_ttft_s=None, result=SimpleNamespace(pick=pick)
        )

    def reserve(routed):
        r = ds.reserve(routed.endpoint, prompt_tokens=100)
        r.mark_first_token()
        return r

    fc = FlowController(cfg, Gate(cfg.gate), schedule=schedule, reserve=reserve)
    flood = [fc.enqueue(SimpleNamespace(who="flood", subset=None), MODEL, ident("flood"), 10, 100) for _ in range(5)]
    fc.run_cycle()
    assert len(done(flood)) == 2 and a.inflight == 2
    steady = fc.enqueue(SimpleNamespace(who="steady", subset=None), MODEL, ident("steady"), 10, 100)
    fc.run_cycle()
    assert steady.future.done() and steady.future.result().routed.endpoint is b
    assert a.inflight == 2 and b.inflight == 1
    for d in done(flood) + done([steady]):
        d.reservation.release()
    fc.close()


async def test_released_reservations_do_not_pile_up_while_the_gate_admits():
    # The headroom reads its per-flow reservations only when the gate refuses; dispatched and
    # released ones were kept until then (for ever without max_inflight, the shipped default).
    for bound in (None, 1000):
        fc, ds = setup(max_inflight=bound)
        for _ in range(500):
            t = fc.enqueue("flood", MODEL, ident("flood"), 10, 100)
            fc.run_cycle()
            t.future.result().reservation.release()
        kept = sum(len(held) for p in fc._pools.values() for _, held in p.inflight.values())  # noqa: SLF001
        assert kept <= 64 + 1, bound
        fc.close()
