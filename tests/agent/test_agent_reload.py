"""An endpoint's `agent` lives on the endpoint (`Endpoint.agent`): a static-file reload that
changes it moves the server's watch to the new agent at once, with real agents and a real
configuration file."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from extproc.config.loader import load_config
from extproc.pipeline.request import ModelRuntime
from extproc.server.app import ExtProcApp
from tests.agent.agent_helpers import FakeEngine, eventually

MODEL = "Qwen/Qwen3-8B"
ENDPOINT = "127.0.0.1:18031"  # nothing listens: health checks and scrapes are off


def write_config(path: Path, agent: str | None) -> None:
    """The configuration file, replaced whole (a new inode, as a ConfigMap swap does)."""
    raw = {
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "limits": {"shutdown_grace_s": 1},
        "models": [{"name": MODEL}],
        "endpoints": [{"address": ENDPOINT, "models": [MODEL], **({"agent": agent} if agent else {})}],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}},
        "discovery": {"sources": [{"type": "static", "poll_interval_s": 0.05, "sighup": False}]},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(raw))
    os.replace(tmp, path)


async def test_a_reload_that_changes_an_endpoints_agent_watches_the_new_one(engine: FakeEngine, start_agent, qwen_counter, tmp_path: Path) -> None:
    first = await start_agent(engine.url, gpu=f"sim:{engine.url}", node="node-a")
    second = await start_agent(engine.url, gpu=f"sim:{engine.url}", node="node-b")
    path = tmp_path / "llm-extproc.yaml"
    write_config(path, f"127.0.0.1:{first.grpc_port}")
    cfg = load_config(path)
    app = ExtProcApp(cfg, registry=CollectorRegistry(), models={m.name: ModelRuntime(m, qwen_counter) for m in cfg.models}, config_path=path)
    await app.start()
    try:
        ep = app.store.get(ENDPOINT)
        assert ep is not None and ep.agent == f"127.0.0.1:{first.grpc_port}"
        await eventually(lambda: ep.node is not None and ep.node.node == "node-a", what="a report from the first agent")
        write_config(path, f"127.0.0.1:{second.grpc_port}")
        await eventually(lambda: ep.agent == f"127.0.0.1:{second.grpc_port}", what="the reload")
        ep.node = None
        await eventually(lambda: ep.node is not None and ep.node.node == "node-b", what="a report from the second agent")
        assert app.store.get(ENDPOINT) is ep, "the endpoint kept its state"
        write_config(path, None)  # no agent any more: nothing watched
        await eventually(lambda: ep.agent is None, what="the second reload")
        await eventually(lambda: not app._agents.agents, what="the watch to stop")
    finally:
        await app.aclose(grace_s=0)
