"""Contract tests of the Endpoint Picker Protocol mode (`protocol.mode: epp`).

Message sequences as the protocol's gateways send them (FULL_DUPLEX_STREAMED bodies in
chunks, trailers, metadata), encoded and decoded on the test side by envoy-data-plane
(`tests/server/epp_gateway.py`), never by the stubs the server uses.
"""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest

from tests.server.epp_gateway import (
    Exchange,
    chunks,
    open_stream,
    request_body,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
    streamed_body,
)

ENDPOINTS = ["127.0.0.1:18001", "127.0.0.1:18002"]  # as in conftest.make_config
MODEL = "Qwen/Qwen3-8B"
CHAT = "/v1/chat/completions"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


def chat_body(content: str = "Hello there, pick me an endpoint.", **extra) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra})


@pytest.fixture
async def epp(make_app):
    return await make_app(protocol={"mode": "epp"})


@pytest.fixture
async def channel(epp):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
        yield ch


async def send_request(channel, messages) -> Exchange:
    """Send a whole request half, close the writing side, fold every reply in until EOF."""
    call = open_stream(channel)
    for m in messages:
        await call.write(m)
    await call.done_writing()
    ex = Exchange()
    while (reply := await call.read()) != grpc.aio.EOF:
        ex.take(reply)
    return ex


async def open_and_pick(channel, body: bytes | None = None, *, extra: dict[str, str] | None = None):
    """Open a stream and send a chat request whole (headers, then `body`, default `chat_body()`);
    read the headers' answer and the body's, which carries the pick. Returns the still-open
    call and the `Exchange` holding those two answers."""
    call = open_stream(channel)
    await call.write(request_headers("POST", CHAT, extra=extra))
    await call.write(request_body(chat_body() if body is None else body, end=True))
    ex = Exchange()
    ex.take(await call.read())
    ex.take(await call.read())
    return call, ex


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def inflight(app, address: str) -> float:
    return app.metrics.registry.get_sample_value("llm_extproc_endpoint_inflight_requests", {"endpoint": address})


async def test_streamed_chunks_get_the_headers_answer_first_then_the_body_whole(channel):
    body = chat_body(max_tokens=8)
    parts = chunks(body, 17)
    ex = await send_request(
        channel,
        [request_headers("POST", CHAT), *(request_body(p, end=i == len(parts) - 1) for i, p in enumerate(parts))],
    )
    # Nothing answered per chunk: the headers' answer (deferred until the decision) comes first,
    # then the body, once, in order, its last piece marking the end.
    assert ex.kinds == ["request_headers", "request_body"]
    assert ex.destination in ENDPOINTS
    assert ex.metadata_destination == ex.destination, "the header and the envoy.lb metadata must agree"
    assert ex.clear_route_cache
    assert ex.body == body and ex.body_ended
    assert ex.header_set["content-length"] == str(len(body))
    assert int(ex.header_set["x-llm-prompt-tokens"]) > 0
    assert not ex.mode_override, "FULL_DUPLEX_STREAMED takes no mode override"


async def test_a_client_sent_destination_is_overwritten_and_owned_headers_removed(channel):
    ex = await send_request(
        channel,
        [
            request_headers("POST", CHAT, extra={"x-gateway-destination-endpoint": "10.9.9.9:80", "x-llm-tier": "low-latency"}),
            request_body(chat_body(), end=True),
        ],
    )
    assert ex.destination in ENDPOINTS
    assert "x-llm-tier" in ex.header_removed


async def test_big_body_goes_back_in_pieces_under_the_limit(make_app):
    # A ~220 KB prompt arriving in 16 KiB chunks: answered in pieces of at most chunk_bytes.
    app = await make_app(
        protocol={"mode": "epp", "chunk_bytes": 50_000},
        limits={"max_body_bytes": 1 << 20, "grpc_max_message_bytes": 1 << 21, "shutdown_grace_s": 1, "decision_timeout_ms": 5000},
        models=[{"name": MODEL, "max_model_len": 131072}],
    )
    body = chat_body(" ".join(f"word{i % 977}" for i in range(28_000)), max_tokens=4)
    assert len(body) > 200_000
    parts = chunks(body, 16384)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        ex = await send_request(ch, [request_headers("POST", CHAT), *(request_body(p, end=i == len(parts) - 1) for i, p in enumerate(parts))])
    assert ex.kinds[0] == "request_headers" and set(ex.kinds[1:]) == {"request_body"}
    assert ex.body == body and ex.body_ended
    assert max(ex.pieces) <= 50_000 and len(ex.pieces) == -(-len(body) // 50_000)
    assert ex.destination in ENDPOINTS


async def test_trailers_end_the_body_and_are_answered_last(channel):
    body = chat_body()
    parts = chunks(body, 10)
    ex = await send_request(channel, [request_headers("POST", CHAT), *(request_body(p, end=False) for p in parts), request_trailers()])
    assert ex.kinds[0] == "request_headers" and ex.kinds[-1] == "request_trailers"
    assert set(ex.kinds[1:-1]) == {"request_body"}
    assert ex.body == body
    assert not ex.body_ended, "with trailers to follow, no body piece may end the stream"
    assert ex.destination in ENDPOINTS


@pytest.mark.parametrize(
    ("hint", "allowed"),
    [
        pytest.param([ENDPOINTS[1]], {ENDPOINTS[1]}, id="list"),
        pytest.param(ENDPOINTS[0], {ENDPOINTS[0]}, id="one-string"),
        pytest.param(f"10.1.1.1:80, {ENDPOINTS[1]}", {ENDPOINTS[1]}, id="comma-separated-with-an-unknown"),
        pytest.param(["127.0.0.1"], set(ENDPOINTS), id="bare-ip-any-port"),
    ],
)
async def test_subset_hint_is_a_hard_filter(channel, hint, allowed):
    seen = set()
    for _ in range(12):
        ex = await send_request(
            channel, [request_headers("POST", CHAT, md={SUBSET_NS: {SUBSET_KEY: hint}}), request_body(chat_body(), end=True)]
        )
        assert ex.kinds == ["request_headers", "request_body"], "routed, not refused"
        seen.add(ex.destination)
    assert seen <= allowed


@pytest.mark.parametrize("hint", [[], ["10.1.1.1:80"], [f"{ENDPOINTS[0].split(':')[0]}:1"]], ids=["empty", "unknown", "wrong-port"])
async def test_subset_with_no_known_endpoint_is_a_503(epp, channel, hint):
    body = chat_body(f"a prompt no other test sends: {hint}")  # a cache miss if it were counted
    ex = await send_request(channel, [request_headers("POST", CHAT, md={SUBSET_NS: {SUBSET_KEY: hint}}), request_body(body, end=True)])
    assert ex.kinds == ["immediate_response"]
    assert ex.immediate_status == 503
    assert orjson.loads(ex.immediate_body)["error"]["code"] == "no_endpoint_in_subset"
    # Refused before its prompt was tokenized (it was counted, then refused).
    assert not epp.metrics.registry.get_sample_value("llm_extproc_tokenizer_cache_misses_total", {"model": MODEL})


async def test_subset_applies_to_requests_without_a_body(channel):
    for _ in range(6):
        ex = await send_request(channel, [request_headers("GET", "/v1/models", end=True, md={SUBSET_NS: {SUBSET_KEY: [ENDPOINTS[0]]}})])
        assert ex.kinds == ["request_headers"]
        assert ex.destination == ENDPOINTS[0] == ex.metadata_destination


async def test_an_allowed_unparsed_path_with_a_body_is_routed_at_the_headers_and_echoed(make_app):
    app = await make_app(protocol={"mode": "epp", "extra_served_paths": ["/tokenize"]})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        ex = await send_request(channel, [request_headers("POST", "/tokenize"), request_body(b'{"a":', end=False), request_body(b"1}", end=True)])
    assert ex.kinds == ["request_headers", "request_body", "request_body"]
    assert ex.destination in ENDPOINTS
    assert ex.body == b'{"a":1}' and ex.body_ended


@pytest.mark.parametrize(
    "path",
    ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/tokenize", "/tokenize", "/v1/models/../load_lora_adapter", "/metrics?x=1"],
)
async def test_paths_off_the_allow_list_are_the_gateways_404_as_in_buffered_mode(epp, channel, path):
    """The gateway hands the picker every path of the pool: EPP mode passed vLLM's adapter
    load/unload and tokenizer paths to an engine, while BUFFERED mode's Envoy answers them 404.
    Now the same allow-list (`SERVED_PATHS`), the same JSON 404, and nothing reserved."""
    ex = await send_request(channel, [request_headers("POST", path), request_body(b'{"lora_name": "x"}', end=True)])
    assert ex.kinds == ["immediate_response"] and ex.immediate_status == 404
    assert orjson.loads(ex.immediate_body)["error"] == {
        "message": "this path is not served by the gateway", "type": "invalid_request_error", "param": None, "code": "not_found",
    }  # fmt: skip
    assert epp.store.open_reservations == 0
    ok = await send_request(channel, [request_headers("GET", "/v1/models/", end=True)])
    assert ok.destination in ENDPOINTS


def test_the_404_matches_the_shipped_envoy_configs():
    import yaml

    from extproc.protocol.openai import SERVED_PATHS
    from extproc.stack.envoy import config_path, served_path_regex

    text = config_path("fail-closed").read_text()
    assert served_path_regex() in text and "|".join(SERVED_PATHS) in text
    assert '"message":"this path is not served by the gateway","type":"invalid_request_error","param":null,"code":"not_found"' in text
    assert yaml.safe_load(text)


async def test_fallbacks_ride_in_the_header_and_the_metadata(make_app):
    app = await make_app(protocol={"mode": "epp", "fallbacks": 1})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        ex = await send_request(ch, [request_headers("POST", CHAT), request_body(chat_body(), end=True)])
    listed = ex.destination.split(",")
    assert sorted(listed) == sorted(ENDPOINTS), "primary then the runner-up"
    assert ex.metadata_destination == ex.destination


@pytest.mark.parametrize(
    ("messages", "status"),
    [
        pytest.param([request_headers("POST", CHAT), request_body(b"{", end=True)], 400, id="bad-json"),
        pytest.param([request_headers("POST", CHAT, end=True)], 400, id="no-body"),
        pytest.param([request_headers("GET", CHAT, end=True)], 405, id="wrong-method"),
        pytest.param([request_headers("POST", CHAT), request_body(orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}), end=True)], 404, id="unknown-model"),
    ],
)
async def test_refusals_are_immediate_responses(channel, messages, status):
    ex = await send_request(channel, messages)
    assert ex.kinds == ["immediate_response"]
    assert ex.immediate_status == status
    assert orjson.loads(ex.immediate_body)["error"]["message"]


async def test_json_nested_past_the_bound_is_a_400_in_epp_mode_too(channel):
    from tests.server.test_contract import deep_body

    ex = await send_request(channel, [request_headers("POST", CHAT), request_body(deep_body(1000), end=True)])
    assert ex.kinds == ["immediate_response"] and ex.immediate_status == 400
    assert orjson.loads(ex.immediate_body)["error"]["code"] == "json_too_deep"


async def test_a_body_over_the_limit_is_refused_before_it_ends(epp, channel):
    call = open_stream(channel)
    await call.write(request_headers("POST", CHAT))
    await call.write(request_body(b"x" * 40_000, end=False))
    await call.write(request_body(b"x" * 40_000, end=False))  # 80,000 > 65,536 (conftest)
    ex = Exchange()
    ex.take(await call.read())
    assert ex.immediate_status == 413
    call.cancel()
    await wait_until(lambda: epp.servicer.active_streams == 0, timeout=5)


async def test_early_cancel_mid_body_holds_nothing(epp, channel):
    call = open_stream(channel)
    await call.write(request_headers("POST", CHAT))
    await call.write(request_body(chat_body()[:20], end=False))
    await wait_until(lambda: epp.servicer.active_streams == 1, timeout=5)
    call.cancel()
    await wait_until(lambda: epp.servicer.active_streams == 0, timeout=5)
    assert epp.store.open_reservations == 0


async def test_cancel_after_the_decision_releases_the_reservation(epp, channel):
    call, ex = await open_and_pick(channel, chat_body(stream=True))
    assert ex.body_ended
    assert epp.store.open_reservations == 1 and inflight(epp, ex.destination) == 1
    call.cancel()
    await wait_until(lambda: epp.store.open_reservations == 0, timeout=5)
    assert inflight(epp, ex.destination) == 0


async def test_response_is_streamed_back_and_the_served_endpoint_takes_the_load(epp, channel):
    call, ex = await open_and_pick(channel, chat_body(stream=True, max_tokens=4))
    primary = ex.destination
    (other,) = [e for e in ENDPOINTS if e != primary]
    # The gateway retried onto `other` and says so in the envoy.lb metadata.
    await call.write(response_headers(200, content_type="text/event-stream", served=other))
    reply = await call.read()
    assert reply.response_headers is not None and reply.mode_override is None
    assert inflight(epp, primary) == 0 and inflight(epp, other) == 1
    served = epp.metrics.registry.get_sample_value
    assert served("llm_extproc_epp_served_total", {"endpoint": "other"}) == 1
    assert served("llm_extproc_epp_served_total", {"endpoint": "primary"}) == 0
    events = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" there"}}]}\n\ndata: [DONE]\n\n',
    ]
    got = b""
    for i, ev in enumerate(events):
        await call.write(response_body(ev, end=i == len(events) - 1))
        data, end = streamed_body(await call.read())
        got += data
        assert end == (i == len(events) - 1)
    assert got == b"".join(events), "an SSE stream goes back byte for byte"
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    await wait_until(lambda: epp.store.open_reservations == 0, timeout=5)
    assert inflight(epp, other) == 0
    # Held on `other` only from its response headers on: its prefill fit learns no ~0 ms sample.
    assert epp.store.get(other).prefill_fit.samples == 0


async def test_an_engine_error_body_is_held_and_answered_in_the_gateway_shape(epp, channel):
    call, _ = await open_and_pick(channel)
    await call.write(response_headers(500, content_type="text/plain"))
    reply = await call.read()
    assert reply.response_headers is not None and reply.mode_override is None
    await call.write(response_body(b"Internal ", end=False))
    await call.write(response_body(b"Server Error", end=True))
    data, end = streamed_body(await call.read())
    assert end
    error = orjson.loads(data)["error"]
    assert "Internal Server Error" in error["message"]
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def test_parallel_streams_release_everything(epp, channel):
    async def one(i: int) -> Exchange:
        return await send_request(channel, [request_headers("POST", CHAT), request_body(chat_body(f"request {i}"), end=True)])

    results = await asyncio.gather(*(one(i) for i in range(40)))
    assert all(r.destination in ENDPOINTS for r in results)
    assert {r.destination for r in results} == set(ENDPOINTS), "load-aware spreads a burst"
    await wait_until(lambda: epp.store.open_reservations == 0 and epp.servicer.active_streams == 0, timeout=10)


async def test_health_services_the_gateways_probe(epp):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
        hs = health_pb2_grpc.HealthStub(ch)
        for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = await hs.Check(health_pb2.HealthCheckRequest(service=svc))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_epp_needs_endpoint_mode():
    from extproc.config.loader import config_from_mapping

    with pytest.raises(Exception, match="protocol.mode: epp"):
        config_from_mapping(
            {"models": [{"name": MODEL}], "endpoints": [{"address": ENDPOINTS[0], "models": [MODEL]}], "scheduling": {"mode": "tier"}, "protocol": {"mode": "epp"}}
        )


async def test_response_trailers_close_a_streamed_response(epp, channel):
    # A gRPC-style upstream: the response ends with trailers, not with end_of_stream on a chunk.
    from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue
    from envoy_data_plane.envoy.service.ext_proc.v3 import HttpTrailers, ProcessingRequest

    call, _ = await open_and_pick(channel)
    await call.write(response_headers(200))
    await call.read()
    await call.write(response_body(b'{"id":"x"}', end=False))
    data, end = streamed_body(await call.read())
    assert (data, end) == (b'{"id":"x"}', False)
    await call.write(ProcessingRequest(response_trailers=HttpTrailers(trailers=HeaderMap(headers=[HeaderValue(key="grpc-status", raw_value=b"0")]))))
    reply = await call.read()
    assert reply.response_trailers is not None
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    await wait_until(lambda: epp.store.open_reservations == 0, timeout=5)


async def test_rate_limits_answer_429_and_settle_in_epp_mode(make_app):
    # The spec's 429 for a request that must be dropped: here a tenant over its token budget.
    app = await make_app(protocol={"mode": "epp"}, ratelimit={"enabled": True, "default": {"tokens_per_minute": 300}})
    auth = {"authorization": "Bearer sk-epp-ratelimit-test"}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        # admitted and still in flight: its charge is held
        first, held = await open_and_pick(ch, chat_body(max_tokens=200), extra=auth)
        assert held.destination in ENDPOINTS
        second = await send_request(ch, [request_headers("POST", CHAT, extra=auth), request_body(chat_body(max_tokens=200), end=True)])
        first.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)
    assert second.kinds == ["immediate_response"]
    assert second.immediate_status == 429
    assert orjson.loads(second.immediate_body)["error"]["type"] == "tokens"  # the limit that ran out


async def test_a_capped_tenant_is_refused_at_its_headers_before_its_body_is_buffered(make_app, tmp_path):
    # BUFFERED mode refused such a tenant at the request headers; the EPP servicer buffered the
    # whole body (up to max_body_bytes) first, the cost the header refusal exists to avoid.
    log_path = tmp_path / "decisions.jsonl"
    app = await make_app(
        protocol={"mode": "epp"},
        ratelimit={"enabled": True, "default": {"max_concurrent_requests": 1}},
        decision_log={"path": str(log_path)},
    )
    auth = {"authorization": "Bearer sk-epp-capped-test"}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        first, held = await open_and_pick(ch, chat_body(max_tokens=20), extra=auth)
        second = await send_request(ch, [request_headers("POST", CHAT, extra=auth)])  # headers only
        first.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)
    assert second.kinds == ["immediate_response"] and second.immediate_status == 429
    assert orjson.loads(second.immediate_body)["error"]["type"] == "requests"
    await app.aclose(grace_s=0)  # flushes the decision log: the refusal at the headers has its line
    raw = log_path.read_bytes()
    assert b"sk-epp-capped-test" not in raw
    refused = [line for line in map(orjson.loads, raw.splitlines()) if line["outcome"] == "rejected"]
    assert [(r["status"], r["reason"], r["tenant"] is not None) for r in refused] == [(429, "rate_limit_exceeded", True)]


@pytest.mark.parametrize(
    ("mode", "proxy_body_mode", "hint"),
    [
        pytest.param("epp", "BUFFERED", "protocol.mode: buffered", id="epp-picker-behind-our-buffered-envoy"),
        pytest.param("buffered", "FULL_DUPLEX_STREAMED", "protocol.mode: epp", id="buffered-server-behind-an-inference-gateway"),
    ],
)
async def test_a_proxy_in_the_other_body_mode_gets_a_clear_500(make_app, mode, proxy_body_mode, hint):
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode
    from envoy_data_plane.envoy.service.ext_proc.v3 import ProtocolConfiguration

    app = await make_app(protocol={"mode": mode})
    first = request_headers("POST", CHAT)
    first.protocol_config = ProtocolConfiguration(request_body_mode=ProcessingModeBodySendMode[proxy_body_mode])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        ex = await send_request(ch, [first])
        # The same body mode as the server speaks: served as usual.
        ok = request_headers("GET", "/v1/models", end=True)
        ok.protocol_config = ProtocolConfiguration(
            request_body_mode=ProcessingModeBodySendMode["FULL_DUPLEX_STREAMED" if mode == "epp" else "NONE"]
        )
        served = await send_request(ch, [ok])
    assert ex.kinds == ["immediate_response"] and ex.immediate_status == 500
    error = orjson.loads(ex.immediate_body)["error"]
    assert error["code"] == "proxy_mode_mismatch" and hint in error["message"]
    assert served.kinds == ["request_headers"] and served.destination in ENDPOINTS


async def test_a_served_ipv6_endpoint_written_otherwise_is_still_the_endpoint(make_app):
    v6 = ["[2001:db8::1]:18001", "[2001:db8::2]:18002"]
    app = await make_app(protocol={"mode": "epp"}, endpoints=[{"address": a, "models": [MODEL]} for a in v6])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        call, ex = await open_and_pick(ch, chat_body(stream=True, max_tokens=4))
        primary = ex.destination
        (other,) = [e for e in v6 if e != primary]
        # The gateway writes the address it retried onto in its own text: upper case, zeros kept.
        written = other.replace("2001:db8::", "2001:DB8:0:0:0:0:0:").upper()
        await call.write(response_headers(200, content_type="text/event-stream", served=written))
        await call.read()
        assert inflight(app, primary) == 0 and inflight(app, other) == 1
        assert app.metrics.registry.get_sample_value("llm_extproc_epp_served_total", {"endpoint": "other"}) == 1
        await call.write(response_body(b"data: [DONE]\n\n", end=True))
        await call.read()
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    await wait_until(lambda: app.store.open_reservations == 0, timeout=5)
