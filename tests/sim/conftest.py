"""Fixtures for the simulator's HTTP tests: a running `SimServer` and a client session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
import pytest

from extproc.pipeline.tokens import TokenCounter
from extproc.sim.server import SimServer

StartSim = Callable[..., Coroutine[Any, Any, SimServer]]


@pytest.fixture
async def start_sim(qwen_counter: TokenCounter) -> AsyncIterator[StartSim]:
    """Start simulators (speed 20 unless given) on free ports; all are closed after the test."""
    servers: list[SimServer] = []

    async def start(**kw: Any) -> SimServer:
        kw.setdefault("speed", 20.0)
        server = SimServer(tokenizer=qwen_counter, **kw)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.aclose()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session without aiohttp's default cap of 100 connections (the load tests
    need more) and with a generous total timeout (tests bound their own waits)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session

