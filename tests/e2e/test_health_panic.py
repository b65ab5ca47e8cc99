"""Every engine's health probe timing out at once (issue 18.2): under CPU starvation the probes
of a whole fleet time out in the same millisecond while the engines still serve. Below
`panic_threshold` healthy, llm-extproc routes among the live endpoints (those only timing
out), as Envoy's panic mode would, instead of answering every client 503 — and never to an
endpoint that refuses connections."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.stack.envoy import EnvoyProcess
from extproc.stack.ports import free_port
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import MODEL, Engines, chat, start_envoy, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(workdir: Path, engines: Engines) -> AsyncIterator[ExtProcServerProcess]:
    config = {
        "models": [{"name": MODEL, "aliases": ["qwen3-8b"]}],
        # a and b serve; the third refuses connections (down, not slow).
        "endpoints": [{"address": a, "models": [MODEL]} for a in (engines.a.address, engines.b.address, f"127.0.0.1:{free_port()}")],
        "scheduling": {"health_check": {"interval_s": 0.1, "timeout_s": 0.1, "unhealthy_threshold": 1, "timeout_threshold": 2}},
    }
    proc = await start_server(workdir, config, "panic-server")
    try:
        yield proc
    finally:
        await proc.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(workdir: Path, server: ExtProcServerProcess, engines: Engines) -> AsyncIterator[EnvoyProcess]:
    # Fail-closed: every answer below is llm-extproc's decision, never Envoy's fallback.
    envoy = await start_envoy("fail-closed", workdir=workdir, server=server, engines=engines)
    try:
        yield envoy
    finally:
        await envoy.aclose()


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


async def _endpoints(c: httpx.AsyncClient, server: ExtProcServerProcess) -> dict[str, bool]:
    r = await c.get(f"{server.admin_url}/api/v1/endpoints")
    return {e["address"]: e["healthy"] for e in r.json()["endpoints"]}


async def test_all_probes_timing_out_still_routes_to_the_live_engines(server, gateway, engines):
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=30) as c:
        assert (await c.post("/v1/chat/completions", json=chat(max_tokens=4))).status_code == 200
        for e in engines.serving:
            e.health_delay_s = 0.5  # five times the probe timeout: every probe times out
        try:
            for _ in range(100):
                if not any((await _endpoints(c, server)).values()):
                    break
                await asyncio.sleep(0.05)
            assert not any((await _endpoints(c, server)).values()), "probes never failed"
            answers = [await c.post("/v1/chat/completions", json=chat(max_tokens=4)) for _ in range(20)]
            assert [r.status_code for r in answers] == [200] * 20, answers[-1].text
            assert {r.headers["x-backend"] for r in answers} == {"a", "b"}  # never the refusing one
            metrics = (await c.get(f"{server.admin_url}/metrics")).text
            assert _gauge(metrics, "llm_extproc_health_panic") == 1.0
            assert _gauge(metrics, "llm_extproc_health_panic_entered_total") >= 1.0
            assert "health panic: fewer than 50 %" in server.process.log_tail(20_000)
        finally:
            for e in engines.serving:
                e.health_delay_s = 0.0
        for _ in range(100):
            if sum((await _endpoints(c, server)).values()) == 2:
                break
            await asyncio.sleep(0.05)
        assert (await c.post("/v1/chat/completions", json=chat(max_tokens=4))).status_code == 200
        assert _gauge((await c.get(f"{server.admin_url}/metrics")).text, "llm_extproc_health_panic") == 0.0
