"""P/D disaggregation end to end: a real Envoy (envoy/fail-open.yaml), `llm-extproc serve`, the
pd-sidecar in front of a decode-role simulator and a prefill-role simulator. A long prompt is
prefilled on the prefill engine and its KV pulled by the decode engine; a short one is decoded
where it lands; a client's forged `x-prefiller-host-port` reaches no engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from aiohttp import web

from extproc.pd.sidecar import PDSidecar, static_prefillers
from extproc.server.responses import PREFILLER_HEADER
from extproc.sim.server import SimServer
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import MODEL, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

def long(tag: str) -> str:
    """~1,800 tokens (above the 256-token threshold), sharing no prefix with another tag's."""
    return " ".join(f"{tag}{i}" for i in range(900))


class Stack:
    prefill: SimServer
    decode: SimServer
    sidecar: PDSidecar
    server: ExtProcServerProcess
    envoy: EnvoyProcess
    canary_hits: list[str]
    canary_port: int


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(workdir: Path, qwen_counter) -> AsyncIterator[Stack]:
    s = Stack()
    s.canary_hits = []

    async def canary(request: web.Request) -> web.Response:
        s.canary_hits.append(request.path)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", canary)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    s.canary_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s.prefill = SimServer(tokenizer=qwen_counter, speed=20.0, role="prefill")
    s.decode = SimServer(tokenizer=qwen_counter, speed=20.0, role="decode")
    await s.prefill.start()
    await s.decode.start()
    prefill_addr = f"127.0.0.1:{s.prefill.port}"
    s.sidecar = PDSidecar(s.decode.url, static_prefillers([prefill_addr]))
    await s.sidecar.start()
    config = {
        "models": [{"name": MODEL}],
        "endpoints": [
            {"address": prefill_addr, "models": [MODEL], "role": "prefill"},
            {"address": f"127.0.0.1:{s.sidecar.port}", "models": [MODEL], "labels": {"llm-d.ai/role": "decode"}},
        ],
        "scheduling": {"explain_header": True},
        "telemetry": {"sample_rate": 1.0},
    }
    s.server = await start_server(workdir, config, "pd-router")
    cfg = rewrite_config(load_envoy_config("fail-open"), RunSettings(extproc=s.server.grpc_address, endpoints=[("127.0.0.1", s.sidecar.port)]))
    s.envoy = EnvoyProcess(cfg, workdir=workdir, name="pd")
    await s.envoy.start()
    try:
        yield s
    finally:
        await s.envoy.aclose()
        await s.server.aclose()
        await s.sidecar.aclose()
        await s.decode.aclose()
        await s.prefill.aclose()
        await runner.cleanup()


async def served(c: httpx.AsyncClient, sim: SimServer) -> float:
    text = (await c.get(f"{sim.url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total{"))


async def decisions(c: httpx.AsyncClient, server: ExtProcServerProcess) -> dict[str, float]:
    text = (await c.get(f"{server.admin_url}/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("llm_extproc_disagg_decision_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len("llm_extproc_disagg_decision_total"):]] = float(value)
    return out


async def released(c: httpx.AsyncClient, server: ExtProcServerProcess) -> None:
    for _ in range(100):
        eps = (await c.get(f"{server.admin_url}/api/v1/endpoints")).json()["endpoints"]
        if all(e["inflight"] == 0 and e["reserved_kv_blocks"] == 0 for e in eps):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"reservations left: {eps}")


async def test_a_long_prompt_is_disaggregated_and_a_short_one_is_not(stack: Stack):
    async with httpx.AsyncClient(base_url=stack.envoy.url, trust_env=False, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long("first")}], "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        debug = r.headers["x-llm-route-debug"]
        assert "pd=prefill-decode/long_prompt" in debug and f"prefill: chose 127.0.0.1:{stack.prefill.port}" in debug
        assert await served(c, stack.prefill) == 1 and stack.sidecar.counts["disaggregated"] == 1
        assert (await c.get(f"{stack.decode.url}/metrics")).text.count("vllm:nixl_bytes_transferred_count") == 1
        assert (await c.get(f"{stack.prefill.url}/sim/state")).json()["kv_holds"] == 0  # pulled
        # Streamed: the decode engine's first token ends the prefill side's reservation.
        body = {"model": MODEL, "messages": [{"role": "user", "content": long("second")}], "max_tokens": 8, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            text = "".join([chunk async for chunk in resp.aiter_text()])
        assert text.rstrip().endswith("data: [DONE]") and await served(c, stack.prefill) == 2

        short = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert short.status_code == 200 and "pd=decode-only/short_prompt" in short.headers["x-llm-route-debug"]
        assert await served(c, stack.prefill) == 2 and await served(c, stack.decode) == 3
        assert stack.sidecar.counts["passthrough"] >= 1
        counts = await decisions(c, stack.server)
        assert counts['{decision="prefill-decode",reason="long_prompt"}'] == 2
        assert counts['{decision="decode-only",reason="short_prompt"}'] == 1
        await released(c, stack.server)
        roles = {e["address"]: e["role"] for e in (await c.get(f"{stack.server.admin_url}/api/v1/endpoints")).json()["endpoints"]}
        assert sorted(roles.values()) == ["decode", "prefill"]


async def test_a_forged_prefiller_header_reaches_no_engine(stack: Stack):
    async with httpx.AsyncClient(base_url=stack.envoy.url, trust_env=False, timeout=60) as c:
        before_p, before_d = await served(c, stack.prefill), await served(c, stack.decode)
        for forged in (f"127.0.0.1:{stack.canary_port}", f"127.0.0.1:{stack.prefill.port}"):
            r = await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "short and forged"}], "max_tokens": 2},
                headers={PREFILLER_HEADER: forged},
            )
            assert r.status_code == 200, r.text
        # Envoy stripped the header and the router set none for a short prompt: the sidecar
        # passed both through, nothing went to the canary or the prefill engine.
        assert stack.canary_hits == [] and await served(c, stack.prefill) == before_p
        assert await served(c, stack.decode) == before_d + 2 and stack.sidecar.counts["forbidden"] == 0
        # A forged header on a long prompt is replaced by the router's own pick.
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": long("forged")}], "max_tokens": 2},
            headers={PREFILLER_HEADER: f"127.0.0.1:{stack.canary_port}"},
        )
        assert r.status_code == 200 and stack.canary_hits == [] and await served(c, stack.prefill) == before_p + 1
        # The same long prompt again: now cached on the decode endpoint (it pulled the KV), so
        # its uncached tokens there fall under the threshold and it is not disaggregated.
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long("forged") + " more"}], "max_tokens": 2})
        assert "pd=decode-only/short_prompt" in r.headers["x-llm-route-debug"] and await served(c, stack.prefill) == before_p + 1
        await released(c, stack.server)


async def test_a_dead_prefill_engine_is_ejected_and_the_decode_engine_is_not(stack: Stack):
    # The prefill engine dies (the last test: it stays down): the sidecar answers 502 (never a silent
    # recompute) with the header that tells the router whose failure it is; outlier detection
    # (or the health probes) take the prefill endpoint out, and long prompts are then prefilled
    # on the decode engine. Every request is answered; the decode endpoint is never ejected.
    await stack.prefill.aclose()
    async with httpx.AsyncClient(base_url=stack.envoy.url, trust_env=False, timeout=60) as c:
        statuses, last = [], None
        for i in range(12):
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": long(f"dead{i}x")}], "max_tokens": 2})
            statuses.append(r.status_code)
            if r.status_code == 200:
                last = r
                break
        assert last is not None and set(statuses[:-1]) <= {502}, statuses
        assert "pd=decode-only/no_prefill_endpoint" in last.headers["x-llm-route-debug"]
        eps = {e["role"]: e for e in (await c.get(f"{stack.server.admin_url}/api/v1/endpoints")).json()["endpoints"]}
        assert eps["decode"]["ejections"] == 0 and eps["decode"]["consecutive_5xx"] == 0
        assert eps["prefill"]["ejections"] >= 1 or not eps["prefill"]["healthy"]
        await released(c, stack.server)
