"""Fixtures for replica sync: a real redis-server per test (the rate limiter's fixture) and a
proxy in front of it that can black-hole its connections."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from extproc.stack.redis import RedisProcess
from tests.ratelimit.conftest import redis_server  # noqa: F401 - a real redis-server per test
from tests.replicas.blackhole import BlackholeProxy


@pytest_asyncio.fixture
async def redis_proxy(redis_server: RedisProcess) -> AsyncIterator[BlackholeProxy]:  # noqa: F811
    """A started `BlackholeProxy` to `redis_server` (reach Redis through it at
    `redis://127.0.0.1:{redis_proxy.port}/0`), closed after the test."""
    host, port = redis_server.url.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    proxy = BlackholeProxy(host, int(port))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.aclose()
