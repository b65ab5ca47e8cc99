"""Fixtures for the rate limiter: a real `redis-server` (Debian's package; `.ci/run` installs it)
and the two window backends behind one fixture, so one test suite runs against both."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from extproc.ratelimit.backend import WindowBackend
from extproc.ratelimit.config import RedisConfig
from extproc.ratelimit.memory import MemoryBackend
from extproc.ratelimit.redis_backend import RedisBackend
from extproc.stack.redis import RedisProcess, redis_server_binary

needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed (apt-get install -y redis-server)")


@pytest_asyncio.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[RedisProcess]:
    """A fresh redis-server on a free port, stopped (by PID) after the test."""
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisProcess(workdir=tmp_path / "redis")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def redis_backend(server: RedisProcess, *, buckets: int = 60, timeout_ms: int = 1000, on_error: str = "open") -> RedisBackend:
    """A Redis backend on `server` under a key prefix of its own. The default timeout is generous:
    50 concurrent first calls each open a connection on a loaded 2-core host (the failure tests
    pass their own short timeout)."""
    cfg = RedisConfig(url=server.url, key_prefix=f"t{uuid.uuid4().hex[:8]}:", timeout_ms=timeout_ms, on_error=on_error)
    return RedisBackend(cfg, buckets)


@pytest_asyncio.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[WindowBackend]:
    """Each window backend in turn; the Redis one on its own redis-server."""
    if request.param == "memory":
        b: WindowBackend = MemoryBackend(60)
        yield b
        await b.aclose()
        return
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisProcess(workdir=tmp_path / "redis")
    await server.start()
    b = redis_backend(server)
    try:
        yield b
    finally:
        await b.aclose()
        await server.stop()
