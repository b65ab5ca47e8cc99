"""In-process window backend (the default): one limit per llm-extproc process.

Decisions run on the event loop without suspending, so concurrent requests are decided one at
a time: a limit is never overshot by concurrency. With several replicas each enforces its own
limit (the effective limit is limit × replicas): use the Redis backend there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from extproc.ratelimit.config import WINDOW_S
from extproc.ratelimit.window import LEASE_MS, Decision, ScopeLimit, WindowState, decide, settle

__all__ = ["MemoryBackend"]

SWEEP_EVERY = 4096
"""Decisions between two sweeps of scopes whose windows have emptied (bounds memory when many
one-off tenants come and go)."""


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class MemoryBackend:
    """Windows in a dict, keyed by scope.

    Args:
        buckets: buckets per 60 s window.
        clock_ms: the clock when a call passes no `now_ms` (milliseconds).
        lease_ms: how long an in-flight entry counts at most (milliseconds; `window.decide`).
    """

    name = "memory"
    local = True

    def __init__(self, buckets: int = 60, clock_ms: Callable[[], int] = _monotonic_ms, lease_ms: int = LEASE_MS) -> None:
        self._n = buckets
        self._lease_ms = lease_ms
        self._bucket_ms = WINDOW_S * 1000 // buckets
        self._clock = clock_ms
        self._states: dict[str, WindowState] = {}
        self._until_sweep = SWEEP_EVERY

    def _get(self, keys: Sequence[str]) -> list[WindowState]:
        states = self._states
        out = []
        for k in keys:
            st = states.get(k)
            if st is None:
                st = states[k] = WindowState()
            out.append(st)
        return out

    def _sweep(self, now_ms: int) -> None:
        oldest = now_ms // self._bucket_ms - self._n + 1
        for key in [k for k, st in self._states.items() if st.idle(now_ms, oldest)]:
            del self._states[key]

    def acquire_now(
        self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None, request_id: str | None = None, *, mode: str = "acquire"
    ) -> Decision:
        """`acquire`, synchronously."""
        now = self._clock() if now_ms is None else now_ms
        self._until_sweep -= 1
        if self._until_sweep <= 0:
            self._until_sweep = SWEEP_EVERY
            self._sweep(now)
        states = self._get([s.key for s in scopes])
        return decide(states, scopes, cost, now, self._n, self._bucket_ms, mode=mode, request_id=request_id, lease_ms=self._lease_ms)

    def settle_now(self, keys: Sequence[str], bucket: int, delta: int, now_ms: int | None = None, request_id: str | None = None) -> None:
        """`settle`, synchronously."""
        now = self._clock() if now_ms is None else now_ms
        settle(self._get(keys), bucket, delta, now, self._n, self._bucket_ms, request_id)

    async def acquire(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None, request_id: str | None = None) -> Decision:
        return self.acquire_now(scopes, cost, now_ms, request_id)

    async def settle(self, keys: Sequence[str], bucket: int, delta: int, now_ms: int | None = None, request_id: str | None = None) -> None:
        self.settle_now(keys, bucket, delta, now_ms, request_id)

    async def abort(self, keys: Sequence[str], cost: int, request_id: str, now_ms: int | None = None) -> None:
        for st in self._get(keys):
            admitted = st.inflight.get(request_id)
            if admitted is not None:
                self.settle_now(keys, admitted // self._bucket_ms, -cost, now_ms, request_id)
                return

    async def check(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None) -> Decision:
        return self.acquire_now(scopes, cost, now_ms, mode="check")

    async def peek(self, scopes: Sequence[ScopeLimit], now_ms: int | None = None) -> Decision:
        return self.acquire_now(scopes, 0, now_ms, mode="peek")

    async def aclose(self) -> None:
        self._states.clear()

    def __len__(self) -> int:
        return len(self._states)
