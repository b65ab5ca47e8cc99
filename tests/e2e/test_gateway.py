"""Through a real Envoy (envoy/fail-open.yaml) and the real `llm-extproc serve`, to two recording
engines: what the client sends, what the picked engine receives, what comes back."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import orjson
import pytest
from httpx_sse import EventSource
from prometheus_client.parser import text_string_to_metric_families

from extproc.config.schema import LimitsConfig
from extproc.errors import InvalidJSONError, NotFoundError, PayloadTooLargeError
from extproc.pipeline.tokens import TokenCounter
from extproc.stack.envoy import EnvoyProcess
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import ALIAS, DEAD_MODEL, MODEL, Engines, assert_openai_error, chat
from tests.e2e.fake_engines import JSON_BODY, SSE_BODY, Backend

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

# Routing headers a client might try to set; none of its values may survive.
FORGED = {
    "x-llm-prompt-tokens": "1",
    "x-llm-tier": "forged",
    "x-llm-route-debug": "forged",
}


def _only_request(engines: Engines, answered_by: str | None) -> tuple[Backend, bytes]:
    """The one engine that got a request (the one that answered) and its recorded request."""
    got = [e for e in (engines.a, engines.b, engines.intruder) if e.received]
    assert [e.name for e in got] == [answered_by]
    (rec,) = got[0].received
    return got[0], rec


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat("Say hi to the picked engine.")),
        ("/v1/completions", {"model": ALIAS, "prompt": "Say hi to the picked engine."}),
        ("/v1/chat/completions", {**chat("Say hi to the picked engine.", temperature=0.25), "model": MODEL}),
    ],
    ids=["chat-by-alias", "completions-by-alias", "chat-by-served-name"],
)
async def test_picked_engine_gets_the_request_and_its_prompt_tokens(
    client: httpx.AsyncClient, engines: Engines, qwen_counter: TokenCounter, path: str, body: dict
) -> None:
    # The client names the intruder as destination and forges every routing header.
    headers = {"x-gateway-destination-endpoint": engines.intruder.address, **FORGED}
    sent = orjson.dumps(body)
    r = await client.post(path, content=sent, headers={**headers, "content-type": "application/json"})
    assert r.status_code == 200, r.text
    engine, rec = _only_request(engines, r.headers["x-backend"])
    assert engine in engines.serving
    assert rec.path == path
    # Byte for byte, except that an alias reaches the engine as the model's served name.
    assert rec.body == (sent if body["model"] == MODEL else orjson.dumps({**body, "model": MODEL}))
    assert rec.header("content-length") == str(len(rec.body)).encode()
    # llm-extproc's decision, not the client's, names the engine that got it.
    assert rec.header("x-gateway-destination-endpoint") == engine.address.encode()
    assert r.headers["x-llm-endpoint"] == engine.address  # Envoy reports the upstream it used
    if path == "/v1/chat/completions":
        expected = qwen_counter.count_chat(body["messages"]).count
    else:
        expected = qwen_counter.count_text(body["prompt"]).count
    assert rec.header("x-llm-prompt-tokens") == str(expected).encode()
    for name, value in FORGED.items():
        assert rec.header(name) != value.encode(), name


async def test_forged_destination_never_reaches_the_third_server(client: httpx.AsyncClient, engines: Engines) -> None:
    forged = {"x-gateway-destination-endpoint": engines.intruder.address}
    for i in range(6):
        assert (await client.post("/v1/chat/completions", json=chat(f"try {i}"), headers=forged)).status_code == 200
    # Requests without a body are routed in the headers phase: same rule.
    assert (await client.get("/v1/models", headers=forged)).status_code == 200
    assert engines.intruder.received == []
    assert sum(len(e.received) for e in engines.serving) == 7


async def test_non_streaming_json_arrives_byte_for_byte(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.content == JSON_BODY


async def test_sse_stream_arrives_intact(client: httpx.AsyncClient, engines: Engines) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        raw = b"".join([chunk async for chunk in r.aiter_raw()])
    assert raw == SSE_BODY
    # And it parses as the engine's 40 events plus [DONE].
    async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
        data = [sse.data async for sse in EventSource(r).aiter_sse()]
    assert len(data) == 41 and data[-1] == "[DONE]"
    assert orjson.loads(data[7])["choices"][0]["delta"]["content"] == "tok7 "


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        (b'{"model": "qwen3-8b", "messages": [', 400, InvalidJSONError.code, None),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', 400, None, "model"),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', 404, NotFoundError.code, "model"),
    ],
    ids=["invalid-json", "missing-model", "unknown-model"],
)
async def test_bad_requests_get_json_errors_through_envoy(
    client: httpx.AsyncClient, engines: Engines, body: bytes, status: int, code: str | None, param: str | None
) -> None:
    r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(r, status)
    assert error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert not any(e.received for e in (engines.a, engines.b, engines.intruder))


@pytest.mark.parametrize("path", ["/v1/chat/%63ompletions", "/v1//chat/completions", "/v1/models/../chat/completions"])
async def test_disguised_paths_do_not_skip_admission(client: httpx.AsyncClient, engines: Engines, path: str) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}
    error = assert_openai_error(await client.post(path, json=body), 404)
    assert error["code"] == NotFoundError.code
    assert not any(e.received for e in (engines.a, engines.b, engines.intruder))


async def test_envoys_own_protocol_errors_are_json(gateway: EnvoyProcess) -> None:
    host, port = gateway.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"426" and b"application/json" in head.lower()
    assert set(orjson.loads(body)["error"]) == {"message", "type", "param", "code"}


async def test_the_servers_own_503_passes_unchanged(client: httpx.AsyncClient) -> None:
    """Envoy's local-reply rewriting touches only Envoy's own replies, not llm-extproc's."""
    deadline = time.monotonic() + 10
    while True:  # until the server's health checks have marked the dead endpoint down
        r = await client.post("/v1/chat/completions", json={**chat(), "model": DEAD_MODEL})
        error = assert_openai_error(r, 503)
        if error["code"] == "no_healthy_endpoint" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    assert error["code"] == "no_healthy_endpoint"
    assert DEAD_MODEL in error["message"]


def _padded(size: int) -> bytes:
    """A valid chat body of exactly `size` bytes (JSON allows trailing whitespace), naming the
    model by its served name so it reaches the engine unchanged."""
    body = orjson.dumps({**chat("padded"), "model": MODEL})
    assert len(body) <= size
    return body + b" " * (size - len(body))


LIMIT = LimitsConfig().max_body_bytes  # the server runs with the default; so does Envoy's file


@pytest.mark.parametrize("size", [LIMIT - 1, LIMIT + 1], ids=["one-byte-under", "one-byte-over"])
async def test_body_size_limit_edges(client: httpx.AsyncClient, engines: Engines, size: int) -> None:
    r = await client.post("/v1/chat/completions", content=_padded(size), headers={"content-type": "application/json"})
    if size <= LIMIT:
        assert r.status_code == 200, r.text
        _, rec = _only_request(engines, r.headers["x-backend"])
        assert len(rec.body) == size
    else:
        error = assert_openai_error(r, 413)
        assert error["code"] == PayloadTooLargeError.code
        assert not any(e.received for e in (engines.a, engines.b, engines.intruder))


async def test_requests_without_a_body(client: httpx.AsyncClient, engines: Engines) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    engine, rec = _only_request(engines, r.headers["x-backend"])
    assert rec.header("x-gateway-destination-endpoint") == engine.address.encode()
    assert rec.body == b""
    # A generation request needs a body: a JSON 400, nothing upstream.
    engines.clear()
    error = assert_openai_error(await client.post("/v1/chat/completions"), 400)
    assert error["type"] == "invalid_request_error"
    assert not any(e.received for e in (engines.a, engines.b, engines.intruder))


async def test_200_kb_prompt(client: httpx.AsyncClient, engines: Engines, qwen_counter: TokenCounter) -> None:
    # English-like text (~45k tokens, within the 128k context configured for this stack).
    vocab = "the model routes every long prompt to an engine with room in its cache while tokens stream back".split()
    rng = random.Random(2)
    prompt = " ".join(rng.choice(vocab) for _ in range(40_000))[:200_000]
    assert len(prompt) == 200_000
    body = chat(prompt)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    _, rec = _only_request(engines, r.headers["x-backend"])
    assert len(rec.body) > 200_000
    assert rec.header("x-llm-prompt-tokens") == str(qwen_counter.count_chat(body["messages"]).count).encode()


async def test_header_value_with_byte_0xff(client: httpx.AsyncClient, engines: Engines) -> None:
    raw = b"caf\xff\xfe end"  # not UTF-8: Envoy hands it to ext_proc as raw bytes
    r = await client.post("/v1/chat/completions", json=chat(), headers={"x-client-note": raw})
    assert r.status_code == 200, r.text
    _, rec = _only_request(engines, r.headers["x-backend"])
    assert rec.header("x-client-note") == raw


async def test_h2c_prior_knowledge(gateway: EnvoyProcess, engines: Engines) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, http1=False, http2=True, timeout=30) as h2:
        r = await h2.post("/v1/chat/completions", json=chat())
    assert r.http_version == "HTTP/2"
    assert r.status_code == 200
    assert r.content == JSON_BODY


def _inflight(metrics_text: str) -> dict[str, float]:
    return {
        s.labels["endpoint"]: s.value
        for fam in text_string_to_metric_families(metrics_text)
        if fam.name == "llm_extproc_endpoint_inflight_requests"
        for s in fam.samples
    }


async def test_200_parallel_requests_then_inflight_back_to_zero(
    gateway: EnvoyProcess, extproc_server: ExtProcServerProcess, engines: Engines
) -> None:
    engines.clear()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=120, limits=limits) as c:
        replies = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat(f"parallel {i}")) for i in range(200)))
        assert [r.status_code for r in replies] == [200] * 200
        assert sum(len(e.received) for e in engines.serving) == 200
        assert engines.intruder.received == []
        # Streams end just after the responses do: give the server a moment to see every end.
        deadline = time.monotonic() + 10
        while True:
            inflight = _inflight((await c.get(f"{extproc_server.admin_url}/metrics")).text)
            if all(v == 0 for v in inflight.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    assert {e.address for e in engines.serving} <= set(inflight)
    assert inflight and all(v == 0 for v in inflight.values()), inflight
