"""The ext_proc server consumes agent reports: `/api/v1/weights` moves when a GPU loads, a device
fault takes the endpoint out of scheduling, and the agent's `/healthz` mirrors its health."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from extproc.config.loader import config_from_mapping
from extproc.pipeline.request import ModelRuntime
from extproc.server.app import ExtProcApp
from tests.agent.agent_helpers import FakeEngine, eventually

MODEL = "m"


@pytest.fixture
async def server(qwen_counter, engine: FakeEngine, start_agent):
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}")
    other = FakeEngine()
    await other.start()
    cfg = config_from_mapping(
        {
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "models": [{"name": MODEL, "path": "builtin:qwen3-8b"}],
            "endpoints": [
                {"address": engine.url.removeprefix("http://"), "models": [MODEL], "agent": f"127.0.0.1:{agent.grpc_port}"},
                {"address": other.url.removeprefix("http://"), "models": [MODEL]},
            ],
            "scheduling": {"profile": "compute-aware", "metrics": {"interval_s": 0.05}, "health_check": {"interval_s": 0.2}},
        },
        env={},
    )
    app = ExtProcApp(cfg, registry=CollectorRegistry(), models={MODEL: ModelRuntime(cfg.models[0], qwen_counter)})
    await app.start()
    yield app, agent
    await app.aclose(grace_s=0)
    await other.aclose()


async def _weights(app) -> dict[str, dict]:
    async with httpx.AsyncClient(trust_env=False) as c:
        body = (await c.get(f"http://127.0.0.1:{app.admin_port}/api/v1/weights")).json()
    return {row["address"]: row for row in body["endpoints"]}


async def test_weights_follow_the_agents_gpu_report(server, engine: FakeEngine):
    app, agent = server
    me = engine.url.removeprefix("http://")
    engine.gpu["utilization"] = 0.1
    await eventually(lambda: app.store.get(me).node is not None and app.store.get(me).node.gpu_util == pytest.approx(0.1), what="idle report")
    idle = (await _weights(app))[me]
    assert idle["compute_aware"]["gpu_idle"] == pytest.approx(0.9)
    engine.gpu["utilization"] = 0.95
    await eventually(lambda: app.store.get(me).node.gpu_util == pytest.approx(0.95), what="loaded report")
    loaded = (await _weights(app))[me]
    assert loaded["compute_aware"]["gpu_idle"] == pytest.approx(0.05)
    assert loaded["weight"] < idle["weight"]


async def test_agent_healthz_mirrors_the_nodes_health(server, engine: FakeEngine):
    _, agent = server
    async with httpx.AsyncClient(trust_env=False) as c:
        url = f"http://127.0.0.1:{agent.metrics_port}/healthz"
        assert (await c.get(url)).status_code == 200
        engine.health_status = 503
        await eventually(lambda: agent.latest is not None and not agent.latest.healthy, what="unhealthy verdict")
        assert (await c.get(url)).status_code == 503
