"""The rate limiter through the real servicer over gRPC, as Envoy drives it: 429 with OpenAI's
headers, headers on admitted responses, every reservation settled however the stream ends, the
response of a token-limited tenant observed whatever the telemetry sample, and no bearer token
in any log line or metric label."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import generate_latest

from extproc.config.schema import EndpointConfig
from extproc.ratelimit.memory import MemoryBackend
from tests.server.test_contract import MODEL, body_msg, chat_body, error_of, exchange, headers_msg, set_headers, wait_until

SECRET = "sk-live-ratelimit-0123456789"
AUTH = {"authorization": f"Bearer {SECRET}".encode()}
MISSES = "llm_extproc_tokenizer_cache_misses_total"
RATE_HEADERS = {f"x-ratelimit-{a}-{b}" for a in ("limit", "remaining", "reset") for b in ("tokens", "requests")}


def _limited(tpm: int, rpm: int | None = None, **extra) -> dict:
    return {"enabled": True, "default": {"tokens_per_minute": tpm, "requests_per_minute": rpm}, **extra}


async def _used(app) -> int:
    t = app.ratelimit.tenant({"authorization": f"Bearer {SECRET}"})
    return (await app.ratelimit.backend.peek(app.ratelimit.scopes(t, MODEL))).uses[0].tokens


def _sse_headers() -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"), base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")]
    )
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm))


def _chunk(data: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end))


async def test_over_the_limit_is_a_429_with_openai_headers_and_admitted_responses_carry_them(make_app, caplog):
    caplog.set_level(logging.DEBUG)
    app = await make_app(ratelimit=_limited(300, 100))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
        await call.read()
        await call.write(body_msg(chat_body(max_tokens=200)))
        assert (await call.read()).WhichOneof("response") == "request_body"
        await call.write(_sse_headers())
        added = {o.header.key: o.header.raw_value.decode() for o in (await call.read()).response_headers.response.header_mutation.set_headers}
        assert RATE_HEADERS <= set(added)
        assert added["x-ratelimit-limit-tokens"] == "300" and added["x-ratelimit-remaining-requests"] == "99"
        # Second request while the first still holds its reservation: over the limit.
        _, refused = await exchange(stub, headers_msg("POST", "/v1/chat/completions", extra=AUTH), body_msg(chat_body(max_tokens=200)))
        status, body, hdrs = error_of(refused)
        assert status == 429 and body["error"]["type"] == "tokens" and body["error"]["code"] == "rate_limit_exceeded"
        assert "Limit 300" in body["error"]["message"]
        assert RATE_HEADERS <= set(hdrs) and int(hdrs["retry-after"]) >= 1
        assert hdrs["x-ratelimit-remaining-tokens"] == str(300 - int(added["x-ratelimit-limit-tokens"]) + int(added["x-ratelimit-remaining-tokens"]))
        # Too large for the whole limit: a 400 that says so.
        _, big = await exchange(stub, headers_msg("POST", "/v1/chat/completions", extra=AUTH), body_msg(chat_body(max_tokens=400)))
        status, body, _ = error_of(big)
        assert status == 400 and body["error"]["code"] == "request_exceeds_rate_limit" and "can never be admitted" in body["error"]["message"]
        call.cancel()
    exposed = generate_latest(app.metrics.registry).decode()
    assert "llm_extproc_ratelimit_requests_total" in exposed
    assert SECRET not in exposed and SECRET not in caplog.text


async def _hold_fresh(app, stub, max_tokens: int):
    """Hold one admitted chat request of a never-seen prompt open (its charge kept); returns the
    call and the tokenizer's cache misses after counting it."""
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
    await call.read()
    await call.write(body_msg(chat_body(f"fresh text {uuid.uuid4().hex}", max_tokens=max_tokens)))
    assert (await call.read()).WhichOneof("response") == "request_body"
    misses = app.metrics.registry.get_sample_value(MISSES, {"model": MODEL}) or 0
    assert misses > 0  # the request was tokenized and counted
    return call, misses


async def test_a_full_window_refuses_before_tokenizing(make_app):
    app = await make_app(ratelimit=_limited(1_000))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        call, before = await _hold_fresh(app, stub, 900)  # keeps 10 + 900 tokens
        _, r = await exchange(
            stub, headers_msg("POST", "/v1/chat/completions", extra=AUTH), body_msg(chat_body(f"a prompt never seen before {uuid.uuid4().hex} " * 20, max_tokens=100))
        )
        status, body, _ = error_of(r)
        # The least cost: the prompt's floor (its bytes × the tenant's tokens per byte so far × 0.5) + 100.
        assert status == 429 and re.search(r"Requested (\d+)\.", body["error"]["message"])
        assert 101 < int(re.search(r"Requested (\d+)\.", body["error"]["message"]).group(1)) < 1000
        assert (app.metrics.registry.get_sample_value(MISSES, {"model": MODEL}) or 0) == before, "refused without tokenizing"
        call.cancel()


async def test_an_aborted_stream_settles_with_what_it_generated(make_app):
    app = await make_app(ratelimit=_limited(10_000), telemetry={"sample_rate": 0.0001})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
        reply = await call.read()
        # Observed although outside the telemetry sample: its usage settles the reservation.
        assert reply.mode_override.response_body_mode == processing_mode_pb2.ProcessingMode.STREAMED
        await call.write(body_msg(chat_body(stream=True, max_tokens=1000)))
        prompt = int(set_headers((await call.read()).request_body.response)["x-llm-prompt-tokens"])
        assert await _used(app) == prompt + 1000
        await call.write(_sse_headers())
        await call.read()
        for word in ("a", "b", "c"):
            await call.write(_chunk(b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": word}}]}) + b"\n\n"))
            await call.read()
        call.cancel()  # the client went away after three tokens
    await wait_until(lambda: app.store.open_reservations == 0)
    assert await _used(app) == prompt + 3


async def _finish_with_usage(app, usage: dict) -> dict[str, str]:
    """One streamed request answered by a usage chunk, end of stream, clean close; its routing headers."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
        assert (await call.read()).mode_override.response_body_mode == processing_mode_pb2.ProcessingMode.STREAMED
        await call.write(body_msg(chat_body(stream=True, max_tokens=500)))
        routing = set_headers((await call.read()).request_body.response)
        await call.write(_sse_headers())
        await call.read()
        await call.write(_chunk(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n", end=True))
        await call.read()
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    await wait_until(lambda: app.servicer.active_streams == 0)
    return routing


async def test_a_finished_stream_settles_with_its_usage(make_app):
    app = await make_app(ratelimit=_limited(10_000))
    await _finish_with_usage(app, {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15})
    assert await _used(app) == 15


async def test_unlimited_tenants_keep_the_telemetry_sample(make_app):
    app = await make_app(ratelimit={"enabled": True, "tenants": {"vip": {}}, "tenant_header": "x-tenant"}, telemetry={"sample_rate": 0.0001})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        (reply,) = await exchange(pb_grpc.ExternalProcessorStub(ch), headers_msg("POST", "/v1/chat/completions", extra={"x-tenant": b"vip"}))
    assert reply.mode_override.response_body_mode == processing_mode_pb2.ProcessingMode.NONE


async def test_fifty_concurrent_streams_never_exceed_the_limit(make_app):
    app = await make_app(ratelimit=_limited(1_000))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        calls = []

        async def one() -> str:
            call = stub.Process()  # held open: each admitted one keeps its reservation
            calls.append(call)
            await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
            first = (await call.read()).WhichOneof("response")
            if first == "immediate_response":
                return first  # refused at its headers (a tenant refused just before)
            await call.write(body_msg(chat_body(max_tokens=90)))
            return (await call.read()).WhichOneof("response")

        kinds = await asyncio.gather(*(one() for _ in range(50)))
        used = await _used(app)
        for call in calls:
            call.cancel()
    admitted = kinds.count("request_body")
    cost = used // admitted
    assert used == admitted * cost and cost > 90
    assert admitted == 1_000 // cost, "every request that fits is admitted, and none more"
    assert kinds.count("immediate_response") == 50 - admitted
    await wait_until(lambda: app.store.open_reservations == 0)


async def test_admin_shows_each_tenants_window(make_app):
    import httpx

    app = await make_app(
        ratelimit=_limited(1_000, tenants={"acme": {"requests_per_minute": 5}}, tenant_header="x-tenant", unknown_api_keys="per_key")
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        await exchange(pb_grpc.ExternalProcessorStub(ch), headers_msg("POST", "/v1/chat/completions", extra=AUTH), body_msg(chat_body(max_tokens=10)))
    async with httpx.AsyncClient() as client:
        data = (await client.get(f"http://127.0.0.1:{app.admin_port}/api/v1/tenants")).json()
    rows = {t["tenant"]: t for t in data["tenants"]}
    assert data["enabled"] and rows["acme"]["windows"][0]["requests_per_minute"] == 5
    (key_tenant,) = [t for t in rows.values() if not t["named"]]
    window = key_tenant["windows"][0]
    # Closed before any response: settled to its prompt tokens (the engine may have prefilled it).
    assert window["tokens_per_minute"] == 1_000 and window["requests"] == 1 and 0 < window["tokens"] < 100
    assert SECRET not in str(data)


async def test_tier_mode_settles_too(make_app):
    app = await make_app(ratelimit=_limited(10_000), scheduling={"mode": "tier", "health_check": {"enabled": False}})
    routing = await _finish_with_usage(app, {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11})
    assert "x-llm-tier" in routing
    assert await _used(app) == 11


async def test_a_concurrency_slot_is_released_however_the_stream_ends(make_app):
    """max_concurrent_requests 1, through the servicer: a second stream is refused (429) while
    the first is in flight; the slot comes back when the first is cancelled by the client, when
    the engine answers an error, and when a stream ends normally; a refusal never holds one."""
    app = await make_app(ratelimit={"enabled": True, "default": {"tokens_per_minute": 100_000, "max_concurrent_requests": 1}})
    lim = app.ratelimit
    t = lim.tenant({"authorization": f"Bearer {SECRET}"})

    async def inflight_now() -> int:
        return (await lim.backend.peek(lim.scopes(t, MODEL))).uses[0].inflight

    async def admit_one(stub):
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
        await call.read()
        await call.write(body_msg(chat_body(max_tokens=50)))
        return call, (await call.read()).WhichOneof("response")

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        ends = ("client cancels", "engine error", "normal end")
        for how in ends:
            call, kind = await admit_one(stub)
            assert kind == "request_body", how
            call2 = stub.Process()
            await call2.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
            # Refused at its headers: its body never has to cross.
            status, body, hdrs = error_of(await call2.read())
            call2.cancel()
            assert status == 429 and body["error"]["type"] == "requests" and "requests in flight" in body["error"]["message"]
            assert int(hdrs["retry-after"]) >= 1 and await inflight_now() == 1  # the refusal holds nothing
            if how == "client cancels":
                call.cancel()
            else:
                code = b"500" if how == "engine error" else b"200"
                hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=code)])
                await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hm, end_of_stream=True)))
                await call.read()
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
            await wait_until(lambda: app.servicer.active_streams == 0)
            assert await inflight_now() == 0, how


async def _open_stream(stub) -> tuple[grpc.aio.StreamStreamCall, pb.ProcessingResponse]:
    """A tenant's chat request, headers then body, left open: the call and the body's reply."""
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
    await call.read()
    await call.write(body_msg(chat_body(max_tokens=50)))
    return call, await call.read()


class _DiscoveryDuringCharge(MemoryBackend):
    """The memory backend, with endpoint discovery acting while the charge is decided (what a
    Redis round trip leaves room for): `during` runs once, inside the first acquire."""

    def __init__(self, during) -> None:
        super().__init__(60)
        self._during = during

    async def acquire(self, scopes, cost, now_ms=None, request_id=None):
        during, self._during = self._during, None
        if during is not None:
            during()
            await asyncio.sleep(0)  # a real suspension, as a remote call has
        return await super().acquire(scopes, cost, now_ms, request_id)


CAPPED = {"enabled": True, "default": {"tokens_per_minute": 100_000, "max_concurrent_requests": 1}}


async def test_an_endpoint_drained_during_the_charge_is_not_used_the_request_is_routed_again(make_app):
    """Discovery drains the chosen endpoint while the rate-limit charge is in flight: the request
    is routed again to an endpoint still in the pool, never sent to (or counted on) the gone one."""
    app = await make_app(ratelimit=CAPPED)
    first, second = [ep.address for ep in app.store.all()]
    app.store.drain_endpoint(second)  # only `first` can be picked
    cfg_second = EndpointConfig(address=second, models=[MODEL])
    gone = app.store.get(first)

    def discovery() -> None:
        app.store.drain_endpoint(first)  # nothing in flight there: removed at once
        app.store.add_endpoint(cfg_second)

    app.ratelimit.backend = _DiscoveryDuringCharge(discovery)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        call, reply = await _open_stream(pb_grpc.ExternalProcessorStub(ch))
        assert reply.WhichOneof("response") == "request_body"
        assert set_headers(reply.request_body.response)["x-gateway-destination-endpoint"] == second
        assert app.store.get(first) is None and gone.inflight == 0  # nothing counted on the detached one
        assert app.store.get(second).inflight == 1
        call.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)


def _lookups(app) -> tuple[float, float]:
    """The app's tokenizer segment-cache (hits, misses) so far: every counting of a prompt adds
    its segments to one or the other."""
    get = app.metrics.registry.get_sample_value
    return (
        get("llm_extproc_tokenizer_cache_hits_total", {"model": MODEL}) or 0.0,
        get("llm_extproc_tokenizer_cache_misses_total", {"model": MODEL}) or 0.0,
    )


async def test_routing_again_after_the_charge_does_not_count_the_prompt_again(make_app):
    """The retry when the chosen endpoint leaves during the charge schedules again, nothing more:
    a fresh prompt's segments are looked up in the tokenizer cache as often as when no endpoint
    leaves (counted twice, the second count would hit the cache), and the request still goes
    to the endpoint left in the pool."""
    app = await make_app(ratelimit=CAPPED)
    first, second = [ep.address for ep in app.store.all()]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)

        async def route(text: str) -> tuple[str, float, float]:
            before = _lookups(app)
            _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions", extra=AUTH), body_msg(chat_body(text, max_tokens=20)))
            after = _lookups(app)
            assert reply.WhichOneof("response") == "request_body"
            return set_headers(reply.request_body.response)["x-gateway-destination-endpoint"], after[0] - before[0], after[1] - before[1]

        # Baseline, no endpoint leaves: what counting one fresh prompt of this shape costs.
        _, hits, misses = await route(f"a fresh prompt {uuid.uuid4().hex} about the weather")
        assert misses > 0
        await wait_until(lambda: app.store.open_reservations == 0)
        app.store.drain_endpoint(second)  # only `first` can be picked

        def discovery() -> None:
            app.store.drain_endpoint(first)
            app.store.add_endpoint(EndpointConfig(address=second, models=[MODEL]))

        app.ratelimit.backend = _DiscoveryDuringCharge(discovery)
        dest, retry_hits, retry_misses = await route(f"a fresh prompt {uuid.uuid4().hex} about the weather")
    assert dest == second and app.store.get(first) is None
    assert (retry_hits, retry_misses) == (hits, misses), "the prompt was counted once"
    await wait_until(lambda: app.store.open_reservations == 0)


async def test_an_endpoint_removed_during_the_charge_with_no_other_left_is_a_503_and_the_charge_comes_back(make_app):
    """The chosen endpoint is removed during the charge and no other is left: a 503 in the
    OpenAI error shape, the tokens and the concurrency slot given back (the tenant's next
    request, with a cap of 1, is admitted once an endpoint is back)."""
    app = await make_app(ratelimit=CAPPED)
    first, second = [ep.address for ep in app.store.all()]
    app.store.remove_endpoint(second)
    app.ratelimit.backend = _DiscoveryDuringCharge(lambda: app.store.remove_endpoint(first))
    lim = app.ratelimit
    t = lim.tenant({"authorization": f"Bearer {SECRET}"})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions", extra=AUTH), body_msg(chat_body(max_tokens=50)))
        status, body, _ = error_of(reply)
        assert status == 503 and body["error"]["type"] == "service_unavailable", body
        use = (await lim.backend.peek(lim.scopes(t, MODEL))).uses[0]
        assert use.inflight == 0 and use.tokens == 0
        assert app.store.open_reservations == 0
        app.store.add_endpoint(EndpointConfig(address=second, models=[MODEL]))
        _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions", extra=AUTH), body_msg(chat_body(max_tokens=50)))
        assert reply.WhichOneof("response") == "request_body"


async def test_a_refusal_at_the_headers_has_its_decision_log_line(make_app, tmp_path):
    """A tenant refused at its request headers (before the body, where the log's record is made
    for other requests) still gets its one line: rejected, 429, the reason, the tenant's hash;
    never its key."""
    path = tmp_path / "decisions.jsonl"
    app = await make_app(
        ratelimit={"enabled": True, "default": {"tokens_per_minute": 100_000, "max_concurrent_requests": 1}},
        decision_log={"path": str(path)},
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        call, reply = await _open_stream(stub)
        assert reply.WhichOneof("response") == "request_body"
        refused = stub.Process()
        await refused.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
        status, _, _ = error_of(await refused.read())
        refused.cancel()
        call.cancel()
        await wait_until(lambda: app.servicer.active_streams == 0)
    await app.aclose(grace_s=0)  # flushes the log
    raw = path.read_bytes()
    assert status == 429 and SECRET.encode() not in raw and b"Bearer" not in raw
    lines = [orjson.loads(line) for line in raw.splitlines()]
    at_headers = [line for line in lines if line["outcome"] == "rejected"]
    assert len(at_headers) == 1, lines
    line = at_headers[0]
    assert (line["status"], line["reason"], line["kind"]) == (429, "rate_limit_exceeded", "chat")
    assert line["tenant"] is not None and line["model"] is None and line["prompt_tokens"] is None
    assert line["tenant"] == next(x["tenant"] for x in lines if x["outcome"] == "routed")  # the same tenant


async def test_a_batch_whose_outputs_cannot_fit_is_refused_before_tokenizing(make_app):
    # The least cost of a batched completion counts n choices for every prompt: 4 prompts of
    # 200 output tokens (800) cannot fit the 490 left, though one prompt's 200 would.
    app = await make_app(ratelimit=_limited(1_000))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        call, before = await _hold_fresh(app, stub, 500)  # keeps 10 + 500 tokens
        batch = orjson.dumps({"model": MODEL, "prompt": [f"never seen {uuid.uuid4().hex}" for _ in range(4)], "max_tokens": 200})
        _, r = await exchange(stub, headers_msg("POST", "/v1/completions", extra=AUTH), body_msg(batch))
        status, body, _ = error_of(r)
        assert status == 429 and int(re.search(r"Requested (\d+)\.", body["error"]["message"]).group(1)) >= 800
        assert (app.metrics.registry.get_sample_value(MISSES, {"model": MODEL}) or 0) == before, "refused without tokenizing"
        call.cancel()
