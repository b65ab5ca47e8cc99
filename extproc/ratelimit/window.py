"""The sliding window: 60 s in `buckets` buckets, two counters (tokens, requests) per bucket.

Time is cut into buckets of `bucket_ms` milliseconds; bucket `i` covers
`[i × bucket_ms, (i + 1) × bucket_ms)`. At time `now_ms` the current bucket is
`cur = now_ms // bucket_ms` and the window holds buckets `cur - buckets + 1 .. cur`: a charge
made in bucket `i` counts until bucket `i + buckets` starts, i.e. 59–60 s later with 1 s
buckets (the design notes' section 2.3; the error is one bucket).

Two controls shape a scope's traffic inside the minute (decision 0190):

- **Concurrency**: at most `concurrent` of the scope's requests in flight. An admitted request
  is registered under its id with the time it was admitted; settlement removes it (and feeds the
  scope's mean hold time, which estimates the retry-after of a refusal). An entry older than
  `lease_ms` no longer counts, so a replica that died with requests in flight cannot hold a
  tenant's slots for ever.
- **Pacing**: a token bucket over the minute's allowance, refilled at `tokens / 60` tokens per
  second up to `burst` tokens. A request is admitted when the bucket holds `min(cost, burst)`
  (a request larger than the burst waits for a full bucket) and takes its whole cost, so the
  level may go negative: the debt is paid back by refill before the next one. Settlement puts
  unused tokens back (never above `burst`). Levels are kept in 1/60,000 tokens, so a
  millisecond's refill is exactly `tokens` units: integer arithmetic, the same in Lua.

A decision over several scopes (a tenant, and the tenant on one model) admits only when every
scope has room for one more request in flight, one more request and `cost` more tokens in its
window and `min(cost, burst)` in its bucket, and then charges all of them (all or nothing).
The Redis backend's Lua script (`redis_window.lua`) is this module, line by line; the shared
backend test suite holds both to the same answers.
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

LEVEL_SCALE = 60_000
"""Bucket levels are kept in 1/60,000 tokens: a limit of L tokens per minute refills L units per
millisecond."""

DEFAULT_HOLD_MS = 1_000
"""A scope's mean hold time before any request of it has ended (milliseconds)."""

LEASE_MS = 900_000
"""Default lease of an in-flight entry (milliseconds): after it, a request never settled (its
replica died) stops counting against the concurrency cap."""


@dataclass(frozen=True, slots=True)
class ScopeLimit:
    """One scope of a decision: its key and its limits (-1 = none).

    Attributes:
        tokens / requests: per 60 s window.
        concurrent: requests in flight at once.
        burst: the pacing bucket's size (tokens; needs `tokens`, which sets the refill rate).
    """

    key: str
    tokens: int = UNLIMITED
    requests: int = UNLIMITED
    concurrent: int = UNLIMITED
    burst: int = UNLIMITED

    @property
    def paced(self) -> bool:
        return self.burst >= 0 and self.tokens > 0


@dataclass(frozen=True, slots=True)
class ScopeUse:
    """A scope's window after a decision.

    Attributes:
        tokens / requests: charged in the window (after this decision's charge, if admitted).
        reset_tokens_ms / reset_requests_ms: until every token / request now in the window has
            left it (milliseconds; 0 when the window is empty) — OpenAI's `x-ratelimit-reset-*`.
        inflight: requests in flight (after this decision's, if admitted; 0 when not capped).
        bucket_tokens: the pacing bucket's level (whole tokens, floored; negative in debt), or
            None when the scope is not paced.
    """

    tokens: int
    requests: int
    reset_tokens_ms: int
    reset_requests_ms: int
    inflight: int = 0
    bucket_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one acquire.

    Attributes:
        admitted: every scope had room; all were charged.
        bucket: the bucket charged (settlement goes back to it).
        uses: per scope, in the order given.
        refused_scope: index of the first scope that refused, else None.
        refused_limit: `concurrency`, `requests`, `tokens` or `pacing` (checked in that order),
            else None.
        retry_after_ms: when the refusing control would admit (milliseconds; 0 when admitted):
            window — until enough of it has left; pacing — until the bucket has refilled to
            `min(cost, burst)`; concurrency — the scope's mean hold time / requests in flight
            (when the next one is expected to end, were hold times memoryless), no less than the
            oldest one's mean-hold remainder, no more than its lease's remaining time.
    """

    admitted: bool
    bucket: int
    uses: tuple[ScopeUse, ...]
    refused_scope: int | None = None
    refused_limit: str | None = None
    retry_after_ms: int = 0


@dataclass(slots=True)
class WindowState:
    """One scope's state.

    Attributes:
        buckets: window bucket index → [tokens, requests]; only buckets with a charge exist.
        inflight: request id → the time it was admitted (ms).
        hold_ms: mean time admitted requests were held (ms; moving average, 1/8 weight).
        level / level_ms: the pacing bucket's level (1/60,000 tokens) and when it was computed;
            level is None until the scope is first paced.
        rate / burst: the pacing the level was last computed with (tokens per minute, tokens),
            so settlement needs only the keys.
    """

    buckets: dict[int, list[int]] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)
    hold_ms: int = DEFAULT_HOLD_MS
    level: int | None = None
    level_ms: int = 0
    rate: int = 0
    burst: int = 0

    def prune(self, oldest: int) -> None:
        """Forget buckets before `oldest` (they left the window)."""
        stale = [i for i in self.buckets if i < oldest]
        for i in stale:
            del self.buckets[i]

    def newest(self) -> int | None:
        return max(self.buckets) if self.buckets else None

    def expire(self, now_ms: int, lease_ms: int) -> None:
        """Forget in-flight entries whose lease ran out."""
        stale = [r for r, t in self.inflight.items() if t + lease_ms <= now_ms]
        for r in stale:
            del self.inflight[r]

    def refill(self, now_ms: int) -> int | None:
        """The pacing level at `now_ms` (1/60,000 tokens), stored; None when never paced."""
        if self.level is None:
            return None
        cap = self.burst * LEVEL_SCALE
        dt = max(0, now_ms - self.level_ms)
        if dt * self.rate >= cap - self.level:
            self.level = cap
        else:
            self.level += dt * self.rate
        self.level_ms = max(self.level_ms, now_ms)
        return self.level

    def idle(self, now_ms: int, oldest: int) -> bool:
        """Nothing to remember: an empty window, nobody in flight, a full (or no) bucket."""
        newest = self.newest()
        if newest is not None and newest >= oldest:
            return False
        if self.inflight:
            return False
        if self.level is None:
            return True
        return self.refill(now_ms) >= self.burst * LEVEL_SCALE


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


def _concurrency_retry_ms(st: WindowState, now_ms: int, lease_ms: int) -> int:
    """When a full concurrency cap should be asked again (ms, at least 1; decision 0190).

    The mean hold time / requests in flight (when the next one is expected to end, were hold
    times memoryless), but no less than what the oldest request in flight still needs if it is
    held the mean time (requests of similar length admitted together end together, not one per
    hold/k), and no more than its lease's remaining time (when its slot is free for certain:
    a lease whose settlement was lost ends then). Call after `expire`."""
    k = len(st.inflight)
    est = -(-st.hold_ms // max(1, k))
    if k:
        first = min(st.inflight.values())
        est = max(est, st.hold_ms - (now_ms - first))
        est = min(est, first + lease_ms - now_ms)
    return max(1, est)


def _pace(st: WindowState, lim: ScopeLimit, now_ms: int) -> int:
    """The scope's pacing level at `now_ms` under its current limits (1/60,000 tokens)."""
    st.rate, st.burst = lim.tokens, lim.burst
    if st.level is None:
        st.level, st.level_ms = lim.burst * LEVEL_SCALE, now_ms
    st.refill(now_ms)
    st.level = min(st.level, lim.burst * LEVEL_SCALE)  # type: ignore[type-var]
    return st.level  # type: ignore[return-value]


def _use(st: WindowState, lim: ScopeLimit, t: int, r: int, n: int, bucket_ms: int, now_ms: int) -> ScopeUse:
    return ScopeUse(
        t,
        r,
        _reset_ms(st, 0, n, bucket_ms, now_ms),
        _reset_ms(st, 1, n, bucket_ms, now_ms),
        len(st.inflight) if lim.concurrent >= 0 else 0,
        st.level // LEVEL_SCALE if lim.paced and st.level is not None else None,
    )


def decide(
    states: Sequence[WindowState],
    limits: Sequence[ScopeLimit],
    cost: int,
    now_ms: int,
    n: int,
    bucket_ms: int,
    *,
    mode: str = "acquire",
    request_id: str | None = None,
    lease_ms: int = LEASE_MS,
) -> Decision:
    """Admit one request of `cost` tokens against every scope, or none (see the module docstring).

    Args:
        states: each scope's state (pruned and, when admitted in `acquire` mode, charged in place).
        limits: the scopes' limits, in the same order.
        cost: tokens to charge (>= 0).
        now_ms: the time (milliseconds; any epoch shared by every caller of the same states).
        n: buckets per window. bucket_ms: bucket width (milliseconds).
        mode: `acquire` checks and charges; `check` only checks (would `cost` fit now?);
            `peek` only reads (the admin view): nothing is refused or charged.
        request_id: the request's id in the in-flight sets of scopes with a concurrency cap
            (settle with the same id to release it).
        lease_ms: an in-flight entry older than this no longer counts (milliseconds).

    Raises:
        ValueError: `acquire` on a scope with a concurrency cap without a `request_id`.
    """
    cur = now_ms // bucket_ms
    oldest = cur - n + 1
    used: list[tuple[int, int]] = []
    levels: list[int | None] = []
    for st, lim in zip(states, limits, strict=True):
        st.prune(oldest)
        st.expire(now_ms, lease_ms)
        t = r = 0
        for counts in st.buckets.values():
            t += counts[0]
            r += counts[1]
        used.append((t, r))
        levels.append(_pace(st, lim, now_ms) if lim.paced else None)
    if mode != "peek":
        for k, (lim, (t, r)) in enumerate(zip(limits, used, strict=True)):
            st = states[k]
            if lim.concurrent >= 0 and len(st.inflight) + 1 > lim.concurrent:
                retry = _concurrency_retry_ms(st, now_ms, lease_ms)
                return _refusal(states, limits, used, k, "concurrency", retry, cur, n, bucket_ms, now_ms)
            if lim.requests >= 0 and r + 1 > lim.requests:
                retry = _retry_ms(st, 1, r + 1 - lim.requests, n, bucket_ms, now_ms)
                return _refusal(states, limits, used, k, "requests", retry, cur, n, bucket_ms, now_ms)
            if lim.tokens >= 0 and t + cost > lim.tokens:
                retry = _retry_ms(st, 0, t + cost - lim.tokens, n, bucket_ms, now_ms)
                return _refusal(states, limits, used, k, "tokens", retry, cur, n, bucket_ms, now_ms)
            level = levels[k]
            if level is not None:
                need = min(cost, lim.burst) * LEVEL_SCALE - level
                if need > 0:
                    return _refusal(states, limits, used, k, "pacing", -(-need // lim.tokens), cur, n, bucket_ms, now_ms)
    if mode == "acquire":
        if request_id is None and any(lim.concurrent >= 0 for lim in limits):
            raise ValueError("a scope with a concurrency cap needs the request's id")
        for k, (st, lim) in enumerate(zip(states, limits, strict=True)):
            counts = st.buckets.setdefault(cur, [0, 0])
            counts[0] += cost
            counts[1] += 1
            used[k] = (used[k][0] + cost, used[k][1] + 1)
            if lim.concurrent >= 0:
                st.inflight[request_id] = now_ms  # type: ignore[index]
            if lim.paced:
                st.level -= cost * LEVEL_SCALE  # type: ignore[operator]
    uses = tuple(_use(st, lim, t, r, n, bucket_ms, now_ms) for st, lim, (t, r) in zip(states, limits, used, strict=True))
    return Decision(True, cur, uses)


def _refusal(
    states: Sequence[WindowState],
    limits: Sequence[ScopeLimit],
    used: list[tuple[int, int]],
    k: int,
    limit: str,
    retry_ms: int,
    cur: int,
    n: int,
    bucket_ms: int,
    now_ms: int,
) -> Decision:
    uses = tuple(_use(st, lim, t, r, n, bucket_ms, now_ms) for st, lim, (t, r) in zip(states, limits, used, strict=True))
    return Decision(False, cur, uses, k, limit, retry_ms)


def settle(
    states: Sequence[WindowState], bucket: int, delta: int, now_ms: int, n: int, bucket_ms: int, request_id: str | None = None
) -> None:
    """Correct a charge made in `bucket` by `delta` tokens (negative: give back what was not used),
    and release the request's in-flight entries.

    While `bucket` is still in the window the correction goes there (never below 0); once it has
    left, a refund is moot and an extra charge goes to the current bucket. A paced scope's bucket
    gets the refund back (up to `burst`) or pays the extra. `request_id` (when given) leaves the
    in-flight set; its hold time moves the scope's mean hold time by 1/8 of the difference.
    """
    cur = now_ms // bucket_ms
    for st in states:
        if delta:
            if bucket > cur - n:
                counts = st.buckets.setdefault(bucket, [0, 0])
                counts[0] = max(0, counts[0] + delta)
            elif delta > 0:
                st.buckets.setdefault(cur, [0, 0])[0] += delta
            if st.refill(now_ms) is not None:
                st.level = min(st.burst * LEVEL_SCALE, st.level - delta * LEVEL_SCALE)  # type: ignore[operator]
        if request_id is not None:
            admitted = st.inflight.pop(request_id, None)
            if admitted is not None:
                st.hold_ms += (max(0, now_ms - admitted) - st.hold_ms) // 8
