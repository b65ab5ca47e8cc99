"""`redis_client`: the one Redis client factory of the rate limiter and replica sync, against a
real redis-server. A command client gives up on a slow reply after `timeout_ms`; a subscriber
sits idle far longer than that without losing its subscription."""

from __future__ import annotations

import time

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from extproc.ratelimit.config import RedisConfig
from extproc.ratelimit.redis_client import redis_client
from extproc.stack.redis import RedisProcess


async def test_command_client_times_out_and_subscriber_outlives_idle(redis_server: RedisProcess) -> None:
    cfg = RedisConfig(url=redis_server.url, timeout_ms=100)
    client = redis_client(cfg)
    sub_client = redis_client(cfg, subscriber=True)
    slow = redis_client(RedisConfig(url=redis_server.url, timeout_ms=2000))
    pubsub = sub_client.pubsub(ignore_subscribe_messages=True)
    try:
        assert await client.ping()
        await pubsub.subscribe("ch")
        # The server holds a BLPOP reply for 1 s: the command client's read gives up at 0.1 s, no retry.
        started = time.monotonic()
        with pytest.raises((RedisTimeoutError, TimeoutError)):
            await client.blpop(["empty"], timeout=1)
        assert time.monotonic() - started < 0.8
        # Idle for 0.3 s (3x timeout_ms) in one wait: the subscriber's connection stays up.
        assert await pubsub.get_message(timeout=0.3) is None
        await slow.publish("ch", b"\xff\x00raw")
        msg = None
        for _ in range(20):
            msg = await pubsub.get_message(timeout=0.1)
            if msg is not None:
                break
        assert msg is not None and msg["data"] == b"\xff\x00raw"  # bytes, undecoded
    finally:
        await pubsub.aclose()
        for c in (client, sub_client, slow):
            await c.aclose()
