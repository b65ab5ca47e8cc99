"""Redis window backend: one limit shared by every llm-extproc replica.

Each decision is one `EVALSHA` of `redis_window.lua` — the same arithmetic as `window.py`, atomic
inside Redis, on Redis's own clock (`TIME`), so concurrent requests on any replica are decided
one at a time and never overshoot. Keys expire by themselves one window after their last charge.
After a Redis restart the script cache is empty: redis-py's `Script` reloads it on `NOSCRIPT`
(that one call takes two round trips).

Failures (connection refused, timeout, any Redis error) raise `BackendUnavailable`; the limiter
applies the configured policy. The client reconnects on the next call: no restart needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from importlib import resources

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from extproc.ratelimit.backend import BackendUnavailable
from extproc.ratelimit.config import WINDOW_S, RedisConfig
from extproc.ratelimit.window import Decision, ScopeLimit, ScopeUse

__all__ = ["RedisBackend", "LUA_SCRIPT"]

LUA_SCRIPT = resources.files("extproc.ratelimit").joinpath("redis_window.lua").read_text(encoding="utf-8")
_LIMITS = {0: None, 1: "tokens", 2: "requests"}


def _decision(raw: list[int], n_scopes: int) -> Decision:
    admitted, refused, limit, retry, bucket = (int(x) for x in raw[:5])
    uses = tuple(ScopeUse(*(int(x) for x in raw[5 + 4 * i : 9 + 4 * i])) for i in range(n_scopes))
    return Decision(bool(admitted), bucket, uses, refused - 1 if refused else None, _LIMITS[limit], retry)


class RedisBackend:
    """Windows in Redis.

    Args:
        config: URL, key prefix, timeout.
        buckets: buckets per 60 s window (every replica must use the same value).
    """

    name = "redis"
    local = False

    def __init__(self, config: RedisConfig, buckets: int = 60) -> None:
        timeout = config.timeout_ms / 1000
        self._timeout = timeout
        self._prefix = config.key_prefix
        self._n = buckets
        self._bucket_ms = WINDOW_S * 1000 // buckets
        # No client-side retries: a decision waits at most one timeout, then the policy decides.
        self._client = aioredis.Redis.from_url(
            config.url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._script = self._client.register_script(LUA_SCRIPT)

    def key(self, scope_key: str) -> str:
        """The Redis key of a scope."""
        return self._prefix + scope_key

    async def _run(self, keys: list[str], args: list[object]) -> list[int] | int:
        try:
            async with asyncio.timeout(self._timeout * 2):  # connect + command at most
                return await self._script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}") from None

    def _args(self, scopes: Sequence[ScopeLimit], mode: str, cost: int, now_ms: int | None) -> list[object]:
        args: list[object] = ["" if now_ms is None else now_ms, self._bucket_ms, self._n, mode, cost]
        for s in scopes:
            args += [s.tokens, s.requests]
        return args

    async def acquire(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None) -> Decision:
        raw = await self._run([self.key(s.key) for s in scopes], self._args(scopes, "acquire", cost, now_ms))
        return _decision(raw, len(scopes))  # type: ignore[arg-type]

    async def check(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None) -> Decision:
        raw = await self._run([self.key(s.key) for s in scopes], self._args(scopes, "check", cost, now_ms))
        return _decision(raw, len(scopes))  # type: ignore[arg-type]

    async def peek(self, scopes: Sequence[ScopeLimit], now_ms: int | None = None) -> Decision:
        raw = await self._run([self.key(s.key) for s in scopes], self._args(scopes, "peek", 0, now_ms))
        return _decision(raw, len(scopes))  # type: ignore[arg-type]

    async def settle(self, keys: Sequence[str], bucket: int, delta: int, now_ms: int | None = None) -> None:
        await self._run([self.key(k) for k in keys], ["" if now_ms is None else now_ms, self._bucket_ms, self._n, "settle", bucket, delta])

    async def aclose(self) -> None:
        await self._client.aclose()
