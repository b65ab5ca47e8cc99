"""Redis window backend: one limit shared by every llm-extproc replica.

Each decision is one `EVALSHA` of `redis_window.lua` — the same arithmetic as `window.py`, atomic
inside Redis, on Redis's own clock (`TIME`), so concurrent requests on any replica are decided
one at a time and never overshoot. Keys expire by themselves one window after their last charge.
After a Redis restart the script cache is empty: redis-py's `Script` reloads it on `NOSCRIPT`
(that one call takes two round trips).

Failures (connection refused, timeout, any Redis error) raise `BackendUnavailable`; the limiter
applies the configured policy. The client reconnects on the next call: no restart needed.
Decisions are never retried (one timeout at most, then the policy); a settlement whose
connection dropped (Redis's idle `timeout`, `CLIENT KILL`, a proxy closing idle connections —
the pool hands out a dead connection once) is retried once on a fresh connection, since a lost
settlement keeps a concurrency slot for the whole lease. A settlement's reply lost after Redis
ran it makes the retry run it twice: the in-flight release is idempotent, the token correction
is applied twice (a refund floors at 0 per bucket) — a small over-refund, against 900 s of a
held slot.

An acquire the client gave up on (its timeout passed: Redis stalled, e.g. `SIGSTOP`) may still
run when Redis resumes, since the command sits in Redis's input buffer: the limiter then sends
an `abort` for its request id. The script gives back what the acquire charged when it ran
already, or leaves a tombstone that refuses it when it runs later, so a stall does not hold the
tenant's concurrency slots for the lease (issue 28).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from importlib import resources

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from extproc.ratelimit.backend import BackendUnavailable
from extproc.ratelimit.config import WINDOW_S, RedisConfig
from extproc.ratelimit.redis_client import redis_client
from extproc.ratelimit.window import LEASE_MS, Decision, ScopeLimit, ScopeUse

__all__ = ["RedisBackend", "LUA_SCRIPT"]

LUA_SCRIPT = resources.files("extproc.ratelimit").joinpath("redis_window.lua").read_text(encoding="utf-8")
_LIMITS = {0: None, 1: "tokens", 2: "requests", 3: "concurrency", 4: "pacing"}
_PER_SCOPE = 6


def _decision(raw: list, n_scopes: int) -> Decision:
    admitted, refused, limit, retry, bucket = (int(x) for x in raw[:5])
    uses = []
    for i in range(n_scopes):
        t, r, rt, rr, inflight, level = raw[5 + _PER_SCOPE * i : 5 + _PER_SCOPE * (i + 1)]
        uses.append(ScopeUse(int(t), int(r), int(rt), int(rr), int(inflight), None if level is None else int(level)))
    return Decision(bool(admitted), bucket, tuple(uses), refused - 1 if refused else None, _LIMITS[limit], retry)


class RedisBackend:
    """Windows in Redis.

    Args:
        config: URL, key prefix, timeout.
        buckets: buckets per 60 s window (every replica must use the same value).
        lease_ms: how long an in-flight entry counts at most (milliseconds): the slots of a
            replica that died with requests in flight come back after it.
    """

    name = "redis"
    local = False

    def __init__(self, config: RedisConfig, buckets: int = 60, lease_ms: int = LEASE_MS) -> None:
        self._lease_ms = lease_ms
        timeout = config.timeout_ms / 1000
        self._timeout = timeout
        self._prefix = config.key_prefix
        self._n = buckets
        self._bucket_ms = WINDOW_S * 1000 // buckets
        # No client-side retries: a decision waits at most one timeout, then the policy decides.
        self._client = redis_client(config)
        self._script = self._client.register_script(LUA_SCRIPT)

    def key(self, scope_key: str) -> str:
        """The Redis key of a scope."""
        return self._prefix + scope_key

    async def _run(self, keys: list[str], args: list[object]) -> list[int] | int:
        try:
            async with asyncio.timeout(self._timeout * 2):  # connect + command at most
                return await self._script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            # The builtin TimeoutError is an OSError: a timeout is not a dropped connection.
            dropped = isinstance(exc, RedisConnectionError) or (isinstance(exc, OSError) and not isinstance(exc, TimeoutError))
            raise BackendUnavailable(f"{type(exc).__name__}: {exc}", dropped=dropped) from None

    def _args(self, scopes: Sequence[ScopeLimit], mode: str, cost: int, now_ms: int | None, request_id: str | None = None) -> list[object]:
        args: list[object] = ["" if now_ms is None else now_ms, self._bucket_ms, self._n, mode, cost, request_id or "", self._lease_ms]
        for s in scopes:
            args += [s.tokens, s.requests, s.concurrent, s.burst]
        return args

    async def acquire(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None, request_id: str | None = None) -> Decision:
        if request_id is None and any(s.concurrent >= 0 for s in scopes):
            raise ValueError("a scope with a concurrency cap needs the request's id")
        raw = await self._run([self.key(s.key) for s in scopes], self._args(scopes, "acquire", cost, now_ms, request_id))
        return _decision(raw, len(scopes))  # type: ignore[arg-type]

    async def check(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None) -> Decision:
        raw = await self._run([self.key(s.key) for s in scopes], self._args(scopes, "check", cost, now_ms))
        return _decision(raw, len(scopes))  # type: ignore[arg-type]

    async def peek(self, scopes: Sequence[ScopeLimit], now_ms: int | None = None) -> Decision:
        raw = await self._run([self.key(s.key) for s in scopes], self._args(scopes, "peek", 0, now_ms))
        return _decision(raw, len(scopes))  # type: ignore[arg-type]

    async def settle(self, keys: Sequence[str], bucket: int, delta: int, now_ms: int | None = None, request_id: str | None = None) -> None:
        args = ["" if now_ms is None else now_ms, self._bucket_ms, self._n, "settle", bucket, delta, request_id or "", self._lease_ms]
        await self._run_retried(keys, args)

    async def abort(self, keys: Sequence[str], cost: int, request_id: str, now_ms: int | None = None) -> None:
        args = ["" if now_ms is None else now_ms, self._bucket_ms, self._n, "abort", cost, request_id, self._lease_ms]
        await self._run_retried(keys, args)

    async def _run_retried(self, keys: Sequence[str], args: list[object]) -> None:
        """Run a settlement (or abort), once more on a fresh connection when the first dropped."""
        try:
            await self._run([self.key(k) for k in keys], args)
        except BackendUnavailable as exc:
            if not exc.dropped:
                raise
            # A dropped connection is not Redis down: the pool's idle connections are likely dead
            # too (a `CLIENT KILL TYPE normal` closes them all), so retry once on a new one.
            await self._client.connection_pool.disconnect(inuse_connections=False)
            await self._run([self.key(k) for k in keys], args)

    async def aclose(self) -> None:
        await self._client.aclose()
