"""Flow control end to end: a real Envoy (fail-closed, its ext_proc message_timeout raised as
`envoy-config` raises it) in front of llm-extproc and two simulators that refuse work beyond
their batch and a short queue (`max_num_seqs` 2, `max_waiting` 1: vLLM's answer to overload, a
429). A burst of 3× what the fleet can hold is refused in part without flow control; with it,
every request is held at the gateway and served, and the ones that waited say how long."""

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
BURST = 24  # the fleet holds 2 × (2 running + 1 waiting) = 6


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sims(qwen_counter) -> AsyncIterator[list[SimServer]]:
    async with in_process_sims(qwen_counter, 2, speed=4.0, max_num_seqs=2, max_waiting=1) as started:
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
