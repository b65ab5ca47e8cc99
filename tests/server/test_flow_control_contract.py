"""Flow control through the real servicer over gRPC, as Envoy drives it: a request the fleet
cannot take now waits inside its ext_proc stream and is routed when room appears (with
`x-llm-queue-ms`), bounded queues answer 429 with retry-after, expiry 503, a client that leaves
while queued leaves nothing behind (queue counts, rate-limit charge), shutdown answers every
queued request 503, and critical requests go before lower bands."""

from __future__ import annotations

import asyncio
import time

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.server.test_contract import body_msg, chat_body, error_of, headers_msg, set_headers, wait_until

SECRET = "sk-flow-control-0123456789"


def _fc(**extra) -> dict:
    """Flow control on; each endpoint takes one request before its first token."""
    gate = {"mode": "router", "max_prefill_requests": 1, **extra.pop("gate", {})}
    return {"enabled": True, "gate": gate, **extra}


def _ok_headers() -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"), base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")]
    )
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm, end_of_stream=False))


async def _send(stub, body: bytes | None = None, extra: dict[str, bytes] | None = None):
    """Open a generation stream and send its headers and body; returns the call (the body's
    answer not read yet: it comes when the request is dispatched)."""
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions", extra=extra))
    await call.read()
    await call.write(body_msg(body or chat_body(max_tokens=16)))
    return call


async def _routed(call) -> str:
    reply = await call.read()
    assert reply.WhichOneof("response") == "request_body", reply
    return set_headers(reply.request_body.response)["x-gateway-destination-endpoint"]


async def _fill(app, stub) -> list:
    """Hold both endpoints' one prefill slot (two routed streams, no first token yet)."""
    calls = [await _send(stub) for _ in range(2)]
    for c in calls:
        await _routed(c)
    assert {ep.prefill_inflight for ep in app.store.all()} == {1}
    return calls


async def test_a_burst_beyond_capacity_waits_and_is_routed_when_room_appears(make_app):
    app = await make_app(flow_control=_fc())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = await _fill(app, stub)
        waiting = await _send(stub)
        read = asyncio.ensure_future(_routed(waiting))
        await wait_until(lambda: app.flow.live == 1)
        await asyncio.sleep(0.1)
        assert not read.done(), "routed while every endpoint was busy"
        # The first token of one held request frees its endpoint's prefill slot.
        await held[0].write(_ok_headers())
        await held[0].read()
        endpoint = await asyncio.wait_for(read, 5)
        assert app.flow.live == 0 and app.store.get(endpoint).inflight == 2
        await waiting.write(_ok_headers())
        added = {o.header.key: o.header.raw_value.decode() for o in (await waiting.read()).response_headers.response.header_mutation.set_headers}
        assert int(added["x-llm-queue-ms"]) >= 100
        for c in [*held, waiting]:
            c.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)
    assert app.metrics.registry.get_sample_value("llm_extproc_flow_requests_total", {"band": "standard", "outcome": "dispatched"}) == 1


async def test_full_queues_answer_429_with_retry_after(make_app):
    app = await make_app(flow_control=_fc(max_requests=1, retry_after_s=3))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = await _fill(app, stub)
        queued = await _send(stub)
        await wait_until(lambda: app.flow.live == 1)
        refused = await _send(stub)
        status, body, hdrs = error_of(await refused.read())
        assert status == 429 and body["error"]["code"] == "queue_full" and hdrs["retry-after"] == "3"
        for c in [*held, queued, refused]:
            c.cancel()
    await wait_until(lambda: app.store.open_reservations == 0 and app.flow.live == 0)


async def test_a_request_past_its_band_ttl_is_a_503(make_app, tmp_path):
    log = tmp_path / "decisions.jsonl"
    app = await make_app(flow_control=_fc(bands={"standard": {"ttl_s": 0.2}}), decision_log={"path": str(log)})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = await _fill(app, stub)
        waiting = await _send(stub)
        status, body, _ = error_of(await asyncio.wait_for(waiting.read(), 5))
        assert status == 503 and body["error"]["code"] == "queue_timeout"
        assert app.flow.live == 0 and app.flow.bytes == 0
        for c in [*held, waiting]:
            c.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)
    await app.aclose(grace_s=0)  # the decision log's last lines written
    lines = [orjson.loads(line) for line in log.read_text().splitlines()]
    assert [r["queue_ms"] for r in lines if r["outcome"] == "routed"] == [None, None]  # never queued
    (expired,) = [r for r in lines if r["outcome"] == "rejected"]
    assert expired["reason"] == "queue_timeout" and expired["status"] == 503 and expired["queue_ms"] >= 200


async def _nothing_stale_dispatched(app, held: list) -> None:
    """After every queued client left: room appears on a held endpoint (its first token) and no
    reservation is made for the departed; then the held streams end."""
    await held[0].write(_ok_headers())
    await held[0].read()
    await asyncio.sleep(0.1)
    assert app.store.open_reservations == 2
    for c in held:
        c.cancel()


async def test_a_client_leaving_while_queued_leaves_nothing_behind(make_app):
    limited = {"enabled": True, "default": {"tokens_per_minute": 100_000, "requests_per_minute": 1000}}
    app = await make_app(flow_control=_fc(), ratelimit=limited)
    auth = {"authorization": f"Bearer {SECRET}".encode()}
    tenant = app.ratelimit.tenant({"authorization": f"Bearer {SECRET}"})

    async def used() -> tuple[int, int]:
        window = (await app.ratelimit.backend.peek(app.ratelimit.scopes(tenant, "Qwen/Qwen3-8B"))).uses[0]
        return window.tokens, window.requests

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = await _fill(app, stub)
        before = await used()
        waiting = [await _send(stub, extra=auth) for _ in range(20)]
        await wait_until(lambda: app.flow.live == 20)
        charged = await used()
        assert charged[0] > before[0]  # admitted (charged) before it queued
        for c in waiting:
            c.cancel()
        await wait_until(lambda: app.flow.live == 0)
        await wait_until(lambda: app.servicer.active_streams == 2)
        assert app.flow.bytes == 0
        assert (await used())[0] == before[0], "the charge of a request that left while queued is given back"
        assert app.store.open_reservations == 2
        await _nothing_stale_dispatched(app, held)
    await wait_until(lambda: app.store.open_reservations == 0)
    assert app.metrics.registry.get_sample_value("llm_extproc_flow_queued_requests", {"band": "standard", "tenant": tenant.label}) == 0


async def test_shutdown_answers_queued_requests_503(make_app):
    app = await make_app(flow_control=_fc())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = await _fill(app, stub)
        waiting = [await _send(stub) for _ in range(3)]
        await wait_until(lambda: app.flow.live == 3)
        closing = asyncio.create_task(app.aclose(grace_s=5))
        for c in waiting:
            status, body, _ = error_of(await asyncio.wait_for(c.read(), 2))
            assert status == 503 and body["error"]["code"] == "shutting_down"
        for c in [*held, *waiting]:  # Envoy ends a stream answered with an ImmediateResponse
            c.cancel()
        await asyncio.wait_for(closing, 6)
    assert app.store.open_reservations == 0 and app.flow.live == 0


async def test_critical_goes_before_queued_lower_bands(make_app):
    priority = {"priority": {"trusted_header": "x-trusted-priority"}}
    app = await make_app(flow_control=_fc(), admission=priority)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = await _fill(app, stub)
        sheddable = await _send(stub, extra={"x-llm-priority": b"sheddable"})
        await wait_until(lambda: app.flow.live == 1)
        critical = await _send(stub, extra={"x-trusted-priority": b"critical"})
        await wait_until(lambda: app.flow.live == 2)
        first = asyncio.ensure_future(_routed(critical))
        later = asyncio.ensure_future(_routed(sheddable))
        await held[0].write(_ok_headers())
        await held[0].read()
        await asyncio.wait_for(first, 5)
        await asyncio.sleep(0.1)
        assert not later.done(), "the sheddable request went before (or beside) the critical one"
        await held[1].write(_ok_headers())
        await held[1].read()
        await asyncio.wait_for(later, 5)
        for c in [*held, sheddable, critical]:
            c.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)


async def test_queues_are_shown_live_on_the_admin_api(make_app):
    import httpx

    app = await make_app(flow_control=_fc(), admin={"enabled": True})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        held = await _fill(app, stub)
        waiting = await _send(stub)
        await wait_until(lambda: app.flow.live == 1)
        async with httpx.AsyncClient(trust_env=False) as client:
            shown = (await client.get(f"http://127.0.0.1:{app.admin_port}/api/v1/queues")).json()
        assert shown["queued"] == 1 and shown["pools"][0]["saturated"] is True
        band = next(b for b in shown["pools"][0]["bands"] if b["band"] == "standard")
        assert band["queued"] == 1 and band["top_flows"][0]["tenant"] == "anonymous"
        for c in [*held, waiting]:
            c.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)


async def test_the_endpoint_picker_protocol_mode_queues_too(make_app):
    from tests.server.epp_gateway import Exchange, open_stream, request_body, request_headers, response_headers

    app = await make_app(flow_control=_fc(), protocol={"mode": "epp"})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:

        async def pick():
            call = open_stream(ch)
            await call.write(request_headers("POST", "/v1/chat/completions"))
            await call.write(request_body(chat_body(max_tokens=16), end=True))
            return call

        async def picked(call) -> Exchange:
            ex = Exchange()
            ex.take(await call.read())
            ex.take(await call.read())
            return ex

        held = [await pick() for _ in range(2)]
        for c in held:
            await picked(c)
        waiting = await pick()
        answer = asyncio.ensure_future(picked(waiting))
        await wait_until(lambda: app.flow.live == 1)
        await held[0].write(response_headers(200))
        await held[0].read()
        ex = await asyncio.wait_for(answer, 5)
        assert ex.destination and ex.metadata_destination == ex.destination
        for c in [*held, waiting]:
            c.cancel()
    await wait_until(lambda: app.store.open_reservations == 0 and app.flow.live == 0)


async def test_two_thousand_streams_cancelled_while_queued_leak_nothing(make_app):
    """Issue 27's soak shape in process: 2,000 requests queued, every stream cancelled (the client
    went away); queue counts, bytes, the tenant's charges and the in-flight counts all return to
    what they were, and room that appears later dispatches nothing."""
    limited = {"enabled": True, "default": {"tokens_per_minute": 10**9, "requests_per_minute": 10**6, "max_concurrent_requests": 5000}}
    app = await make_app(flow_control=_fc(max_requests=5000), ratelimit=limited)
    tenant = app.ratelimit.tenant({})
    servicer = app.servicer

    class Ctx:
        async def abort(self, code, details):  # pragma: no cover - a well-formed stream never aborts
            raise AssertionError(details)

    async def client(i: int, answered: list) -> None:
        async def incoming():
            yield headers_msg("POST", "/v1/chat/completions")
            yield body_msg(chat_body(f"request {i}", max_tokens=16))
            await asyncio.Event().wait()  # the client never says more

        async for reply in servicer.Process(incoming(), Ctx()):
            answered.append(reply.WhichOneof("response"))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        held = await _fill(app, pb_grpc.ExternalProcessorStub(ch))
        window = app.ratelimit.backend.peek
        before = (await window(app.ratelimit.scopes(tenant, "Qwen/Qwen3-8B"))).uses[0]
        answered: list = []
        tasks = [asyncio.ensure_future(client(i, answered)) for i in range(2000)]
        await wait_until(lambda: app.flow.live == 2000, timeout=60)
        assert answered.count("request_body") == 0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert app.flow.live == 0 and app.flow.bytes == 0
        await wait_until(lambda: servicer.active_streams == 2)
        after = (await window(app.ratelimit.scopes(tenant, "Qwen/Qwen3-8B"))).uses[0]
        assert after.inflight == 2, "the queued requests' concurrency slots are free again"
        assert after.tokens == before.tokens, "every charge of a request that left while queued is given back"
        assert app.store.open_reservations == 2 and sum(ep.inflight for ep in app.store.all()) == 2
        await _nothing_stale_dispatched(app, held)
    await wait_until(lambda: app.store.open_reservations == 0)
    assert app.metrics.registry.get_sample_value("llm_extproc_flow_requests_total", {"band": "standard", "outcome": "cancelled"}) == 2000


async def test_a_bad_trusted_flow_header_is_a_400_whether_or_not_the_fleet_is_busy(make_app):
    """A trusted deadline header that is no number, or an unknown objective, is refused the same
    way on an idle fleet (the fast path, never queued) as on a busy one, and its charge is given
    back: a client must not learn of its bad header only under load."""
    fc = _fc(slo_header={"name": "x-slo-ttft-ms", "trusted": True}, objective_header={"name": "x-llm-d-inference-objective", "trusted": True})
    app = await make_app(flow_control=fc)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        bad = [{"x-slo-ttft-ms": b"NaN"}, {"x-slo-ttft-ms": b"-5"}, {"x-slo-ttft-ms": b"9" * 40}, {"x-llm-d-inference-objective": b"nope"}]
        for extra in bad:  # idle: every endpoint free
            call = await _send(stub, extra=extra)
            status, body, _ = error_of(await asyncio.wait_for(call.read(), 5))
            assert status == 400, (extra, body)
            call.cancel()
        assert app.store.open_reservations == 0
        ok = await _send(stub, extra={"x-slo-ttft-ms": b"250"})
        await _routed(ok)
        ok.cancel()
    await wait_until(lambda: app.store.open_reservations == 0 and app.flow.live == 0)


async def test_a_busy_favourite_endpoint_does_not_hold_a_request_an_idle_one_can_take(make_app):
    """The scheduler's choice (here the endpoint holding the prompt's prefix) is in prefill at
    its cap while the other endpoint is idle: the request goes to the idle one at once instead
    of queueing — and, as the head of its pool's queue, holding every request behind it."""
    app = await make_app(flow_control=_fc())
    shared = "a long shared system prompt " * 600
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        first = await _send(stub, chat_body(shared + "first question", max_tokens=16))
        busy = await _routed(first)
        second = await _send(stub, chat_body(shared + "second question", max_tokens=16))
        idle = await asyncio.wait_for(_routed(second), 2)
        assert idle != busy and app.flow.live == 0
        third = await _send(stub)  # now both are in prefill: this one waits
        await wait_until(lambda: app.flow.live == 1)
        for c in (first, second, third):
            c.cancel()
        await wait_until(lambda: app.store.open_reservations == 0 and app.flow.live == 0)
        # An idle endpoint that fails its probes is no way out: only healthy ones are tried again
        # (alone in the pool it would put the scheduler in health panic, routing to it).
        first = await _send(stub, chat_body(shared + "first question", max_tokens=16))
        busy = await _routed(first)
        sick = next(ep for ep in app.store.all() if ep.address != busy)
        sick.healthy = False
        second = await _send(stub, chat_body(shared + "second question", max_tokens=16))
        await wait_until(lambda: app.flow.live == 1)
        assert sick.inflight == 0
        # Nor is one outlier detection ejected (alone in a pool, the healthy filter keeps it).
        sick.healthy = True
        sick.ejected_until = time.monotonic() + 60
        third = await _send(stub, chat_body(shared + "third question", max_tokens=16))
        await wait_until(lambda: app.flow.live == 2)
        assert sick.inflight == 0
        for c in (first, second, third):
            c.cancel()
    await wait_until(lambda: app.store.open_reservations == 0 and app.flow.live == 0)
