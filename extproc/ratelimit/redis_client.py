"""The one way this process opens a Redis client (`ratelimit.redis`): the rate limiter's
backend, and replica sync's publisher and subscriber (`extproc.replicas.sync`).

Every client: connect timeout `timeout_ms`; no client-side retries (a caller waits at most its
own timeout, then its policy decides: admit or refuse, drop the batch, subscribe again);
replies as bytes (`decode_responses=False`: the Lua script answers integers, replica messages
are msgpack). A command client also times out each read at `timeout_ms`; a subscriber does
not, since its connection sits idle between messages by design (`PubSub.get_message` bounds
each wait itself; replica sync's subscriber detects a silently dead connection on its own, by
PINGs and what it hears: `extproc.replicas.sync`).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from extproc.ratelimit.config import RedisConfig

__all__ = ["redis_client"]


def redis_client(config: RedisConfig, *, subscriber: bool = False) -> aioredis.Redis:
    """A client of `config.url` (connects lazily, on its first command: Redis may be down).

    Args:
        config: URL and `timeout_ms` (milliseconds).
        subscriber: for a pub/sub subscription: no read timeout (see the module docstring).

    Returns:
        the client; close it with `aclose()`.
    """
    timeout = config.timeout_ms / 1000
    return aioredis.Redis.from_url(
        config.url,
        socket_timeout=None if subscriber else timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        decode_responses=False,
    )
