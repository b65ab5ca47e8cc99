"""Streaming telemetry through a real Envoy onto simulated engines: markers ride as SSE comments
only, JSON bodies pass byte-for-byte, a jittery endpoint comes under backpressure and loses share,
and a backend that dies mid-stream ends the client's stream cleanly with nothing leaked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
import pytest_asyncio
import yaml
from httpx_sse import aconnect_sse
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.fleet import SimProcess
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.ports import free_ports
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import start_beside

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[tuple[EnvoyProcess, ExtProcServerProcess, list[SimProcess]]]:
    workdir = tmp_path_factory.mktemp("telemetry")
    # Simulators in their own processes (see test_aborts.py).
    ports = free_ports(2)
    sims = [SimProcess("h100-qwen3-8b", name=f"sim-{i}", workdir=workdir, speed=1, stream_interval=1, seed=i, port=p) for i, p in enumerate(ports)]
    path = workdir / "llm-extproc.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": MODEL}],
                "endpoints": [{"address": f"127.0.0.1:{p}", "models": [MODEL]} for p in ports],
                # A loaded CI machine answers slowly: do not call an engine dead over one slow probe.
                "scheduling": {"health_check": {"timeout_s": 2.0, "unhealthy_threshold": 3}},
                "telemetry": {"sample_rate": 1.0, "observer": {"markers": True}, "stats": {"min_gap_samples": 8}},
            }
        )
    )
    server = ExtProcServerProcess(path, workdir=workdir)
    await start_beside(server, sims)
    cfg = rewrite_config(load_envoy_config("fail-open"), RunSettings(extproc=server.grpc_address, endpoints=[("127.0.0.1", s.port) for s in sims]))
    envoy = EnvoyProcess(cfg, workdir=workdir)
    await envoy.start()
    try:
        yield envoy, server, sims
    finally:
        await envoy.aclose()
        await server.aclose()
        for s in sims:
            await s.aclose()


def chat(max_tokens: int = 12, stream: bool = True, text: str = "Tell me a story.") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


async def test_markers_are_sse_comments_and_events_are_unchanged(stack):
    envoy, _, _ = stack
    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
        async with c.stream("POST", "/v1/chat/completions", json=chat()) as r:
            assert r.headers["x-sent-at-us"].isdigit()
            assert "content-length" not in r.headers
            raw = b"".join([chunk async for chunk in r.aiter_bytes()])
        comments = [line for line in raw.split(b"\n") if line.startswith(b": x-chunk-id=")]
        assert comments and all(b" x-sent-at-us=" in line and b" x-route-weight=" in line for line in comments)
        # An SSE client library ignores the comments: the events are the engine's, intact.
        async with aconnect_sse(c, "POST", "/v1/chat/completions", json=chat()) as source:
            events = [e.data async for e in source.aiter_sse()]
        assert events[-1] == "[DONE]"
        payloads = [orjson.loads(e) for e in events[:-1]]
        assert all(p["object"] == "chat.completion.chunk" for p in payloads)
        assert sum(1 for p in payloads if p["choices"] and p["choices"][0]["delta"].get("content")) == 12


async def test_json_response_is_byte_for_byte_and_unmarked(stack):
    envoy, _, sims = stack
    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
        via = await c.post("/v1/chat/completions", json=chat(stream=False))
        assert via.status_code == 200 and b"x-chunk-id" not in via.content
        body = orjson.loads(via.content)
        assert body["usage"]["completion_tokens"] == 12
        # The body crossed the server (usage is read from it) without a byte changed; Envoy
        # re-frames a streamed-through body as chunked, so a length header, if any, must match.
        assert via.headers.get("content-length") in (None, str(len(via.content)))
        # (Byte-for-byte against a fixed engine body: tests/e2e/test_gateway.py.)


def _metric(text: str, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


async def test_jittery_endpoint_comes_under_pressure_and_loses_share(stack):
    envoy, server, (a, b) = stack
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        await c.post(f"{a.url}/sim/faults", json={"jitter_ms": 120})
        try:
            async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60) as gw:
                # Warm-up: sequential requests to both, until a's jitter is measured.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    await asyncio.gather(*(gw.post("/v1/chat/completions", json=chat(24, stream=True)) for _ in range(4)))
                    eps = (await c.get(f"{server.admin_url}/api/v1/endpoints")).json()["endpoints"]
                    by = {e["address"]: e for e in eps}
                    if by[f"127.0.0.1:{a.port}"]["stream"]["pressure"] != "none":
                        break
                assert by[f"127.0.0.1:{a.port}"]["stream"]["pressure"] in ("light", "heavy")
                assert by[f"127.0.0.1:{b.port}"]["stream"]["pressure"] == "none"
                # Now a burst of short requests one after the other: most go to the steady endpoint.
                served = []
                for _ in range(10):
                    r = await gw.post("/v1/chat/completions", json=chat(4, stream=False))
                    served.append(r.headers["x-llm-endpoint"])
                assert served.count(f"127.0.0.1:{b.port}") >= 8
            text = (await c.get(f"{server.admin_url}/metrics")).text
            level = _metric(text, "llm_extproc_endpoint_backpressure_level")
            assert level[(("endpoint", f"127.0.0.1:{a.port}"),)] >= 1
        finally:
            await c.delete(f"{a.url}/sim/faults")


async def test_backend_dying_mid_stream_ends_cleanly_and_is_counted(stack):
    envoy, server, sims = stack
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        for s in sims:
            await c.post(f"{s.url}/sim/faults", json={"die_after_chunks": 3})
        try:
            before = _metric((await c.get(f"{server.admin_url}/metrics")).text, "llm_extproc_stream_errors_total")
            async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as gw:
                got = b""
                try:
                    async with gw.stream("POST", "/v1/chat/completions", json=chat(20)) as r:
                        assert r.status_code == 200
                        async for chunk in r.aiter_bytes():
                            got += chunk
                except httpx.RemoteProtocolError:
                    pass  # HTTP/1.1 has no clean way to say "truncated" other than closing
            assert got.count(b"data: {") >= 2 and b"[DONE]" not in got  # what was sent arrived
            deadline = time.monotonic() + 10
            while True:
                text = (await c.get(f"{server.admin_url}/metrics")).text
                after = _metric(text, "llm_extproc_stream_errors_total")
                inflight = _metric(text, "llm_extproc_endpoint_inflight_requests")
                if sum(after.values()) > sum(before.values()) and not any(inflight.values()):
                    break
                assert time.monotonic() < deadline, (after, inflight)
                await asyncio.sleep(0.1)
        finally:
            for s in sims:
                await c.delete(f"{s.url}/sim/faults")
