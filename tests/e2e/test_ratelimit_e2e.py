"""Rate limits end to end: a real Envoy (envoy/fail-open.yaml) in front of the real
`llm-extproc serve`: 429 with retry-after and OpenAI's six headers reach the client, admitted
responses carry them, reservations settle to real usage; two server processes sharing a real
redis-server enforce one limit; no bearer token in any log line or metric label."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.stack.envoy import EnvoyProcess
from extproc.stack.redis import RedisProcess, redis_server_binary
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import MODEL, Engines, assert_openai_error, chat, start_envoy
from tests.server.test_contract import body_msg, chat_body, headers_msg

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

KEY = "sk-e2e-ratelimit-secret-0123456789"
RPM_KEY = "sk-e2e-rpm-secret-9876543210"
CAP_KEY = "sk-e2e-cap-secret-5555555555"
RATE_HEADERS = {f"x-ratelimit-{a}-{b}" for a in ("limit", "remaining", "reset") for b in ("tokens", "requests")}


def _server_config(engines: Engines, ratelimit: dict) -> dict:
    return {
        "models": [{"name": MODEL, "aliases": ["qwen3-8b"], "max_model_len": 8192}],
        "endpoints": [{"address": e.address, "models": [MODEL]} for e in engines.serving],
        "scheduling": {"health_check": {"interval_s": 0.25, "timeout_s": 2.0, "unhealthy_threshold": 3}},
        "telemetry": {"sample_rate": 0.01},  # limited tenants are observed whatever the sample
        "ratelimit": {"enabled": True, **ratelimit},
    }


async def _start_server(workdir: Path, name: str, config: dict) -> ExtProcServerProcess:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    server = ExtProcServerProcess(path, workdir=workdir, name=name, log_level="debug")
    await server.start()
    return server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rl_server(workdir: Path, engines: Engines) -> AsyncIterator[ExtProcServerProcess]:
    rl = {
        "unknown_api_keys": "per_key",  # KEY: a tenant of its own, known by its hash
        "default": {"tokens_per_minute": 4000, "requests_per_minute": 1000},
        "tenants": {
            "rpm": {"api_key_sha256": [hashlib.sha256(RPM_KEY.encode()).hexdigest()], "requests_per_minute": 2},
            "capped": {"api_key_sha256": [hashlib.sha256(CAP_KEY.encode()).hexdigest()], "max_concurrent_requests": 1},
        },
    }
    server = await _start_server(workdir, "llm-extproc-rl", _server_config(engines, rl))
    try:
        yield server
    finally:
        await server.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rl_gateway(workdir: Path, rl_server: ExtProcServerProcess, engines: Engines) -> AsyncIterator[EnvoyProcess]:
    envoy = await start_envoy("fail-open", workdir=workdir, server=rl_server, engines=engines)
    try:
        yield envoy
    finally:
        await envoy.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def gw(rl_gateway: EnvoyProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=rl_gateway.url, trust_env=False, timeout=60) as c:
        yield c


async def _window(server: ExtProcServerProcess, label: str) -> dict:
    async with httpx.AsyncClient(trust_env=False) as c:
        rows = (await c.get(f"{server.admin_url}/api/v1/tenants")).json()["tenants"]
    (row,) = [r for r in rows if r["tenant"] == label]
    return row["windows"][0]


async def test_admitted_responses_carry_the_headers_and_settle_to_usage(gw: httpx.AsyncClient, rl_server) -> None:
    label = f"key-{hashlib.sha256(KEY.encode()).hexdigest()[:8]}"
    r = await gw.post("/v1/chat/completions", json=chat(max_tokens=1000), headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert RATE_HEADERS <= set(r.headers)
    assert r.headers["x-ratelimit-limit-tokens"] == "4000"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < 4000 - 1000  # the reservation: prompt + 1000
    assert r.headers["x-ratelimit-reset-tokens"].endswith("s")
    # The engine's usage said 12 tokens: the reservation became 12.
    for _ in range(100):
        if (await _window(rl_server, label))["tokens"] == 12:
            break
        await asyncio.sleep(0.02)
    assert (await _window(rl_server, label))["tokens"] == 12
    # A stream whose client asked for no usage: prompt + its 40 content events.
    r = await gw.post("/v1/chat/completions", json=chat(stream=True, max_tokens=1000), headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and RATE_HEADERS <= set(r.headers)
    for _ in range(100):
        w = await _window(rl_server, label)
        if w["tokens"] < 500:
            break
        await asyncio.sleep(0.02)
    assert 12 + 40 < w["tokens"] < 12 + 40 + 50, w  # + its prompt tokens


async def test_over_the_limit_the_client_gets_a_429_with_the_headers(gw: httpx.AsyncClient) -> None:
    auth = {"authorization": f"Bearer {RPM_KEY}"}
    for _ in range(2):
        assert (await gw.post("/v1/chat/completions", json=chat(), headers=auth)).status_code == 200
    r = await gw.post("/v1/chat/completions", json=chat(), headers=auth)
    err = assert_openai_error(r, 429)
    assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded" and "tenant rpm" in err["message"]
    # This tenant has a request limit only: the three request headers, no token ones.
    assert {h for h in r.headers if h.startswith("x-ratelimit-")} == {h for h in RATE_HEADERS if h.endswith("requests")}
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")


async def _admitted_again(gw: httpx.AsyncClient, auth: dict[str, str]) -> httpx.Response:
    """The next request once the held one's slot is back (settled in its ext_proc stream's end)."""
    for _ in range(100):
        r = await gw.post("/v1/chat/completions", json=chat(), headers=auth)
        if r.status_code != 429:
            return r
        await asyncio.sleep(0.02)
    return r


async def test_a_tenant_at_its_concurrency_cap_gets_a_429_until_its_request_ends(gw: httpx.AsyncClient, engines: Engines) -> None:
    auth = {"authorization": f"Bearer {CAP_KEY}"}
    gate = asyncio.Event()
    for e in engines.serving:
        e.stream_gate = gate
    try:
        async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=auth) as held:
            assert held.status_code == 200  # in flight: its first chunk sent, the rest held
            r = await gw.post("/v1/chat/completions", json=chat(), headers=auth)
            err = assert_openai_error(r, 429)
            assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded"
            assert "tenant capped on requests in flight: Limit 1, In flight 1" in err["message"]
            assert int(r.headers["retry-after"]) >= 1
            gate.set()
            async for _ in held.aiter_bytes():
                pass
        assert (await _admitted_again(gw, auth)).status_code == 200  # ended: the slot is back
        # A client that goes away mid-stream releases its slot too.
        gate.clear()
        async with gw.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=auth) as held:
            assert held.status_code == 200
            assert (await gw.post("/v1/chat/completions", json=chat(), headers=auth)).status_code == 429
        # left unread: the connection closes, Envoy resets the stream
        assert (await _admitted_again(gw, auth)).status_code == 200
    finally:
        for e in engines.serving:
            e.stream_gate = None
        gate.set()


async def test_a_request_larger_than_the_limit_is_a_400(gw: httpx.AsyncClient) -> None:
    r = await gw.post("/v1/chat/completions", json=chat(max_tokens=5000), headers={"x-api-key": KEY})
    err = assert_openai_error(r, 400)
    assert err["code"] == "request_exceeds_rate_limit" and "4000 tokens per minute" in err["message"]


async def test_a_client_tenant_header_is_stripped(gw: httpx.AsyncClient, engines: Engines) -> None:
    engines.clear()
    r = await gw.post("/v1/chat/completions", json=chat(), headers={"x-llm-tenant": "rpm", "x-api-key": KEY})
    assert r.status_code == 200
    (got,) = [x for e in engines.serving for x in e.received]
    assert got.header("x-llm-tenant") is None


async def test_no_bearer_token_in_any_log_line_or_metric(gw: httpx.AsyncClient, rl_server, rl_gateway, workdir: Path) -> None:
    await gw.post("/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {KEY}"})
    async with httpx.AsyncClient(trust_env=False) as c:
        metrics = (await c.get(f"{rl_server.admin_url}/metrics")).text
    assert "llm_extproc_ratelimit_tokens_charged_total" in metrics
    logs = [p.read_text(errors="replace") for p in workdir.glob("*.log")]
    assert logs and any("ratelimit" in t or "ext_proc" in t for t in logs)
    for text in [metrics, *logs]:
        assert KEY not in text and RPM_KEY not in text


async def _held_streams(channels: list[grpc.aio.Channel], n: int, max_tokens: int) -> tuple[list[str], list]:
    """`n` chats with KEY over the channels in turn, each held open after its decision (an
    admitted one keeps its charge and slot): each one's answer kind, and the calls to cancel."""
    calls = []

    async def one(i: int) -> str:
        call = pb_grpc.ExternalProcessorStub(channels[i % len(channels)]).Process()
        calls.append(call)
        await call.write(headers_msg("POST", "/v1/chat/completions", extra={"authorization": f"Bearer {KEY}".encode()}))
        first = (await call.read()).WhichOneof("response")
        if first == "immediate_response":
            return first  # refused at its headers (a tenant refused just before)
        await call.write(body_msg(chat_body(max_tokens=max_tokens)))
        return (await call.read()).WhichOneof("response")

    kinds = await asyncio.gather(*(one(i) for i in range(n)))
    return list(kinds), calls


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed (apt-get install -y redis-server)")
async def test_two_servers_sharing_redis_enforce_one_limit(workdir: Path, engines: Engines) -> None:
    redis = RedisProcess(workdir=workdir / "redis")
    await redis.start()
    servers: list[ExtProcServerProcess] = []
    try:
        rl = {"backend": "redis", "unknown_api_keys": "per_key", "default": {"tokens_per_minute": 1000}, "redis": {"url": redis.url, "timeout_ms": 500}}
        for name in ("llm-extproc-r1", "llm-extproc-r2"):
            servers.append(await _start_server(workdir, name, _server_config(engines, rl)))
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") for s in servers]
        kinds, calls = await _held_streams(channels, 30, max_tokens=90)
        label = f"key-{hashlib.sha256(KEY.encode()).hexdigest()[:8]}"
        used = [(await _window(s, label))["tokens"] for s in servers]
        for call in calls:
            call.cancel()
        for ch in channels:
            await ch.close()
        admitted = kinds.count("request_body")
        assert used[0] == used[1], "both replicas read one window"
        cost = used[0] // admitted
        assert cost > 90 and used[0] <= 1000 and admitted == 1000 // cost
        assert kinds.count("immediate_response") == 30 - admitted
    finally:
        for s in servers:
            await s.aclose()
        await redis.stop()


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed (apt-get install -y redis-server)")
async def test_two_servers_sharing_redis_enforce_one_concurrency_cap_and_release_it(workdir: Path, engines: Engines) -> None:
    redis = RedisProcess(workdir=workdir / "redis-cc")
    await redis.start()
    servers: list[ExtProcServerProcess] = []
    try:
        rl = {"backend": "redis", "default": {"max_concurrent_requests": 3}, "redis": {"url": redis.url, "timeout_ms": 500}}
        for name in ("llm-extproc-cc1", "llm-extproc-cc2"):
            servers.append(await _start_server(workdir, name, _server_config(engines, rl)))
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}") for s in servers]
        kinds, calls = await _held_streams(channels, 20, max_tokens=20)
        assert kinds.count("request_body") == 3 and kinds.count("immediate_response") == 17, kinds
        assert [(await _window(s, "unknown-keys"))["inflight"] for s in servers] == [3, 3], "both replicas read one set"
        for call in calls:
            call.cancel()  # every client goes away: each replica releases what it admitted
        for _ in range(200):
            if (await _window(servers[0], "unknown-keys"))["inflight"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await _window(servers[1], "unknown-keys"))["inflight"] == 0
        for ch in channels:
            await ch.close()
    finally:
        for s in servers:
            await s.aclose()
        await redis.stop()
