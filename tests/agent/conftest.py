"""Fixtures for the node agent's tests: a fake local engine and agents on free ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.agent.app import AgentSettings, NodeAgent
from extproc.agent.sources import gpu_source_from_spec
from tests.agent.agent_helpers import FakeEngine


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    """A running fake engine (idle, healthy, 1000 KV blocks of 16 tokens, one 80 GiB GPU)."""
    e = FakeEngine()
    await e.start()
    yield e
    await e.aclose()


StartAgent = Callable[..., Awaitable[NodeAgent]]


@pytest.fixture
async def start_agent() -> AsyncIterator[StartAgent]:
    """Start agents on 127.0.0.1, free ports, 0.05 s period; all are closed after the test.

    `start_agent(engine_url, gpu="sim:URL"|"none"|..., **AgentSettings fields)`.
    """
    agents: list[NodeAgent] = []

    async def start(engine_url: str | None, gpu: str = "none", **kw: Any) -> NodeAgent:
        kw.setdefault("period_s", 0.05)
        kw.setdefault("grpc_port", 0)
        kw.setdefault("metrics_port", 0)
        kw.setdefault("node", "node-a")
        settings = AgentSettings(host="127.0.0.1", engine_url=engine_url, **kw)
        agent = NodeAgent(settings, gpu_source_from_spec(gpu), registry=CollectorRegistry())
        await agent.start()
        agents.append(agent)
        return agent

    yield start
    for a in agents:
        await a.aclose()
