"""Flow control end to end: a real Envoy (fail-closed, its ext_proc message_timeout raised as
`envoy-config` raises it) in front of llm-extproc and two simulators that refuse work beyond
their batch and a short queue (`max_num_seqs` 2, `max_waiting` 2: vLLM's answer to overload, a
429). A burst of 3× what the fleet can hold is refused in part without flow control; with it
(a cap of 2 in flight per endpoint: the engines' batch, the queue left as margin for a release
seen here before the engine frees its slot), every request is held at the gateway and served,
and the ones that waited say how long. Displacement evicts a streaming sheddable request for a
critical one through an ImmediateResponse on a response chunk, which Envoy honours mid-stream."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.sim.server import SimServer
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from tests.e2e.e2e_helpers import in_process_sims, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"
BURST = 24  # the fleet holds 2 × (2 running + 2 waiting) = 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sims(qwen_counter) -> AsyncIterator[list[SimServer]]:
    async with in_process_sims(qwen_counter, 2, speed=4.0, max_num_seqs=2, max_waiting=2) as started:
        yield started


def _config(sims: list[SimServer], flow: dict | None) -> dict:
    cfg = {
        "models": [{"name": MODEL}],
        "endpoints": [{"address": f"127.0.0.1:{s.port}", "models": [MODEL]} for s in sims],
        "scheduling": {"metrics": {"interval_s": 0.1}},
    }
    if flow is not None:
        cfg["flow_control"] = flow
    return cfg


async def _burst(workdir: Path, sims: list[SimServer], name: str, flow: dict | None) -> list[httpx.Response]:
    server = await start_server(workdir, _config(sims, flow), name)
    envoy = None
    try:
        settings = RunSettings(extproc=server.grpc_address, message_timeout_s=30.0)
        envoy = EnvoyProcess(rewrite_config(load_envoy_config("fail-closed"), settings), workdir=workdir, name=f"{name}-envoy")
        await envoy.start()
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60) as c:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24, "ignore_eos": True}
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(BURST)))
    finally:
        if envoy is not None:
            await envoy.aclose()
        await server.aclose()


async def test_a_burst_beyond_capacity_is_queued_and_served_rather_than_refused(workdir: Path, sims):
    without = await _burst(workdir, sims, "fc-off", None)
    assert Counter(r.status_code for r in without)[429] > 0, "the fleet refused nothing: the burst is not beyond capacity"
    flow = {"enabled": True, "gate": {"mode": "concurrency", "max_inflight": 2}}
    served = await _burst(workdir, sims, "fc-on", flow)
    statuses = Counter(r.status_code for r in served)
    assert statuses == {200: BURST}, [r.text[:200] for r in served if r.status_code != 200]
    waited = [int(r.headers["x-llm-queue-ms"]) for r in served if "x-llm-queue-ms" in r.headers]
    assert len(waited) >= BURST - 4 and max(waited) > 0  # only the first 4 found room at once


async def test_displacement_evicts_the_newest_sheddable_stream_for_a_critical_request(workdir: Path, sims):
    flow = {"enabled": True, "displacement": True, "gate": {"mode": "concurrency", "max_inflight": 1}}
    config = {**_config(sims, flow), "admission": {"priority": {"trusted_header": "x-trusted-priority"}}}
    server = await start_server(workdir, config, "fc-displace")
    envoy = None
    try:
        settings = RunSettings(extproc=server.grpc_address, message_timeout_s=30.0)
        envoy = EnvoyProcess(rewrite_config(load_envoy_config("fail-closed"), settings), workdir=workdir, name="fc-displace-envoy")
        await envoy.start()
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60) as c:

            async def stream(priority: dict[str, str], max_tokens: int) -> tuple[int, bytes, str | None]:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                try:
                    async with c.stream("POST", "/v1/chat/completions", json=body, headers=priority) as r:
                        data = b""
                        async for chunk in r.aiter_raw():
                            data += chunk
                        return r.status_code, data, None
                except httpx.HTTPError as exc:
                    return -1, b"", type(exc).__name__

            sheddable = [asyncio.ensure_future(stream({"x-llm-priority": "sheddable"}, 800)) for _ in range(2)]
            await asyncio.sleep(0.5)  # both streaming (800 tokens: ~2 s at speed 4), one per endpoint: the fleet is full
            critical = await asyncio.wait_for(stream({"x-trusted-priority": "critical"}, 8), 30)
            assert critical[0] == 200 and critical[1].rstrip().endswith(b"data: [DONE]"), critical
            done = await asyncio.gather(*sheddable)
            cut = [d for d in done if not d[1].rstrip().endswith(b"data: [DONE]")]
            assert len(cut) == 1, [(d[0], len(d[1]), d[2]) for d in done]  # exactly one evicted (cut mid-stream), the other finished
            metrics = (await c.get(f"{server.admin_url}/metrics")).text
        assert 'llm_extproc_flow_requests_total{band="sheddable",outcome="displaced"} 1.0' in metrics
    finally:
        if envoy is not None:
            await envoy.aclose()
        await server.aclose()
