"""gRPC contract tests: drive the real servicer with ProcessingRequest sequences, as Envoy does.

Each test opens an ext_proc stream over a real gRPC channel, sends the phases Envoy would send,
and checks the replies message by message: one reply per request, of the same kind, in order.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.server.responses import OWNED_HEADERS
from extproc.pipeline.tokens import TokenCounter
from extproc.types import RequestKind

ENDPOINTS = ["127.0.0.1:18001", "127.0.0.1:18002"]  # as in conftest.make_config
MODEL = "Qwen/Qwen3-8B"


def headers_msg(method: str, path: str, *, end: bool = False, extra: dict[str, bytes] | None = None) -> pb.ProcessingRequest:
    hdrs = {":method": method.encode(), ":path": path.encode(), ":authority": b"llm.local", **(extra or {})}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in hdrs.items()]),
            end_of_stream=end,
        )
    )


def body_msg(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def chat_body(content: str = "Hello!", **extra) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], **extra})


def set_headers(common: pb.CommonResponse) -> dict[str, str]:
    out = {}
    for opt in common.header_mutation.set_headers:
        assert opt.header.value == "", "Envoy drops mutations that carry `value`; use raw_value only"
        assert opt.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        out[opt.header.key] = opt.header.raw_value.decode()
    return out


async def exchange(stub, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    call = stub.Process()
    replies = []
    for m in messages:
        await call.write(m)
        replies.append(await call.read())
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return replies


def error_of(reply: pb.ProcessingResponse) -> tuple[int, dict, dict[str, str]]:
    assert reply.WhichOneof("response") == "immediate_response"
    imm = reply.immediate_response
    hdrs = {o.header.key: o.header.raw_value.decode() for o in imm.headers.set_headers}
    return imm.status.code, orjson.loads(imm.body), hdrs


async def test_headers_then_body_routes_in_body_phase(app, stub, qwen_counter):
    msgs = [{"role": "user", "content": "Route me, please."}]
    r_headers, r_body = await exchange(
        stub,
        headers_msg("POST", "/v1/chat/completions"),
        body_msg(orjson.dumps({"model": MODEL, "messages": msgs, "max_tokens": 16})),
    )
    # Headers phase: owned routing headers removed, nothing set, route not yet recomputed.
    assert r_headers.WhichOneof("response") == "request_headers"
    assert list(r_headers.request_headers.response.header_mutation.remove_headers) == list(OWNED_HEADERS)
    assert not r_headers.request_headers.response.header_mutation.set_headers
    # Body phase: the decision.
    assert r_body.WhichOneof("response") == "request_body"
    common = r_body.request_body.response
    assert common.clear_route_cache
    hdrs = set_headers(common)
    assert hdrs["x-gateway-destination-endpoint"] in ENDPOINTS
    assert int(hdrs["x-llm-prompt-tokens"]) == qwen_counter.count_chat(msgs).count
    assert len(hdrs["x-request-id"]) == 32
    assert not common.HasField("body_mutation"), "the body must reach the engine untouched"


async def test_alias_reaches_the_engine_as_the_served_name(stub):
    body = orjson.dumps({"model": "qwen3-8b", "messages": [{"role": "user", "content": "héllo"}], "temperature": 0.5})
    _, r_body = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
    common = r_body.request_body.response
    rewritten = common.body_mutation.body
    assert orjson.loads(rewritten) == {**orjson.loads(body), "model": MODEL}
    assert set_headers(common)["content-length"] == str(len(rewritten))


async def test_existing_request_id_is_kept(stub):
    _, r_body = await exchange(
        stub,
        headers_msg("POST", "/v1/chat/completions", extra={"x-request-id": b"abc-123"}),
        body_msg(chat_body()),
    )
    assert "x-request-id" not in set_headers(r_body.request_body.response)


async def test_headers_only_request_is_routed_in_headers_phase(app, stub):
    (reply,) = await exchange(stub, headers_msg("GET", "/health", end=True))
    common = reply.request_headers.response
    assert common.clear_route_cache
    assert set_headers(common)["x-gateway-destination-endpoint"] in ENDPOINTS
    assert not reply.HasField("mode_override")


def _models_response_headers(status: bytes = b"200", content_type: bytes = b"application/json") -> pb.ProcessingRequest:
    hdrs = [base_pb2.HeaderValue(key=":status", raw_value=status), base_pb2.HeaderValue(key="content-type", raw_value=content_type),
            base_pb2.HeaderValue(key="content-length", raw_value=b"200")]  # fmt: skip
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hdrs)))


async def test_the_model_list_gets_the_configured_aliases(app, stub):
    """The engines list the names they serve; the configured alias (`qwen3-8b`) is added after
    its model, a copy of its entry, so a client listing models can find every name it may use."""
    engine = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1, "owned_by": "vllm", "root": MODEL, "max_model_len": 4096},
                                         {"id": "other", "object": "model", "created": 1, "owned_by": "vllm"}]}  # fmt: skip
    body = pb.ProcessingRequest(response_body=pb.HttpBody(body=orjson.dumps(engine), end_of_stream=True))
    route, r_headers, r_body = await exchange(stub, headers_msg("GET", "/v1/models?x=1", end=True), _models_response_headers(), body)
    assert route.mode_override.response_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED
    assert "content-length" in r_headers.response_headers.response.header_mutation.remove_headers
    listed = orjson.loads(r_body.response_body.response.body_mutation.body)["data"]
    assert [e["id"] for e in listed] == [MODEL, "qwen3-8b", "other"]
    assert listed[1] == {**listed[0], "id": "qwen3-8b"}  # root still names the served model
    # An error answer goes through untouched.
    _, r_headers, r_body = await exchange(stub, headers_msg("GET", "/v1/models", end=True), _models_response_headers(b"500"), body)
    assert not r_headers.response_headers.HasField("response") and not r_body.response_body.HasField("response")


async def test_other_path_with_body_skips_body_processing(stub):
    (reply,) = await exchange(stub, headers_msg("POST", "/v1/embeddings"))
    assert set_headers(reply.request_headers.response)["x-gateway-destination-endpoint"] in ENDPOINTS
    assert reply.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.NONE


async def test_generation_request_without_body_is_rejected(stub):
    (reply,) = await exchange(stub, headers_msg("POST", "/v1/chat/completions", end=True))
    status, body, hdrs = error_of(reply)
    assert status == 400 and hdrs["content-type"] == "application/json"
    assert "body is required" in body["error"]["message"]


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_generation_path_with_another_method_is_a_json_405(stub, method):
    (reply,) = await exchange(stub, headers_msg(method, "/v1/chat/completions/", end=True))
    status, body, hdrs = error_of(reply)
    assert status == 405 and hdrs["allow"] == "POST" and hdrs["content-type"] == "application/json"
    assert body["error"]["code"] == "method_not_allowed" and method in body["error"]["message"]


async def test_response_phases_pass_through(stub):
    replies = await exchange(
        stub,
        headers_msg("POST", "/v1/completions"),
        body_msg(orjson.dumps({"model": "qwen3-8b", "prompt": "Once upon", "max_tokens": 5})),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=False)),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"id":"x"}', end_of_stream=True)),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
    )
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body", "response_trailers"]
    assert not replies[3].response_body.response.HasField("body_mutation")


@pytest.mark.parametrize(
    ("body", "status", "code", "needle"),
    [
        (b"{oops", 400, "invalid_json", "not valid JSON"),
        (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff"}]}', 400, "invalid_json", "UTF-8"),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), 400, "invalid_value", "'model' is a required property"),
        (orjson.dumps({"model": MODEL}), 400, "invalid_value", "'messages'"),
        (chat_body(max_tokens=-3), 400, "invalid_value", "max_tokens"),
        (orjson.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404, "model_not_found", "Qwen/Qwen3-8B, qwen3-8b"),
        (chat_body(max_tokens=4090), 400, "context_length_exceeded", "maximum context length is 4096 tokens"),
        (chat_body("word " * 5000), 400, "context_length_exceeded", "input tokens"),
        (b"x" * 70000, 413, "request_too_large", "limit is 65536 bytes"),
    ],
    ids=["bad-json", "bad-utf8", "no-model", "no-messages", "negative-max-tokens", "unknown-model", "context-with-max-tokens", "prompt-too-long", "oversized"],
)
async def test_errors_are_openai_json(app, stub, body, status, code, needle):
    _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
    got_status, payload, hdrs = error_of(reply)
    assert got_status == status
    assert hdrs["content-type"] == "application/json"
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == code
    assert needle in payload["error"]["message"]
    assert "Traceback" not in payload["error"]["message"]
    assert app.store.open_reservations == 0


async def test_context_error_names_both_numbers(stub, qwen_counter):
    msgs = [{"role": "user", "content": "count me"}]
    prompt = qwen_counter.count_chat(msgs).count
    _, reply = await exchange(
        stub, headers_msg("POST", "/v1/chat/completions"), body_msg(orjson.dumps({"model": MODEL, "messages": msgs, "max_tokens": 4096}))
    )
    _, payload, _ = error_of(reply)
    msg = payload["error"]["message"]
    assert f"you requested {prompt + 4096} tokens ({prompt} in the messages, 4096 in the completion)" in msg


async def test_no_healthy_endpoint_is_503(make_app):
    app = await make_app(scheduling={"health_check": {"enabled": True, "interval_s": 60, "timeout_s": 0.2}})
    assert not any(ep.healthy for ep in app.store.all())  # nothing listens on the endpoint ports
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        stub = pb_grpc.ExternalProcessorStub(ch)
        _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body()))
        status, payload, _ = error_of(reply)
        assert status == 503 and payload["error"]["code"] == "no_healthy_endpoint"
        (reply,) = await exchange(stub, headers_msg("GET", "/v1/models", end=True))
        assert error_of(reply)[0] == 503


async def test_header_value_with_byte_ff_does_not_break_the_stream(stub):
    _, r_body = await exchange(
        stub,
        headers_msg("POST", "/v1/chat/completions", extra={"x-custom": b"caf\xff", "x-request-id": b"id-\xff"}),
        body_msg(chat_body()),
    )
    assert r_body.WhichOneof("response") == "request_body"


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def inflight(app) -> int:
    return sum(ep.inflight for ep in app.store.all())


async def test_stream_cancelled_after_headers_leaves_nothing(app, stub):
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    call.cancel()
    await wait_until(lambda: app.servicer.active_streams == 0)
    assert inflight(app) == 0 and app.store.open_reservations == 0


async def test_stream_cancelled_after_body_releases_the_reservation(app, stub):
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    await call.write(body_msg(chat_body()))
    reply = await call.read()
    chosen = set_headers(reply.request_body.response)["x-gateway-destination-endpoint"]
    assert app.store.get(chosen).inflight == 1  # held while the response streams
    call.cancel()  # what Envoy does when a streamed response ends, or the client goes away
    await wait_until(lambda: app.store.open_reservations == 0)
    assert inflight(app) == 0


async def test_clean_close_after_body_releases_the_reservation(app, stub):
    await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body()))
    await wait_until(lambda: app.store.open_reservations == 0)


async def test_least_inflight_spreads_concurrent_requests(app, stub):
    calls = []
    for _ in range(6):
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions"))
        await call.read()
        await call.write(body_msg(chat_body()))
        await call.read()
        calls.append(call)
    assert sorted(ep.inflight for ep in app.store.all()) == [3, 3]
    for call in calls:
        call.cancel()
    await wait_until(lambda: inflight(app) == 0)


async def test_thousand_parallel_streams_return_counters_to_zero(app, stub):
    async def one(i: int) -> None:
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions"))
        await call.read()
        await call.write(body_msg(chat_body(f"request {i}")))
        await call.read()
        if i % 3 == 0:
            call.cancel()
        else:
            await call.done_writing()
            await call.read()

    await asyncio.gather(*(one(i) for i in range(1000)))
    await wait_until(lambda: app.store.open_reservations == 0 and app.servicer.active_streams == 0, timeout=20)
    assert inflight(app) == 0
    routed = app.metrics.registry.get_sample_value("llm_extproc_requests_total", {"outcome": "routed", "reason": "ok"})
    assert routed == 1000
    for ep in ENDPOINTS:
        assert app.metrics.registry.get_sample_value("llm_extproc_endpoint_inflight_requests", {"endpoint": ep}) == 0


async def test_responses_decode_with_an_independent_implementation(stub):
    """Wire compatibility: envoy-data-plane's betterproto dataclasses read our bytes the same way."""
    from envoy_data_plane.envoy.service.ext_proc.v3 import ProcessingResponse as BPResponse

    r_headers, r_body = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body(max_tokens=8)))
    decoded = BPResponse.parse(r_body.SerializeToString())
    common = decoded.request_body.response
    assert common.clear_route_cache is True
    got = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert got["x-gateway-destination-endpoint"].decode() in ENDPOINTS
    assert int(got["x-llm-prompt-tokens"]) > 0
    assert BPResponse.parse(r_headers.SerializeToString()).request_headers.response.header_mutation.remove_headers == list(OWNED_HEADERS)
    _, r_err = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(b"{"))
    imm = BPResponse.parse(r_err.SerializeToString()).immediate_response
    assert imm.status.code.value == 400
    assert orjson.loads(imm.body)["error"]["code"] == "invalid_json"


async def test_health_service_serves_and_goes_not_serving_on_shutdown(make_app):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    app = await make_app()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        hs = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = await hs.Check(health_pb2.HealthCheckRequest(service=svc))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_graceful_shutdown_lets_inflight_streams_finish(make_app):
    app = await make_app()
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions"))
        await call.read()
        closing = asyncio.create_task(app.aclose(grace_s=5))
        await asyncio.sleep(0.2)
        # The open stream is still served during the grace period ...
        await call.write(body_msg(chat_body()))
        reply = await call.read()
        assert reply.WhichOneof("response") == "request_body"
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        await asyncio.wait_for(closing, 5)
    assert app.store.open_reservations == 0


@pytest.mark.parametrize(
    ("telemetry", "body_mode"),
    [({"sample_rate": 1.0}, "STREAMED"), ({"enabled": False}, "NONE")],
    ids=["telemetry-on", "telemetry-off"],
)
async def test_generation_mode_streams_responses_only_with_telemetry(make_app, telemetry, body_mode):
    app = await make_app(telemetry=telemetry)
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        (reply,) = await exchange(pb_grpc.ExternalProcessorStub(ch), headers_msg("POST", "/v1/chat/completions"))
    mode = reply.mode_override
    PM = processing_mode_pb2.ProcessingMode
    assert mode.request_body_mode == PM.BUFFERED and mode.response_header_mode == PM.SEND
    assert mode.response_body_mode == PM.BodySendMode.Value(body_mode)
    assert mode.request_trailer_mode == PM.SKIP and mode.response_trailer_mode == PM.SKIP


async def test_unneeded_response_headers_are_skipped_and_prefill_ends_at_the_predicted_ttft(make_app):
    """`telemetry.response_headers: when_needed` with nothing reading the response headers: an
    unobserved request asks for two messages only, leaves prefill at its endpoint's predicted
    TTFT (teaching the fit nothing), and releases everything when its stream ends."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    app = await make_app(
        telemetry={"enabled": False, "response_headers": "when_needed"},
        scheduling={"health_check": {"enabled": False}, "outlier_detection": {"enabled": False}},
    )
    PM = processing_mode_pb2.ProcessingMode
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process()
        await call.write(headers_msg("POST", "/v1/chat/completions"))
        mode = (await call.read()).mode_override
        assert mode.request_body_mode == PM.BUFFERED and mode.response_header_mode == PM.SKIP
        await call.write(body_msg(chat_body("hello " * 50)))
        ep = app.store.get(set_headers((await call.read()).request_body.response)["x-gateway-destination-endpoint"])
        assert ep.inflight == 1
        for _ in range(500):  # the fit's prior: 20 ms plus the prompt's share
            if ep.decode_inflight == 1:
                break
            await asyncio.sleep(0.01)
        assert (ep.prefill_inflight, ep.decode_inflight, ep.prefill_fit.samples) == (0, 1, 0)
        await call.done_writing()
        await call.read()
    for _ in range(100):
        if ep.inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert (ep.inflight, ep.decode_inflight) == (0, 0)


async def test_response_headers_stay_while_outlier_detection_reads_them(make_app):
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    app = await make_app(telemetry={"enabled": False, "response_headers": "when_needed"})  # outlier detection on (default)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        (reply,) = await exchange(pb_grpc.ExternalProcessorStub(ch), headers_msg("POST", "/v1/chat/completions"))
    assert reply.mode_override.response_header_mode == processing_mode_pb2.ProcessingMode.SEND


async def test_observed_stream_marks_first_token_on_first_content(app, stub):
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    await call.write(body_msg(chat_body(stream=True)))
    chosen = set_headers((await call.read()).request_body.response)["x-gateway-destination-endpoint"]
    ep = app.store.get(chosen)
    sse_headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"), base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")]
    )
    await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=sse_headers)))
    await call.read()
    assert ep.prefill_inflight == 1  # headers alone do not end prefill when the body is observed
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=role)))
    await call.read()
    assert ep.prefill_inflight == 1  # an empty role chunk is not a token
    token = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=token)))
    reply = await call.read()
    assert not reply.response_body.response.HasField("body_mutation")  # markers off: unchanged
    assert (ep.prefill_inflight, ep.decode_inflight) == (0, 1)
    assert ep.prefill_s_per_token is not None  # a streamed first token teaches the prefill speed
    call.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)


@pytest.mark.parametrize("telemetry", [{"sample_rate": 1.0}, {"enabled": False}], ids=["observed", "unobserved"])
async def test_a_non_streamed_answer_ends_prefill_without_teaching_its_speed(make_app, telemetry):
    """A non-streamed answer's headers and body come with its last token: the request leaves
    prefill, but its end-to-end time is not a time to first token."""
    app = await make_app(telemetry=telemetry)
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process()
        await call.write(headers_msg("POST", "/v1/chat/completions"))
        await call.read()
        await call.write(body_msg(chat_body()))
        ep = app.store.get(set_headers((await call.read()).request_body.response)["x-gateway-destination-endpoint"])
        json_headers = base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"), base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")]
        )
        await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=json_headers)))
        await call.read()
        if telemetry.get("enabled", True):
            answer = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Hi there"}}]}'
            await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True)))
            await call.read()
        assert (ep.prefill_inflight, ep.decode_inflight) == (0, 1)
        assert ep.prefill_s_per_token is None
        call.cancel()
    await wait_until(lambda: app.store.open_reservations == 0)


async def _answer_as(stub, status_for) -> str:
    """One request, answered by its endpoint with the status `status_for(endpoint)` gives;
    returns the endpoint."""
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    await call.write(body_msg(chat_body()))
    chosen = set_headers((await call.read()).request_body.response)["x-gateway-destination-endpoint"]
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status_for(chosen))])
    await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers, end_of_stream=True)))
    await call.read()
    await call.done_writing()
    await call.read()
    return chosen


async def test_an_endpoint_answering_5xx_is_ejected_then_tried_again(make_app):
    """Five 5xx answers in a row eject an endpoint (probes cannot see it: it may pass /health
    and fail every generation); the other takes every request while it is out."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from prometheus_client import generate_latest

    app = await make_app(scheduling={"health_check": {"enabled": False}, "outlier_detection": {"consecutive_5xx": 5, "ejection_s": 60}})
    bad = ENDPOINTS[0]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        failures = 0
        for _ in range(200):  # the fail-fast endpoint looks idle: it gets picked often
            failures += await _answer_as(stub, lambda ep: b"503" if ep == bad else b"200") == bad
            if failures == 5:
                break
        ep = app.store.get(bad)
        assert failures == 5 and ep.ejected(time.monotonic())
        assert {await _answer_as(stub, lambda ep: b"200") for _ in range(10)} == {ENDPOINTS[1]}
    assert f'llm_extproc_endpoint_ejections_total{{endpoint="{bad}"}} 1.0' in generate_latest(app.metrics.registry).decode()
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{app.admin_port}/api/v1/endpoints") as resp:
        shown = {e["address"]: e for e in (await resp.json())["endpoints"]}
    assert 0 < shown[bad]["ejected_for_s"] <= 60 and shown[ENDPOINTS[1]]["ejected_for_s"] == 0


def _detector(n: int = 1, **cfg):
    from extproc.config.schema import EndpointConfig, OutlierDetectionConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.datastore.outliers import OutlierDetector

    store = Datastore([EndpointConfig(address=f"127.0.0.{i + 1}:1", models=["m"]) for i in range(n)])
    return OutlierDetector(store, OutlierDetectionConfig(**cfg)), store.all()


def test_an_ejection_ends_and_one_more_5xx_ejects_again():
    od, (ep,) = _detector(consecutive_5xx=3, ejection_s=10.0)
    assert [od.record(ep, 503, 0.0, 0.0) for _ in range(3)] == [None, None, 10.0]
    assert ep.ejected(5.0) and not ep.ejected(10.5)
    assert od.record(ep, 503, 11.0, 11.0) == 20.0  # the first try after the ejection fails: out again, longer
    assert ep.ejected(30.0)
    assert od.record(ep, 200, 32.0, 32.0) is None and ep.consecutive_5xx == 0
    od.record(ep, 503, 32.0, 32.0)
    od.record(ep, 429, 32.0, 32.0)  # the engine shedding, or Envoy timing a slow answer out,
    od.record(ep, 504, 32.0, 32.0)  # neither ends nor extends a streak
    assert ep.consecutive_5xx == 1
    od.record(ep, 404, 32.0, 32.0)  # a client error ends it
    assert ep.consecutive_5xx == 0


def test_repeated_ejections_grow_to_a_cap_then_start_over():
    od, (ep,) = _detector(consecutive_5xx=1, ejection_s=10.0, max_ejection_s=25.0)
    t, lengths = 0.0, []
    for _ in range(4):
        lengths.append(od.record(ep, 500, t, t))
        t = ep.ejected_until + 0.1
    assert lengths == [10.0, 20.0, 25.0, 25.0]
    t = ep.ejected_until + 25.0  # answered for max_ejection_s without an ejection
    assert od.record(ep, 500, t, t) == 10.0


def test_no_more_than_the_max_share_of_endpoints_is_ejected():
    od, eps = _detector(4, consecutive_5xx=1)
    assert [od.record(ep, 500, 0.0, 0.0) for ep in eps] == [10.0, 10.0, None, None]
    assert [ep.ejected(1.0) for ep in eps] == [True, True, False, False]
    od2, eps2 = _detector(4, consecutive_5xx=1, max_ejected_share=0.25)
    assert sum(od2.record(ep, 500, 0.0, 0.0) is not None for ep in eps2) == 1


def test_the_max_share_is_per_model_pool():
    # Ejections on a big pool must not use up a small pool's share (nor the reverse): counted
    # over the whole fleet, the 2-endpoint model lost both endpoints while 1 of 6 were out.
    from extproc.config.schema import EndpointConfig, OutlierDetectionConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.datastore.outliers import OutlierDetector

    cfgs = [EndpointConfig(address=f"127.0.0.{i + 1}:1", models=["big"]) for i in range(4)]
    cfgs += [EndpointConfig(address=f"127.0.1.{i + 1}:1", models=["small"]) for i in range(2)]
    store = Datastore(cfgs)
    od = OutlierDetector(store, OutlierDetectionConfig(consecutive_5xx=1))
    big, small = store.all()[:4], store.all()[4:]
    assert [od.record(ep, 500, 0.0, 0.0) is not None for ep in small] == [True, False]
    assert [od.record(ep, 500, 0.0, 0.0) is not None for ep in big] == [True, True, False, False]


def test_only_answers_routed_after_the_ejection_reset_the_streak():
    od, (ep,) = _detector(consecutive_5xx=3, ejection_s=10.0)
    for _ in range(3):
        od.record(ep, 503, 0.0, 1.0)
    assert ep.ejected(2.0)
    # A request routed before the ejection (at 0.5) answers 200 during it, and another 503:
    # neither speaks for the endpoint now.
    assert od.record(ep, 200, 0.5, 5.0) is None and od.record(ep, 503, 0.5, 12.0) is None
    assert ep.consecutive_5xx == 2  # one short: the first own answer after the ejection decides
    assert od.record(ep, 503, 12.0, 12.5) == 20.0


async def test_credentials_never_reach_logs_or_metrics(app, stub, caplog):
    import logging

    from prometheus_client import generate_latest

    caplog.set_level(logging.DEBUG)
    secret = "sk-live-0123456789abcdef"
    for body in (chat_body(user=secret), b"{broken " + secret.encode()):
        await exchange(
            stub,
            headers_msg("POST", "/v1/chat/completions", extra={"authorization": f"Bearer {secret}".encode(), "x-api-key": secret.encode()}),
            body_msg(body),
        )
    exposed = generate_latest(app.metrics.registry).decode()
    assert secret not in caplog.text and secret not in exposed


async def test_client_template_is_refused(stub):
    body = chat_body(chat_template_kwargs={"chat_template": "{% for i in range(100000000) %}x{% endfor %}"})
    _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
    status, payload, _ = error_of(reply)
    assert status == 400 and payload["error"]["param"] == "chat_template_kwargs"
    assert "enable_thinking" in payload["error"]["message"]  # what the model's template does read


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 2049}), "messages"),
        ("/v1/completions", orjson.dumps({"model": MODEL, "prompt": ["a"] * 1025}), "prompt"),
    ],
    ids=["too-many-messages", "too-many-prompts"],
)
async def test_size_limits_refuse_before_tokenizing(stub, path, body, param):
    _, reply = await exchange(stub, headers_msg("POST", path), body_msg(body))
    status, payload, _ = error_of(reply)
    assert status == 400 and payload["error"]["param"] == param


@pytest.mark.parametrize("body_bytes", [60_000, 600_000], ids=["counted-inline", "counted-in-a-thread"])
async def test_body_of_many_tiny_values_is_refused_while_other_streams_are_routed(make_app, body_bytes):
    """~`body_bytes / 3` empty arrays in an extra message field: refused (400, the limit named)
    from its bytes, while a normal request on another stream is routed meanwhile."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    app = await make_app(limits={"max_body_bytes": 1 << 20, "grpc_max_message_bytes": 2 << 20})
    many = chat_body(x=[[]] * (body_bytes // 3))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        (_, refused), (_, routed) = await asyncio.gather(
            exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(many)),
            exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body())),
        )
    status, payload, _ = error_of(refused)
    assert status == 400 and payload["error"]["code"] == "too_many_json_values"
    message = payload["error"]["message"]
    assert "more than 16384 JSON values" in message and "limits.max_json_values" in message
    assert set_headers(routed.request_body.response)["x-gateway-destination-endpoint"] in ENDPOINTS
    assert app.store.open_reservations == 0


async def test_a_full_context_token_id_prompt_passes_the_value_limit_that_a_chat_may_not(make_app):
    """A completions prompt of token ids is one JSON value per token: one full-context prompt
    fits on top of `limits.max_json_values`, while a chat body with as many values is refused."""
    app = await make_app(
        limits={"max_body_bytes": 1 << 20, "grpc_max_message_bytes": 2 << 20, "max_json_values": 1000},
        models=[{"name": MODEL, "max_model_len": 4096}],
    )
    ids = list(range(100, 4090))  # 3,990 values: over 1,000, within 1,000 + 4,096
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        stub = pb_grpc.ExternalProcessorStub(ch)
        _, routed = await exchange(
            stub, headers_msg("POST", "/v1/completions"), body_msg(orjson.dumps({"model": MODEL, "prompt": ids, "max_tokens": 4}))
        )
        _, refused = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body(x=ids)))
    assert set_headers(routed.request_body.response)["x-gateway-destination-endpoint"] in ENDPOINTS
    status, payload, _ = error_of(refused)
    assert status == 400 and payload["error"]["code"] == "too_many_json_values"
    assert "more than 1000 JSON values" in payload["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/chat/%63ompletions", "/%76%31/chat/completions", "/v1//chat/completions", "/v1/x/../chat/completions"])
async def test_encoded_or_dotted_paths_are_still_generation_requests(stub, path):
    (reply,) = await exchange(stub, headers_msg("POST", path))
    assert reply.mode_override.request_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED


@pytest.mark.parametrize(
    "messages",
    [
        [pb.ProcessingRequest()],
        [headers_msg("GET", "/v1/models", end=True), headers_msg("GET", "/v1/models", end=True)],
    ],
    ids=["empty-message", "second-headers"],
)
async def test_protocol_violations_end_the_stream_and_release(app, stub, messages):
    call = stub.Process()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        for m in messages:
            await call.write(m)
            await call.read()
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await wait_until(lambda: app.store.open_reservations == 0 and app.servicer.active_streams == 0)


def _long_text_in(where: str, text: str) -> bytes:
    """A chat body whose long text sits in the message content, a tool schema, or a tool call."""
    hi = [{"role": "user", "content": "hi"}]
    if where == "content":
        return chat_body(text)
    if where == "tools":
        return orjson.dumps({"model": MODEL, "messages": hi, "tools": [{"type": "function", "function": {"name": "f", "description": text}}]})
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": text}}]}
    return orjson.dumps({"model": MODEL, "messages": [*hi, call, {"role": "user", "content": "x"}]})


@pytest.mark.parametrize("where", ["content", "tools", "tool_calls"])
async def test_prompt_with_more_characters_than_the_context_can_hold_is_refused_untokenized(make_app, where):
    """Whatever part of the request the text sits in (the template renders all of it)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    app = await make_app(models=[{"name": MODEL, "max_model_len": 1024}])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        misses = app.pipeline.resolve_model(MODEL).counter.misses
        # 16 characters per token of context (limits.max_chars_per_token) × 1,024 tokens, plus one.
        body = _long_text_in(where, "x" * (16 * 1024 + 1))
        _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
        status, payload, _ = error_of(reply)
        assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
        assert app.pipeline.resolve_model(MODEL).counter.misses == misses  # nothing was tokenized


async def test_slow_counting_routes_on_an_estimate_instead_of_refusing(make_app):
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    # A 200 ms decision budget leaves 100 ms for counting: ~40k new words take several times that
    # with `tokenizers` (tiktoken takes ~40 ms: this test keeps the slower encoder).
    app = await make_app(
        counter=TokenCounter.from_source("builtin:qwen3", encoder="tokenizers"),
        limits={"max_body_bytes": 300_000, "grpc_max_message_bytes": 600_000, "decision_timeout_ms": 200},
        models=[{"name": MODEL, "aliases": ["qwen3-8b"], "max_model_len": 131072}],
    )
    text = " ".join(f"w{i}" for i in range(40_000))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        _, reply = await exchange(pb_grpc.ExternalProcessorStub(ch), headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body(text)))
    hdrs = set_headers(reply.request_body.response)
    assert hdrs["x-gateway-destination-endpoint"] in ENDPOINTS
    # the character estimate: every string of the message (keys, role, content) + 16 per message
    assert int(hdrs["x-llm-prompt-tokens"]) == int((len("role") + len("user") + len("content") + len(text) + 16) / 3.5)
    assert app.metrics.registry.get_sample_value("llm_extproc_tokenizer_estimates_total", {"model": MODEL}) == 1


async def test_a_count_that_would_queue_past_its_budget_routes_on_the_estimate_at_once(make_app):
    """A flood of huge prompts must not make each decision wait its whole budget behind the
    others' tokenization: with the tokenizer threads holding more work than the budget allows,
    a new long prompt is routed on the character estimate without being queued (nothing is
    tokenized); once the work is done, the same prompt is counted exactly."""
    counter = TokenCounter.from_source("builtin:qwen3")
    app = await make_app(
        counter=counter,
        limits={"max_body_bytes": 300_000, "grpc_max_message_bytes": 600_000},
        models=[{"name": MODEL, "max_model_len": 131072}],
    )
    gate = app.pipeline.offload
    flood = 10**9  # characters some other requests' counts still hold in both threads
    assert gate.admit(flood) and gate.admit(flood)
    text = " ".join(f"w{i}" for i in range(20_000))  # ~110k characters: counted off the loop
    body = chat_body(text)
    cached = counter.cache_stats()["tokens"]
    routed = await app.pipeline.route(RequestKind.CHAT, body)
    # the character estimate: every string of the message (keys, role, content) + 16 per message
    assert routed.request.prompt_tokens == int((len("role") + len("user") + len("content") + len(text) + 16) / 3.5)
    assert counter.cache_stats()["tokens"] == cached and gate.refused == 1  # nothing was tokenized
    assert app.metrics.registry.get_sample_value("llm_extproc_tokenizer_estimates_total", {"model": MODEL}) == 1
    gate.done(flood, None)
    gate.done(flood, None)
    routed = await app.pipeline.route(RequestKind.CHAT, body)
    messages = [{"role": "user", "content": text}]
    exact = counter.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert routed.request.prompt_tokens == len(exact)
    assert (gate.jobs, gate.queued_chars) == (0, 0)


async def test_token_cache_metrics_count_each_request_once_under_concurrency(make_app):
    """Hits and misses come from each request's own segments, not from the shared counter's
    movement while other requests (and tokenizer threads) run. The app gets its own counter: the
    session's shared one is still being filled by an earlier test's abandoned tokenization
    (test_slow_counting_routes_on_an_estimate_instead_of_refusing), which made this flaky."""
    app = await make_app(
        counter=TokenCounter.from_source("builtin:qwen3"),
        limits={"max_body_bytes": 300_000, "grpc_max_message_bytes": 600_000},
        models=[{"name": MODEL, "max_model_len": 131072}],
    )
    counter = app.pipeline.resolve_model(MODEL).counter
    hits0, misses0 = counter.hits, counter.misses
    long_ones = [chat_body(f"doc {i} " + "lorem ipsum " * 2_500) for i in range(8)]  # off the loop
    short_ones = [chat_body(f"short {i}") for i in range(40)]
    await asyncio.gather(*(app.pipeline.route(RequestKind.CHAT, b) for b in long_ones + short_ones + long_ones))
    reg = app.metrics.registry
    assert reg.get_sample_value("llm_extproc_tokenizer_cache_hits_total", {"model": MODEL}) == counter.hits - hits0
    assert reg.get_sample_value("llm_extproc_tokenizer_cache_misses_total", {"model": MODEL}) == counter.misses - misses0


async def test_health_panic_of_one_model_is_not_undone_by_another_models_requests(make_app, caplog):
    # The panic state was one flag for the whole process: requests alternating between a model
    # in panic and a healthy one flipped it each time — a WARNING line, an entered_total count
    # and a gauge flap per request.
    caplog.set_level(logging.INFO, logger="extproc.pipeline.request")
    app = await make_app(
        models=[{"name": MODEL, "max_model_len": 4096}, {"name": "other", "path": "builtin:qwen3-8b", "max_model_len": 4096}],
        endpoints=[{"address": ENDPOINTS[0], "models": [MODEL]}, {"address": ENDPOINTS[1], "models": ["other"]}],
    )
    slow = app.store.get(ENDPOINTS[0])
    slow.healthy, slow.last_probe_error = False, "timeout"  # probes time out: panic routes there
    registry = app.metrics.registry
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for _ in range(4):
            for model in (MODEL, "other"):
                body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
                _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
                assert reply.WhichOneof("response") == "request_body"
    assert registry.get_sample_value("llm_extproc_health_panic_entered_total") == 1.0
    assert registry.get_sample_value("llm_extproc_health_panic") == 1.0
    assert len([r for r in caplog.records if "health panic" in r.getMessage()]) == 1


async def test_a_downgraded_claim_keeps_its_response_headers_when_others_skip_them(make_app):
    """With `telemetry.response_headers: when_needed` unobserved requests skip the response
    headers; a downgraded priority claim needs them, to say the class applied."""
    app = await make_app(
        telemetry={"sample_rate": 0.01, "response_headers": "when_needed"},
        scheduling={"health_check": {"enabled": False}, "outlier_detection": {"enabled": False}},
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra={"x-llm-priority": b"critical"}))
        reply = await call.read()
        call.cancel()
    assert reply.mode_override.response_header_mode == processing_mode_pb2.ProcessingMode.SEND
