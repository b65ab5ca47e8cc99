"""The learned output length through the real server: fed by completed responses only, it
caps max_tokens in the decode cost while the KV reservation keeps max_tokens
(docs/decisions/0275)."""

from __future__ import annotations

import aiohttp
import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.pipeline.kv import blocks_for_request

from .test_contract import MODEL, body_msg, chat_body, headers_msg, set_headers, wait_until

H100, A100 = "127.0.0.1:18001", "127.0.0.1:18002"


def _config():
    return {
        "models": [{"name": MODEL, "max_model_len": 40960}],
        "endpoints": [{"address": H100, "models": [MODEL], "labels": {"gpu": "h100"}}, {"address": A100, "models": [MODEL], "labels": {"gpu": "a100"}}],
        "admission": {"kv": {"enabled": True}},
    }


def _headers(content_type: bytes) -> pb.ProcessingRequest:
    hdrs = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"), base_pb2.HeaderValue(key="content-type", raw_value=content_type)]
    )
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=hdrs))


async def _route(stub, **extra):
    """Open a stream and route one chat request; returns (call, chosen endpoint address)."""
    call = stub.Process()
    await call.write(headers_msg("POST", "/v1/chat/completions"))
    await call.read()
    await call.write(body_msg(chat_body(**extra)))
    chosen = set_headers((await call.read()).request_body.response)["x-gateway-destination-endpoint"]
    return call, chosen


async def _answer(stub, completion_tokens: int) -> None:
    """One request answered with a non-streamed body reporting `completion_tokens` (a
    non-streamed answer does not teach the prefill speed)."""
    call, _ = await _route(stub)
    await call.write(_headers(b"application/json"))
    await call.read()
    usage = {"prompt_tokens": 10, "completion_tokens": completion_tokens, "total_tokens": 10 + completion_tokens}
    answer = orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}], "usage": usage})
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True)))
    await call.read()
    await call.done_writing()
    await call.read()


async def _abort(stub, completion_tokens: int) -> None:
    """One streamed request whose stream is cut (a client abort) after an event that reports
    `completion_tokens` so far (vLLM's continuous usage): it has a token count, but not the
    response's length."""
    call, _ = await _route(stub, stream=True)
    await call.write(_headers(b"text/event-stream"))
    await call.read()
    usage = {"prompt_tokens": 10, "completion_tokens": completion_tokens, "total_tokens": 10 + completion_tokens}
    event = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "Hi"}}], "usage": usage}) + b"\n\n"
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=event)))
    await call.read()
    call.cancel()


async def test_only_completed_responses_teach_the_estimate_and_the_gauge(make_app):
    app = await make_app(**_config())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        await _teach(app, pb_grpc.ExternalProcessorStub(channel))


async def _teach(app, stub) -> None:
    est = app.pipeline.output_estimates
    for _ in range(30):
        await _abort(stub, 3)  # stopped early: would bias it low
    await wait_until(lambda: app.store.open_reservations == 0)
    assert est.summary()[MODEL]["completions_seen"] == 0
    for i in range(25):
        await _answer(stub, 190 + i)
    await wait_until(lambda: app.store.open_reservations == 0)
    assert est.summary()[MODEL]["completions_seen"] == 25
    assert est.cap(MODEL) == 213  # p95 of 190..214: the 24th of 25
    gauge = app.metrics.registry.get_sample_value("llm_extproc_output_tokens_estimate", {"model": MODEL})
    assert gauge == 213
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{app.admin_port}/api/v1/endpoints") as resp:
        shown = (await resp.json())["output_estimates"][MODEL]
    assert (shown["estimate_tokens"], shown["samples"], shown["quantile"]) == (213, 25, 0.95)


async def test_a_huge_max_tokens_is_priced_on_the_learned_length_but_reserved_in_full(make_app):
    """A busy H100 (≈ 40k prefill tokens queued, ~0.9 s) against an idle A100: on a request's
    max_tokens of 32768 the A100's slower decode step (10.5 against 6.4 ms) costs 0.25 × 32768 ×
    4.1 ms = 34 s more and the H100 wins whatever its queue; once 50 completions of ~200 tokens
    are learned, the same request's decode is priced on ~200 tokens (0.2 s) and the idle A100
    wins. The KV reservation stays sized for 32768 output tokens."""
    app = await make_app(**_config())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        chosen, blocks_before, context_before = await _route_huge(app, stub)
        assert chosen == H100  # nothing learned: decoded as 32768 tokens
        for i in range(50):
            await _answer(stub, 190 + i % 20)
        await wait_until(lambda: app.store.open_reservations == 0)
        cap = app.pipeline.output_estimates.cap(MODEL)
        assert cap == 208  # p95 of the 50: 190-199 three times each, 200-209 twice
        chosen, blocks_after, context_after = await _route_huge(app, stub)
        assert chosen == A100  # decoded as ~200 tokens: the idle A100 is cheaper
    prompt_tokens = context_before - 32768 // 2
    assert prompt_tokens > 0
    assert context_after == prompt_tokens + cap // 2  # in-flight decode context: capped
    bs = app.config.scheduling.block_size
    assert blocks_before == blocks_after == blocks_for_request(prompt_tokens, 32768, bs)  # KV: max_tokens


async def _route_huge(app, stub) -> tuple[str, int, int]:
    """Route a max_tokens=32768 request while the H100 has 40k prefill tokens queued; returns
    the chosen endpoint and the KV blocks and decode context (tokens) reserved there."""
    held = [app.store.reserve(app.store.get(H100), prompt_tokens=10_000) for _ in range(4)]
    call, chosen = await _route(stub, max_tokens=32768)
    ep = app.store.get(chosen)
    blocks, context = ep.reserved_blocks, ep.context_tokens
    call.cancel()
    for r in held:
        r.release()
    await wait_until(lambda: app.store.open_reservations == 0)
    return chosen, blocks, context


async def test_a_batched_completion_teaches_its_length_per_sequence(make_app):
    """A completion of 4 prompts with n=2 decodes 8 sequences, and its usage sums them: counted
    per choice of one prompt (÷ n alone) it read 400 tokens for 100-token answers."""
    cfg = _config()
    cfg["models"][0]["output_estimate"] = {"min_samples": 1, "window": 10}
    app = await make_app(**cfg)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_msg("POST", "/v1/completions"))
        await call.read()
        await call.write(body_msg(orjson.dumps({"model": MODEL, "prompt": ["one", "two", "three", "four"], "n": 2, "max_tokens": 1000})))
        await call.read()
        await call.write(_headers(b"application/json"))
        await call.read()
        usage = {"prompt_tokens": 8, "completion_tokens": 800, "total_tokens": 808}
        choices = [{"index": i, "text": "x", "finish_reason": "stop"} for i in range(8)]
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=orjson.dumps({"choices": choices, "usage": usage}), end_of_stream=True)))
        await call.read()
        await call.done_writing()
        await call.read()
        await wait_until(lambda: app.store.open_reservations == 0)
    assert app.pipeline.output_estimates.cap(MODEL) == 100
