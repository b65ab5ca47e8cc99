"""The saturation gate on real datastore endpoints: the router's own prefill count closes it
the moment a burst is reserved (no scrape needed), other replicas' picks count, a stale scrape
can only close it, the concurrency cap, llm-d's utilization detector, and no counter
underflows when an endpoint leaves and comes back under the same address."""

from __future__ import annotations

from types import SimpleNamespace

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.scraper import EngineMetrics
from extproc.flowcontrol.config import GateConfig
from extproc.flowcontrol.gate import Gate

A, B = "127.0.0.1:18001", "127.0.0.1:18002"
MODEL = "m"


def store() -> Datastore:
    return Datastore([EndpointConfig(address=a, models=[MODEL]) for a in (A, B)])


def routed(ep, prompt: int = 100, output: int = 50):
    request = SimpleNamespace(prompt_tokens=prompt, sequences=1, served_model=MODEL)
    return SimpleNamespace(endpoint=ep, request=request, prefill_tokens=prompt, decode_tokens=output, predicted_ttft_s=None)


def test_a_burst_closes_the_router_gate_as_it_is_reserved():
    ds = store()
    ep = ds.get(A)
    gate = Gate(GateConfig(max_prefill_requests=3))
    held = []
    while gate.admits(routed(ep)):
        held.append(ds.reserve(ep, prompt_tokens=100))
    assert len(held) == 3  # no scrape in between: our own count closed it
    held[0].mark_first_token()
    assert gate.admits(routed(ep))  # one left prefill: room for one more
    for r in held:
        r.release()
    assert ep.prefill_inflight == 0 and ep.inflight == 0


def test_other_replicas_picks_count():
    ds = store()
    ep = ds.get(A)
    gate = Gate(GateConfig(max_prefill_requests=2))
    # What replica sync applies for the others' picks (`notify=False`): the same counters.
    remote = [ds.reserve(ep, prompt_tokens=100, notify=False) for _ in range(2)]
    assert not gate.admits(routed(ep))
    for r in remote:
        r.release()
    assert gate.admits(routed(ep))


def test_the_engines_reported_queue_can_only_close_the_gate():
    ds = store()
    ep = ds.get(A)
    gate = Gate(GateConfig(max_prefill_requests=8, max_engine_waiting=2))
    ep.engine = EngineMetrics(waiting=3, scraped_at=0.0)
    assert not gate.admits(routed(ep))
    ep.engine = EngineMetrics(waiting=0, scraped_at=0.0)
    assert gate.admits(routed(ep))
    ep.engine = None  # never scraped: our own count decides
    assert gate.admits(routed(ep))


def test_predicted_ttft_bound_never_blocks_an_idle_endpoint():
    ds = store()
    ep = ds.get(A)
    gate = Gate(GateConfig(max_prefill_requests=100, max_predicted_ttft_ms=50), clock=lambda: 0.0)
    huge = routed(ep, prompt=10**6)
    assert gate.admits(huge)  # alone it waits for nobody
    ds.reserve(ep, prompt_tokens=10**6, now=0.0)
    assert not gate.admits(routed(ep, prompt=100))
    scored = routed(ep, prompt=100)
    scored.predicted_ttft_s = {A: 0.01}  # the ttft-estimate scorer's own prediction wins
    assert gate.admits(scored)


def test_concurrency_cap_on_requests_and_tokens():
    ds = store()
    ep = ds.get(A)
    by_requests = Gate(GateConfig(mode="concurrency", max_inflight=2))
    by_tokens = Gate(GateConfig(mode="concurrency", max_inflight_tokens=1000))
    r1 = ds.reserve(ep, prompt_tokens=100, context_tokens=600)
    assert by_requests.admits(routed(ep)) and not by_tokens.admits(routed(ep, prompt=500))
    assert by_tokens.admits(routed(ep, prompt=300))
    ds.reserve(ep, prompt_tokens=100)
    assert not by_requests.admits(routed(ep))
    r1.release()
    assert by_requests.admits(routed(ep)) and by_tokens.admits(routed(ep, prompt=500))


def test_utilization_detector_counts_stale_metrics_as_saturated():
    ds = store()
    a, b = ds.get(A), ds.get(B)
    now = 100.0
    gate = Gate(GateConfig(mode="utilization", queue_depth=5, kv_threshold=0.8), ds.for_model, stale_after_s=5.0, clock=lambda: now)
    a.engine = EngineMetrics(waiting=1, kv_usage=0.4, scraped_at=now - 1)
    b.engine = EngineMetrics(waiting=0, kv_usage=0.2, scraped_at=now - 1)
    assert gate.pool_saturation([a, b]) < 1.0 and gate.admits(routed(a))
    b.engine = EngineMetrics(waiting=0, kv_usage=0.2, scraped_at=now - 60)  # stale
    assert gate.pool_saturation([a, b]) == (0.5 + 1.0) / 2
    a.engine = EngineMetrics(waiting=10, kv_usage=0.4, scraped_at=now - 1)
    assert not gate.admits(routed(a))


def test_an_endpoint_back_under_the_same_address_starts_from_zero():
    ds = store()
    old = ds.get(A)
    held = ds.reserve(old, prompt_tokens=100)
    ds.remove_endpoint(A)
    new = ds.add_endpoint(EndpointConfig(address=A, models=[MODEL]))
    assert new is not old and new.inflight == 0
    held.release()  # against the endpoint it was made on
    assert new.inflight == 0 and new.prefill_inflight == 0 and new.prefill_tokens == 0
    assert old.inflight == 0 and old.prefill_inflight == 0
    assert Gate(GateConfig(max_prefill_requests=1)).admits(routed(new))


def test_router_gate_bounds_the_decode_load_not_only_the_prefill_queue():
    # Issue 27's miss (decision 0311): requests past their first token left the router's count,
    # so a flooder's decodes filled the engine's batch. They now count against max_inflight.
    ds = store()
    ep = ds.get(A)
    gate = Gate(GateConfig(max_prefill_requests=8, max_inflight=3))
    held = []
    while gate.admits(routed(ep)):
        r = ds.reserve(ep, prompt_tokens=100)
        r.mark_first_token()  # decoding: no longer in prefill
        held.append(r)
        assert len(held) <= 3
    assert len(held) == 3 and ep.prefill_inflight == 0
    held.pop().release()
    assert gate.admits(routed(ep))  # a stream ended: room for one
    for r in held:
        r.release()


def test_router_gate_bounds_decode_context_tokens():
    ds = store()
    ep = ds.get(A)
    gate = Gate(GateConfig(max_prefill_requests=8, max_inflight=None, max_inflight_tokens=1000))
    big = routed(ep, prompt=5000)
    assert gate.admits(big)  # alone it waits for nobody
    r = ds.reserve(ep, prompt_tokens=5000, context_tokens=5025)
    r.mark_first_token()
    assert not gate.admits(routed(ep))
    r.release()
    assert gate.admits(routed(ep))


def test_the_per_endpoint_test_holds_every_endpoint_bound_of_the_request_test():
    # The runners-up are the endpoints `endpoint_open` passes: in router mode it missed
    # max_inflight, so a runner-up full of decodes was scheduled, then refused by `admits`,
    # and the request queued although another runner-up was open.
    ds = store()
    ep = ds.get(A)
    for mode in ("router", "concurrency"):
        gate = Gate(GateConfig(mode=mode, max_prefill_requests=8, max_inflight=1))
        r = ds.reserve(ep, prompt_tokens=100)
        r.mark_first_token()
        assert not gate.admits(routed(ep)) and not gate.endpoint_open(ep), mode
        r.release()
        assert gate.admits(routed(ep)) and gate.endpoint_open(ep), mode
