"""The sliding window: 60 s in `buckets` buckets, two counters (tokens, requests) per bucket.

Time is cut into buckets of `bucket_ms` milliseconds; bucket `i` covers
`[i × bucket_ms, (i + 1) × bucket_ms)`. At time `now_ms` the current bucket is
`cur = now_ms // bucket_ms` and the window holds buckets `cur - buckets + 1 .. cur`: a charge
made in bucket `i` counts until bucket `i + buckets` starts, i.e. 59–60 s later with 1 s
buckets (the design notes' section 2.3; the error is one bucket).

A decision over several scopes (a tenant, and the tenant on one model) admits only when every
scope has room for one more request and `cost` more tokens, and then charges all of them
(all or nothing). The Redis backend's Lua script (`redis_window.lua`) is this module, line by
line; the shared backend test suite holds both to the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ScopeLimit",
    "ScopeUse",
    "Decision",
    "WindowState",
    "UNLIMITED",
    "decide",
    "settle",
]

UNLIMITED = -1
"""A limit of -1 never refuses (the scope is still counted)."""


@dataclass(frozen=True, slots=True)
class ScopeLimit:
    """One scope of a decision: its key and its limits per window (tokens, requests; -1 = none)."""

    key: str
    tokens: int = UNLIMITED
    requests: int = UNLIMITED


@dataclass(frozen=True, slots=True)
class ScopeUse:
    """A scope's window after a decision.

    Attributes:
        tokens / requests: charged in the window (after this decision's charge, if admitted).
        reset_tokens_ms / reset_requests_ms: until every token / request now in the window has
            left it (milliseconds; 0 when the window is empty) — OpenAI's `x-ratelimit-reset-*`.
    """

    tokens: int
    requests: int
    reset_tokens_ms: int
    reset_requests_ms: int


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one acquire.

    Attributes:
        admitted: every scope had room; all were charged.
        bucket: the bucket charged (settlement goes back to it).
        uses: per scope, in the order given.
        refused_scope: index of the first scope that refused, else None.
        refused_limit: `tokens` or `requests` (requests are checked first), else None.
        retry_after_ms: until enough of the refusing scope's window has left it for this
            request to fit (milliseconds); 0 when admitted.
    """

    admitted: bool
    bucket: int
    uses: tuple[ScopeUse, ...]
    refused_scope: int | None = None
    refused_limit: str | None = None
    retry_after_ms: int = 0


@dataclass(slots=True)
class WindowState:
    """One scope's buckets: bucket index → [tokens, requests]. Only buckets with a charge exist."""

    buckets: dict[int, list[int]] = field(default_factory=dict)

    def prune(self, oldest: int) -> None:
        """Forget buckets before `oldest` (they left the window)."""
        stale = [i for i in self.buckets if i < oldest]
        for i in stale:
            del self.buckets[i]

    def newest(self) -> int | None:
        return max(self.buckets) if self.buckets else None


def _reset_ms(state: WindowState, slot: int, n: int, bucket_ms: int, now_ms: int) -> int:
    """Until the newest bucket with a non-zero counter `slot` leaves the window (ms)."""
    newest = None
    for i, counts in state.buckets.items():
        if counts[slot] > 0 and (newest is None or i > newest):
            newest = i
    return 0 if newest is None else max(0, (newest + n) * bucket_ms - now_ms)


def _retry_ms(state: WindowState, slot: int, need: int, n: int, bucket_ms: int, now_ms: int) -> int:
    """Until `need` of counter `slot` has left the window, oldest bucket first (ms); a whole
    window when it never can."""
    freed = 0
    for i in sorted(state.buckets):
        freed += state.buckets[i][slot]
        if freed >= need:
            return max(0, (i + n) * bucket_ms - now_ms)
    return n * bucket_ms


def decide(
    states: Sequence[WindowState], limits: Sequence[ScopeLimit], cost: int, now_ms: int, n: int, bucket_ms: int, *, mode: str = "acquire"
) -> Decision:
    """Admit one request of `cost` tokens against every scope, or none (see the module docstring).

    Args:
        states: each scope's buckets (pruned and, when admitted and `charge`, charged in place).
        limits: the scopes' limits, in the same order.
        cost: tokens to charge (>= 0).
        now_ms: the time (milliseconds; any epoch shared by every caller of the same states).
        n: buckets per window. bucket_ms: bucket width (milliseconds).
        mode: `acquire` checks and charges; `check` only checks (would `cost` fit now?);
            `peek` only reads (the admin view): nothing is refused or charged.
    """
    cur = now_ms // bucket_ms
    oldest = cur - n + 1
    used: list[tuple[int, int]] = []
    for st in states:
        st.prune(oldest)
        t = r = 0
        for counts in st.buckets.values():
            t += counts[0]
            r += counts[1]
        used.append((t, r))
    if mode != "peek":
        for k, (lim, (t, r)) in enumerate(zip(limits, used, strict=True)):
            if lim.requests >= 0 and r + 1 > lim.requests:
                retry = _retry_ms(states[k], 1, r + 1 - lim.requests, n, bucket_ms, now_ms)
                return _refusal(states, used, k, "requests", retry, cur, n, bucket_ms, now_ms)
            if lim.tokens >= 0 and t + cost > lim.tokens:
                retry = _retry_ms(states[k], 0, t + cost - lim.tokens, n, bucket_ms, now_ms)
                return _refusal(states, used, k, "tokens", retry, cur, n, bucket_ms, now_ms)
    if mode == "acquire":
        for k, st in enumerate(states):
            counts = st.buckets.setdefault(cur, [0, 0])
            counts[0] += cost
            counts[1] += 1
            used[k] = (used[k][0] + cost, used[k][1] + 1)
    uses = tuple(
        ScopeUse(t, r, _reset_ms(st, 0, n, bucket_ms, now_ms), _reset_ms(st, 1, n, bucket_ms, now_ms))
        for st, (t, r) in zip(states, used, strict=True)
    )
    return Decision(True, cur, uses)


def _refusal(
    states: Sequence[WindowState], used: list[tuple[int, int]], k: int, limit: str, retry_ms: int, cur: int, n: int, bucket_ms: int, now_ms: int
) -> Decision:
    uses = tuple(
        ScopeUse(t, r, _reset_ms(st, 0, n, bucket_ms, now_ms), _reset_ms(st, 1, n, bucket_ms, now_ms))
        for st, (t, r) in zip(states, used, strict=True)
    )
    return Decision(False, cur, uses, k, limit, retry_ms)


def settle(states: Sequence[WindowState], bucket: int, delta: int, now_ms: int, n: int, bucket_ms: int) -> None:
    """Correct a charge made in `bucket` by `delta` tokens (negative: give back what was not used).

    While `bucket` is still in the window the correction goes there (never below 0); once it has
    left, a refund is moot and an extra charge goes to the current bucket.
    """
    cur = now_ms // bucket_ms
    for st in states:
        if bucket > cur - n:
            counts = st.buckets.setdefault(bucket, [0, 0])
            counts[0] = max(0, counts[0] + delta)
        elif delta > 0:
            st.buckets.setdefault(cur, [0, 0])[0] += delta
