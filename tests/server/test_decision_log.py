"""The decision log through the real servicer: one line per decided generation request — routed
(with the endpoint, the predicted and the observed TTFT, the engine's status) or refused (our
status and reason, the prompt's count when it was counted), with its request id and prefix
match — and never the prompt's text, another header or a credential."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.server.conftest import ENDPOINTS, MODEL
from tests.server.test_contract import body_msg, exchange, headers_msg, set_headers

SECRET = "sk-live-7f3a9c-do-not-log"
LIMITS = {"max_body_bytes": 262144, "grpc_max_message_bytes": 524288, "shutdown_grace_s": 1}


def sse_headers() -> pb.ProcessingRequest:
    hdrs = [
        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
    ]
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hdrs)))


async def test_one_line_per_decided_request_and_no_content(make_app, qwen_counter, tmp_path: Path):
    path = tmp_path / "decisions.jsonl"
    models = [{"name": MODEL, "aliases": ["qwen3-8b"], "max_model_len": 4096, "truncation": {"mode": "head-tail"}}]
    app = await make_app(limits=LIMITS, models=models, decision_log={"path": str(path)})
    secret_headers = {"authorization": f"Bearer {SECRET}".encode(), "x-request-id": b"req-7f3a"}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        # 1. Routed and streamed: the observer sees its first token.
        msgs = [{"role": "user", "content": f"My key is {SECRET}, keep it safe."}]
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra=secret_headers))
        await call.read()
        await call.write(body_msg(orjson.dumps({"model": "qwen3-8b", "messages": msgs, "stream": True, "max_tokens": 32})))
        await call.read()
        await call.write(sse_headers())
        await call.read()
        await asyncio.sleep(0.01)
        token = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=token)))
        await call.read()
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        # 2. Refused as too long once cut cannot help (the system message alone is too long).
        too_long = [{"role": "system", "content": f"{SECRET} " * 1500}, {"role": "user", "content": SECRET}]
        body = orjson.dumps({"model": MODEL, "messages": too_long})
        await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
        # 3. Refused before counting: not JSON.
        await exchange(stub, headers_msg("POST", "/v1/completions"), body_msg(f'{{"prompt": "{SECRET}"'.encode()))
        # 4. Truncated: many turns.
        turns = [{"role": r, "content": f"{SECRET} " + "words " * 200} for _ in range(15) for r in ("user", "assistant")]
        body = orjson.dumps({"model": MODEL, "messages": [*turns, msgs[0]]})
        _, r_body = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
        cut_tokens = int(set_headers(r_body.request_body.response)["x-llm-prompt-tokens"])
        given_id = set_headers(r_body.request_body.response)["x-request-id"]  # none sent: ours
        # 5. Not a generation request: not a decision, no line.
        await exchange(stub, headers_msg("GET", "/v1/models", end=True))
    await app.aclose(grace_s=0)  # flushes the log
    raw = path.read_bytes()
    assert SECRET.encode() not in raw and b"Bearer" not in raw and b"keep it safe" not in raw
    routed, refused_long, refused_json, truncated = [orjson.loads(line) for line in raw.splitlines()]

    assert routed["outcome"] == "routed" and routed["status"] == 200 and routed["model"] == MODEL and routed["kind"] == "chat"
    assert routed["prompt_tokens"] == qwen_counter.count_chat(msgs).count and routed["output_budget"] == 32
    assert routed["endpoint"] in ENDPOINTS and routed["tenant"] is None and routed["truncation"] is None
    assert routed["predicted_ttft_ms"] > 0 and routed["observed_ttft_ms"] >= 10 and routed["decision_ms"] > 0
    # The client's x-request-id matches its line; the prefix match on the chosen endpoint (a
    # first request: nothing cached yet).
    assert routed["request_id"] == "req-7f3a" and (routed["prefix_blocks"], routed["prefix_tokens"]) == (0, 0)

    assert (refused_long["outcome"], refused_long["status"]) == ("rejected", 400)
    assert refused_long["reason"] == "context_length_exceeded"
    assert refused_long["prompt_tokens"] > 4096 and refused_long["model"] == MODEL and refused_long["endpoint"] is None

    assert (refused_json["outcome"], refused_json["reason"], refused_json["kind"]) == ("rejected", "invalid_json", "completion")
    assert refused_json["prompt_tokens"] is None and refused_json["model"] is None
    assert refused_json["request_id"] is None and refused_json["prefix_blocks"] is None

    assert truncated["prompt_tokens"] == cut_tokens and truncated["truncation"]["tokens_after"] == cut_tokens
    assert truncated["truncation"]["cut"] == "messages" and truncated["status"] is None  # no response seen
    assert truncated["request_id"] == given_id and len(given_id) == 32
