"""What a new user trips over (issue 19), at the ext_proc contract: the Responses API counted and
routed, context-length errors that name the right field, engine errors answered in the gateway's
shape and counted as the client's, not the endpoint's."""

from __future__ import annotations

import time

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.server.test_contract import MODEL, body_msg, chat_body, error_of, exchange, headers_msg, set_headers

RESPONSES_BODY = {
    "model": MODEL,
    "instructions": "Be brief.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 3, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": "6"},
    ],
    "max_output_tokens": 50,
}


async def test_responses_api_is_counted_from_instructions_and_input_items(stub, qwen_counter):
    _, reply = await exchange(stub, headers_msg("POST", "/v1/responses"), body_msg(orjson.dumps(RESPONSES_BODY)))
    hdrs = set_headers(reply.request_body.response)
    rendered = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 3}'}}]},
        {"role": "tool", "content": "6", "tool_call_id": "c1"},
    ]  # fmt: skip
    assert "x-gateway-destination-endpoint" in hdrs
    assert int(hdrs["x-llm-prompt-tokens"]) == qwen_counter.count_chat(rendered).count


async def test_responses_api_string_input_and_output_budget(stub, qwen_counter):
    body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 4095}
    _, reply = await exchange(stub, headers_msg("POST", "/v1/responses"), body_msg(orjson.dumps(body)))
    status, payload, _ = error_of(reply)  # 4096-token context: the output budget does not fit
    prompt = qwen_counter.count_chat([{"role": "user", "content": "Hello there"}]).count
    assert status == 400 and payload["error"]["param"] == "max_output_tokens"
    assert f"you requested {prompt + 4095} tokens" in payload["error"]["message"]
    body["max_output_tokens"] = 10
    _, reply = await exchange(stub, headers_msg("POST", "/v1/responses"), body_msg(orjson.dumps(body)))
    assert int(set_headers(reply.request_body.response)["x-llm-prompt-tokens"]) == prompt


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": ""}, "input"),
    ],
    ids=["reasoning-item", "image-part", "no-input", "empty-input"],
)
async def test_responses_api_bad_input_is_a_400_naming_it(stub, body, param):
    _, reply = await exchange(stub, headers_msg("POST", "/v1/responses"), body_msg(orjson.dumps(body)))
    status, payload, _ = error_of(reply)
    assert status == 400 and payload["error"]["param"] == param


async def test_prompt_alone_over_the_context_names_the_prompt_even_with_max_tokens(stub):
    _, reply = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body("word " * 5000, max_tokens=10)))
    status, payload, _ = error_of(reply)
    assert status == 400 and payload["error"]["param"] == "messages"
    assert "input tokens. Please reduce the length of the input messages" in payload["error"]["message"]


async def test_character_limit_error_reads_as_a_limit_not_a_bug(make_app):
    app = await make_app(models=[{"name": MODEL, "max_model_len": 1024}])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        body = orjson.dumps({"model": MODEL, "prompt": "x" * (16 * 1024 + 1)})
        _, reply = await exchange(pb_grpc.ExternalProcessorStub(ch), headers_msg("POST", "/v1/completions"), body_msg(body))
    _, payload, _ = error_of(reply)
    msg = payload["error"]["message"]
    assert payload["error"]["param"] == "prompt"
    assert "per token of context can hold" not in msg
    assert "16385 characters" in msg and "at most 16384 characters" in msg


def _response_headers(status: bytes, content_type: bytes = b"application/json") -> pb.ProcessingRequest:
    hdrs = [base_pb2.HeaderValue(key=":status", raw_value=status), base_pb2.HeaderValue(key="content-type", raw_value=content_type),
            base_pb2.HeaderValue(key="content-length", raw_value=b"99")]  # fmt: skip
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hdrs)))


async def _answer_with_error(stub, status: bytes, body: bytes, content_type: bytes = b"application/json"):
    """One chat request; its endpoint answers `status` with `body`. Returns (endpoint, the
    response-headers reply, the response-body reply)."""
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    await call.write(body_msg(chat_body()))
    endpoint = set_headers((await call.read()).request_body.response)["x-gateway-destination-endpoint"]
    await call.write(_response_headers(status, content_type))
    head = await call.read()
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=True)))
    tail = await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return endpoint, head, tail


VLLM_ERROR = orjson.dumps({"object": "error", "message": "min_tokens must be less than or equal to max_tokens",
                           "type": "BadRequestError", "param": "min_tokens", "code": 400})  # fmt: skip


@pytest.mark.parametrize("telemetry", [True, False], ids=["observed", "unobserved"])
async def test_engine_error_reaches_the_client_in_the_gateway_shape(make_app, telemetry):
    app = await make_app(telemetry={"sample_rate": 1.0 if telemetry else 0.0001, "enabled": telemetry})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        _, head, tail = await _answer_with_error(pb_grpc.ExternalProcessorStub(ch), b"400", VLLM_ERROR)
    # The body is asked for whole, its length header dropped (the rewrite changes it).
    assert head.mode_override.response_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED
    assert "content-length" in head.response_headers.response.header_mutation.remove_headers
    assert set_headers(head.response_headers.response)["content-type"] == "application/json"
    body = orjson.loads(tail.response_body.response.body_mutation.body)
    assert body == {"error": {"message": "min_tokens must be less than or equal to max_tokens",
                              "type": "invalid_request_error", "param": "min_tokens", "code": "invalid_request"}}  # fmt: skip


@pytest.mark.parametrize(
    ("status", "raw", "ctype", "want"),
    [
        (b"404", b"404: Not Found", b"text/plain", ("404: Not Found", "invalid_request_error", "not_found")),
        (b"404", b'{"detail":"Not Found"}', b"application/json", ("Not Found", "invalid_request_error", "not_found")),
        (b"500", b'{"error": {"message": "boom", "type": "InternalServerError", "code": 500}}', b"application/json",
         ("boom", "internal_error", "engine_error")),
        (b"400", orjson.dumps({"object": "error", "message": "This model's maximum context length is 10 tokens.", "code": 400}),
         b"application/json", ("This model's maximum context length is 10 tokens.", "invalid_request_error", "context_length_exceeded")),
        (b"502", b"", b"text/plain", ("HTTP 502 from the engine", "internal_error", "engine_error")),
    ],
    ids=["aiohttp-404", "fastapi-404", "new-vllm-500", "context", "empty"],
)
async def test_every_engine_error_shape_is_rewritten(stub, status, raw, ctype, want):
    _, _, tail = await _answer_with_error(stub, status, raw, ctype)
    err = orjson.loads(tail.response_body.response.body_mutation.body)["error"]
    assert (err["message"], err["type"], err["code"]) == want


async def test_an_engine_4xx_is_the_clients_error_not_the_endpoints(make_app):
    """Four 5xx then a 400 then one more 5xx: the 400 (a client's bad field) neither ends the
    streak nor counts toward it, so the fifth 5xx ejects; the response counts as `client_error`."""
    app = await make_app(
        endpoints=[{"address": "127.0.0.1:18001", "models": [MODEL]}],
        scheduling={"health_check": {"enabled": False}, "outlier_detection": {"consecutive_5xx": 5, "ejection_s": 60}},
    )
    ep = app.store.get("127.0.0.1:18001")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        for _ in range(4):
            await _answer_with_error(stub, b"503", b"{}")
        await _answer_with_error(stub, b"400", VLLM_ERROR)
        later_ns = time.monotonic_ns() + 10**12  # past any cached snapshot
        assert ep.consecutive_5xx == 4 and ep.stream_stats.snapshot(later_ns).failed == 4
        await _answer_with_error(stub, b"503", b"{}")
    assert ep.ejected(time.monotonic())
    reg = app.metrics.registry
    assert reg.get_sample_value("llm_extproc_stream_errors_total", {"reason": "client_error"}) == 1
    assert reg.get_sample_value("llm_extproc_stream_errors_total", {"reason": "backend_error"}) == 5


async def _admin(app, path: str):
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{app.admin_port}{path}") as resp:
        return await (resp.json() if path.startswith("/api") else resp.text())


async def test_weights_page_shows_each_scorers_weight_beside_its_score(app):
    body = await _admin(app, "/api/v1/weights")
    weights = {s.scorer.name: s.weight for s in app.pipeline.profile.scorers}
    for row in body["endpoints"]:
        assert set(row["scores"]) == set(weights)
        factor = 1.0
        for name, part in row["scores"].items():
            assert part["weight"] == weights[name]
            if part.get("multiplies"):  # weight-override-scorer scales the total
                factor *= part["score"]
                continue
            assert part["weighted"] == pytest.approx(part["score"] * weights[name], abs=1e-3)
        additive = sum(p["weighted"] for p in row["scores"].values() if not p.get("multiplies"))
        assert row["weight"] == pytest.approx(additive * factor, abs=1e-3)


async def test_endpoints_page_says_what_learned_values_rest_on(app, stub):
    """A streamed first token teaches the prefill speed: the page counts the samples, and says at
    which rate responses feed the stream statistics."""
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    await call.write(body_msg(chat_body(stream=True)))
    await call.read()
    hdrs = [base_pb2.HeaderValue(key=":status", raw_value=b"200"), base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream")]
    await call.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hdrs))))
    await call.read()
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=True)))
    await call.read()
    await call.done_writing()
    await call.read()
    body = await _admin(app, "/api/v1/endpoints")
    assert body["telemetry_sample_rate"] == 1.0
    # The default Qwen3 tokenizer passed the load-time cross-check: counted by tiktoken.
    assert {m["encoder"] for m in body["token_encoders"].values()} == {"tiktoken"}
    # ... and its chat template passed the direct render's self-check.
    assert {m["renderer"] for m in body["token_encoders"].values()} == {"direct"}
    learned = [e for e in body["endpoints"] if e["prefill_s_per_token"] is not None]
    assert [e["prefill_samples"] for e in learned] == [1]
    assert {"ttft_samples", "itl_samples"} <= set(learned[0]["stream"])  # counts (snapshots are cached briefly)


async def test_metrics_have_no_created_series(app, stub):
    await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat_body()))
    text = await _admin(app, "/metrics")
    assert "llm_extproc_requests_total{" in text and "_created" not in text


async def test_an_error_body_in_pieces_is_held_back_and_rewritten_whole(stub):
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    await call.write(body_msg(chat_body()))
    await call.read()
    await call.write(_response_headers(b"400"))
    await call.read()
    half = len(VLLM_ERROR) // 2
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=VLLM_ERROR[:half], end_of_stream=False)))
    first = await call.read()
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=VLLM_ERROR[half:], end_of_stream=True)))
    last = await call.read()
    await call.done_writing()
    await call.read()
    assert first.response_body.response.body_mutation.clear_body
    assert orjson.loads(last.response_body.response.body_mutation.body)["error"]["param"] == "min_tokens"


def test_an_error_body_is_held_only_up_to_its_cap():
    # A misbehaving engine's 50 MB error body was held whole until its end; the rewrite needs
    # the first part only (the message is cut at 2,000 characters anyway).
    from extproc.server.engine_errors import MAX_ERROR_BODY_BYTES, hold_error_bytes, openai_error_body

    held = bytearray()
    for _ in range(50):
        hold_error_bytes(held, b"x" * 10_000)
    assert len(held) == MAX_ERROR_BODY_BYTES
    hold_error_bytes(held, b"y")
    assert b"y" not in held
    err = orjson.loads(openai_error_body(500, bytes(held)))["error"]
    assert err["message"] == "x" * 2000 and err["code"] == "engine_error"
