"""The agent against the real simulator (`llm-extproc sim`): its `/sim/gpu`, `/metrics` and
`/health` are read as a vLLM node's would be."""

from __future__ import annotations

import aiohttp
import pytest

from extproc.pipeline.tokens import TokenCounter
from extproc.sim.server import SimServer
from tests.agent.agent_helpers import eventually


@pytest.fixture
async def sim(qwen_counter: TokenCounter):
    server = SimServer(tokenizer=qwen_counter, speed=20.0, num_gpu_blocks=2000)
    await server.start()
    yield server
    await server.aclose()


@pytest.mark.parametrize("spelling", ["{url}", "{url}/sim/gpu/"], ids=["base-url", "gpu-path"])
async def test_agent_reads_the_simulated_node(sim: SimServer, start_agent, spelling: str) -> None:
    agent = await start_agent(sim.url, gpu="sim:" + spelling.format(url=sim.url), period_s=0.05)
    first = agent.latest
    assert first is not None and first.healthy
    (gpu,) = first.devices
    view = sim.gpu_view()
    assert gpu.memory_total_bytes == view["memory_total_bytes"] and gpu.memory_used_bytes > 0
    assert (first.engine.kv_blocks_total, first.engine.block_size) == (2000, sim.config.block_size)

    async with aiohttp.ClientSession() as http:
        body = {"model": sim.model, "messages": [{"role": "user", "content": "hello " * 300}], "max_tokens": 8}
        for _ in range(10):
            async with http.post(f"{sim.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
    await eventually(
        lambda: agent.latest.engine.ttft_p95_ms is not None, what="a TTFT P95 from the simulator's histogram"
    )
    assert agent.latest.engine.ttft_p95_ms > 0

    await sim.update_faults({"health_fail": True})
    await eventually(lambda: not agent.latest.healthy, what="the simulator's failing /health noticed")
    assert "status 503" in agent.latest.reason
