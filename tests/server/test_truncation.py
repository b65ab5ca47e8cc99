"""Truncation through the real servicer over gRPC: an over-long chat is cut only where the model
opts in, the body Envoy forwards is the cut one with its content-length, the routing headers
carry the cut prompt's count, the response gets `x-llm-truncated-tokens`, the metrics count it
— and without opt-in the 400 is byte for byte what it was."""

from __future__ import annotations

from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.protocol.openai import parse_body
from extproc.types import RequestKind
from tests.server.conftest import MODEL
from tests.server.test_contract import body_msg, error_of, exchange, headers_msg, set_headers

LIMITS = {"max_body_bytes": 262144, "grpc_max_message_bytes": 524288, "shutdown_grace_s": 1}


def model(**truncation: Any) -> list[dict[str, Any]]:
    return [{"name": MODEL, "aliases": ["qwen3-8b"], "max_model_len": 4096, **({"truncation": truncation} if truncation else {})}]


def long_chat(model_name: str = MODEL) -> bytes:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    for t in range(30):
        msgs.append({"role": "user", "content": f"question {t}: " + "tell me about the weather in spring " * 12})
        msgs.append({"role": "assistant", "content": f"answer {t}: " + "it is mild and often rainy " * 12})
    msgs.append({"role": "user", "content": "and in autumn?"})
    return orjson.dumps({"model": model_name, "messages": msgs, "max_tokens": 256, "temperature": 0.25})


async def decide(app, body: bytes, *, truncate: bytes | None = None) -> tuple[pb.ProcessingResponse, pb.ProcessingResponse]:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    extra = {"x-llm-truncate": truncate} if truncate is not None else None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        _, r_body, r_resp = await exchange(
            stub,
            headers_msg("POST", "/v1/chat/completions", extra=extra),
            body_msg(body),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=False)),
        )
    return r_body, r_resp


@pytest.mark.parametrize("name", [MODEL, "qwen3-8b"], ids=["served-name", "alias"])
async def test_on_request_truncation_rewrites_body_and_tells_the_client(make_app, qwen_counter, name):
    app = await make_app(limits=LIMITS, models=model(mode="on-request", min_output_tokens=128))
    body = long_chat(name)
    before = qwen_counter.count_chat(parse_body(RequestKind.CHAT, body).messages).count
    assert before + 256 > 4096
    r_body, r_resp = await decide(app, body, truncate=b"head-tail")
    common = r_body.request_body.response
    sent = common.body_mutation.body
    headers = set_headers(common)
    assert headers["content-length"] == str(len(sent))
    parsed = parse_body(RequestKind.CHAT, sent)
    ids = qwen_counter.tokenizer.apply_chat_template(parsed.messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    count = len(ids)
    assert headers["x-llm-prompt-tokens"] == str(count) and count + 256 <= 4096
    assert orjson.loads(sent)["model"] == MODEL  # the alias rewrite applies to the cut body too
    assert b'"temperature":0.25' in sent
    added = set_headers(r_resp.response_headers.response)
    assert added["x-llm-truncated-tokens"] == str(before - count)
    registry = app.metrics.registry
    assert registry.get_sample_value("llm_extproc_truncation_requests_total", {"model": MODEL}) == 1
    assert registry.get_sample_value("llm_extproc_truncation_dropped_tokens_total", {"model": MODEL}) == before - count
    assert registry.get_sample_value("llm_extproc_decision_duration_seconds_count", {"phase": "truncate"}) == 1
    assert app.store.open_reservations == 0


async def test_without_opt_in_the_400_is_unchanged(make_app):
    baseline = await make_app(limits=LIMITS, models=model())
    _, reference, _ = error_of((await decide(baseline, long_chat()))[0])
    for truncation, header in (({"mode": "off"}, b"head-tail"), ({"mode": "head-tail"}, b"off")):
        app = await make_app(limits=LIMITS, models=model(**truncation))
        r_body, _ = await decide(app, long_chat(), truncate=header)
        status, payload, _ = error_of(r_body)
        assert (status, payload) == (400, reference), truncation
        assert app.metrics.registry.get_sample_value("llm_extproc_truncation_requests_total", {"model": MODEL}) is None
    assert reference["error"]["code"] == "context_length_exceeded"


async def test_on_request_model_says_how_to_ask_for_the_cut(make_app):
    # A new user on an `on-request` model got the plain context 400 and no way to learn that the
    # gateway would have cut the prompt had they sent the header.
    baseline = await make_app(limits=LIMITS, models=model())
    _, reference, _ = error_of((await decide(baseline, long_chat()))[0])
    app = await make_app(limits=LIMITS, models=model(mode="on-request"))
    status, payload, _ = error_of((await decide(app, long_chat()))[0])
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    assert payload["error"]["param"] == reference["error"]["param"]
    message = payload["error"]["message"]
    assert message.startswith(reference["error"]["message"]) and "'x-llm-truncate: head-tail'" in message
    # Asked and declined (`off`): the plain 400, no hint.
    _, declined, _ = error_of((await decide(app, long_chat(), truncate=b"off"))[0])
    assert declined == reference


async def test_a_request_that_fits_is_not_rewritten(make_app):
    app = await make_app(limits=LIMITS, models=model(mode="head-tail"))
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "short"}], "max_tokens": 16})
    r_body, r_resp = await decide(app, body)
    assert not r_body.request_body.response.HasField("body_mutation")
    assert "x-llm-truncated-tokens" not in set_headers(r_resp.response_headers.response)


async def test_truncation_that_cannot_fit_says_why(make_app):
    app = await make_app(limits=LIMITS, models=model(mode="head-tail"))
    msgs = [{"role": "system", "content": "rules " * 5000}, {"role": "user", "content": "go"}]
    body = orjson.dumps({"model": MODEL, "messages": msgs})
    status, payload, _ = error_of((await decide(app, body))[0])
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    assert "Head + tail truncation could not make it fit" in payload["error"]["message"]


async def test_an_over_long_responses_request_gets_the_context_400_not_a_500(make_app):
    # /v1/responses carries its conversation in `input` / `instructions`, which truncation does
    # not rewrite: it went to the completions cutter, which looked for a `prompt` member and
    # raised IndexError, a 500 for every over-long Responses request on a model with truncation.
    app = await make_app(limits=LIMITS, models=model(mode="head-tail"))
    turns = [{"role": "user", "content": "tell me about the weather in spring " * 300}] * 3
    for body in ({"input": turns}, {"instructions": "rules " * 5000, "input": "go"}):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            raw = orjson.dumps({"model": MODEL, "max_output_tokens": 256, **body})
            _, reply = await exchange(stub, headers_msg("POST", "/v1/responses"), body_msg(raw))
        status, payload, _ = error_of(reply)
        assert status == 400 and payload["error"]["code"] == "context_length_exceeded", payload
