"""One suite, both backends (`backend` fixture: memory, then Redis on a real redis-server):
the same answers at bucket edges, across the slide, on settlement and under concurrency."""

from __future__ import annotations

import asyncio

from extproc.ratelimit.window import LEASE_MS, ScopeLimit

BASE = 1_700_000_000_000  # an epoch in ms, as Redis's TIME gives; a multiple of 1000


async def test_edges_and_slide(backend):
    lim = [ScopeLimit("{a}", tokens=100, requests=1000)]
    d = await backend.acquire(lim, 60, BASE + 999)
    assert d.admitted and d.uses[0].tokens == 60 and d.uses[0].requests == 1
    assert d.uses[0].reset_tokens_ms == 60_000 - 999
    assert (await backend.acquire(lim, 40, BASE + 30_000)).admitted
    d = await backend.acquire(lim, 1, BASE + 59_999)
    assert not d.admitted and d.refused_limit == "tokens" and d.refused_scope == 0
    assert d.retry_after_ms == 1 and d.uses[0].tokens == 100
    d = await backend.acquire(lim, 60, BASE + 60_000)  # bucket of the first charge left
    assert d.admitted and d.uses[0].tokens == 100
    d = await backend.acquire(lim, 1, BASE + 60_000)
    assert not d.admitted and d.retry_after_ms == 30_000


async def test_requests_limit(backend):
    lim = [ScopeLimit("{r}", requests=3)]
    for i in range(3):
        assert (await backend.acquire(lim, 0, BASE + i)).admitted
    d = await backend.acquire(lim, 0, BASE + 500)
    assert not d.admitted and d.refused_limit == "requests" and d.retry_after_ms == 59_500
    assert d.uses[0].requests == 3 and d.uses[0].reset_requests_ms == 59_500


async def test_scopes_are_charged_together_or_not_at_all(backend):
    lim = [ScopeLimit("{t}", tokens=1000), ScopeLimit("{t}:m", tokens=50)]
    assert (await backend.acquire(lim, 50, BASE)).admitted
    d = await backend.acquire(lim, 10, BASE)
    assert not d.admitted and d.refused_scope == 1
    peek = await backend.peek(lim, BASE)
    assert [u.tokens for u in peek.uses] == [50, 50]
    # The other model's scope is independent; the tenant scope saw only admitted charges.
    d = await backend.acquire([ScopeLimit("{t}", tokens=1000), ScopeLimit("{t}:other", tokens=50)], 10, BASE)
    assert d.admitted and [u.tokens for u in d.uses] == [60, 10]


async def test_settle_returns_unused_tokens(backend):
    lim = [ScopeLimit("{s}", tokens=100)]
    d = await backend.acquire(lim, 100, BASE + 100)
    assert not (await backend.acquire(lim, 1, BASE + 200)).admitted
    await backend.settle(["{s}"], d.bucket, -75, BASE + 2_000)
    assert (await backend.peek(lim, BASE + 2_000)).uses[0].tokens == 25
    assert (await backend.acquire(lim, 75, BASE + 2_000)).admitted
    # Extra use after the charged bucket left the window is charged to the current bucket.
    await backend.settle(["{s}"], d.bucket, 5, BASE + 60_500)
    assert (await backend.peek(lim, BASE + 60_500)).uses[0].tokens == 75 + 5
    # A refund never drives a bucket below zero.
    d2 = await backend.acquire(lim, 10, BASE + 61_000)
    await backend.settle(["{s}"], d2.bucket, -1_000, BASE + 61_000)
    assert (await backend.peek(lim, BASE + 61_000)).uses[0].tokens == 80


async def test_unlimited_scope_is_counted_but_never_refuses(backend):
    lim = [ScopeLimit("{u}")]
    for _ in range(5):
        d = await backend.acquire(lim, 1_000_000, BASE)
        assert d.admitted
    assert d.uses[0].tokens == 5_000_000


async def test_fifty_concurrent_requests_never_exceed_the_limit(backend):
    limit, cost = 1_000, 37
    lim = [ScopeLimit("{c}", tokens=limit)]
    results = await asyncio.gather(*(backend.acquire(lim, cost, BASE + i) for i in range(50)))
    admitted = sum(d.admitted for d in results)
    assert admitted == limit // cost  # 27: every one that fits, none more
    used = (await backend.peek(lim, BASE + 100)).uses[0].tokens
    assert used == admitted * cost <= limit


async def test_backend_clock_without_explicit_time(backend):
    lim = [ScopeLimit("{clock}", tokens=10)]
    first = await backend.acquire(lim, 10)
    assert first.admitted and 59_000 <= first.uses[0].reset_tokens_ms <= 60_000
    d = await backend.acquire(lim, 1)
    assert not d.admitted and 0 < d.retry_after_ms <= 60_000
    await backend.settle(["{clock}"], first.bucket, -10)
    assert (await backend.acquire(lim, 10)).admitted


async def test_check_answers_like_acquire_but_charges_nothing(backend):
    lim = [ScopeLimit("{k}", tokens=100, requests=5)]
    assert (await backend.acquire(lim, 60, BASE)).admitted
    assert (await backend.check(lim, 40, BASE + 10)).admitted
    d = await backend.check(lim, 41, BASE + 10)
    assert not d.admitted and d.refused_limit == "tokens" and d.retry_after_ms == 60_000 - 10
    assert (await backend.peek(lim, BASE + 10)).uses[0].tokens == 60
    assert (await backend.peek(lim, BASE + 10)).uses[0].requests == 1


async def test_every_backend_offers_the_whole_interface(backend):
    from extproc.ratelimit.backend import WindowBackend

    wanted = {n for n in vars(WindowBackend) if not n.startswith("_")} - {"name", "local"}
    assert wanted == {"acquire", "check", "settle", "abort", "peek", "aclose"}
    for n in wanted:
        assert callable(getattr(backend, n)), n
    assert backend.name in ("memory", "redis") and backend.local == (backend.name == "memory")


# -- concurrency cap and pacing (decision 0190): the same answers from both backends ------------


async def test_concurrency_cap_admits_up_to_the_cap_and_settlement_frees_a_slot(backend):
    lim = [ScopeLimit("{cc}", concurrent=2)]
    assert (await backend.acquire(lim, 10, BASE, request_id="r1")).admitted
    d = await backend.acquire(lim, 10, BASE, request_id="r2")
    assert d.admitted and d.uses[0].inflight == 2
    d = await backend.acquire(lim, 10, BASE + 1, request_id="r3")
    # Refused; retry-after: the mean hold time (1 s before any ended) / requests in flight = 500 ms,
    # but both were admitted 1 ms ago: the oldest still needs 999 ms at the mean hold.
    assert not d.admitted and d.refused_limit == "concurrency" and d.retry_after_ms == 999 and d.uses[0].inflight == 2
    assert (await backend.check(lim, 10, BASE + 1)).refused_limit == "concurrency"
    # A refusal holds nothing; settlement (with or without a token correction) releases.
    await backend.settle(["{cc}"], d.bucket, 0, BASE + 3_000, request_id="r1")
    assert (await backend.peek(lim, BASE + 3_000)).uses[0].inflight == 1
    assert (await backend.acquire(lim, 10, BASE + 3_000, request_id="r3")).admitted
    d = await backend.acquire(lim, 10, BASE + 3_000, request_id="r4")
    # r1 was held 3 s: mean 1000 + (3000 - 1000) / 8 = 1250 ms; / 2 in flight.
    assert not d.admitted and d.retry_after_ms == 625
    # Settling an id twice, or one never admitted, changes nothing.
    await backend.settle(["{cc}"], d.bucket, 0, BASE + 3_000, request_id="r1")
    await backend.settle(["{cc}"], d.bucket, 0, BASE + 3_000, request_id="nope")
    assert (await backend.peek(lim, BASE + 3_000)).uses[0].inflight == 2


async def test_an_unsettled_request_stops_counting_after_its_lease(backend):
    from extproc.ratelimit.window import LEASE_MS

    lim = [ScopeLimit("{lease}", concurrent=1)]
    assert (await backend.acquire(lim, 1, BASE, request_id="lost")).admitted  # its replica died
    assert not (await backend.acquire(lim, 1, BASE + LEASE_MS - 1, request_id="b")).admitted
    assert (await backend.acquire(lim, 1, BASE + LEASE_MS, request_id="b")).admitted


async def test_a_concurrency_retry_after_never_outlasts_the_oldest_lease(backend):
    """A slot held near the end of its lease (its settlement lost, say) frees when the lease
    ends: the retry-after says no later than that, and no sooner than 1 ms."""
    lim = [ScopeLimit("{lease}", concurrent=1)]
    assert (await backend.acquire(lim, 10, BASE, request_id="r1")).admitted
    d = await backend.acquire(lim, 10, BASE + LEASE_MS - 400, request_id="r2")
    assert not d.admitted and d.refused_limit == "concurrency" and d.retry_after_ms == 400
    d = await backend.acquire(lim, 10, BASE + 10, request_id="r2")
    assert not d.admitted and d.retry_after_ms == 1_000  # far from the lease's end: the mean hold / 1
    assert (await backend.acquire(lim, 10, BASE + LEASE_MS, request_id="r2")).admitted  # the lease ended


async def test_fifty_concurrent_acquires_never_exceed_the_concurrency_cap(backend):
    lim = [ScopeLimit("{c50}", concurrent=5)]
    results = await asyncio.gather(*(backend.acquire(lim, 1, BASE + i, request_id=f"q{i}") for i in range(50)))
    assert sum(d.admitted for d in results) == 5
    assert (await backend.peek(lim, BASE + 100)).uses[0].inflight == 5


async def test_pacing_spreads_the_minute_and_a_large_request_waits_for_a_full_bucket(backend):
    lim = [ScopeLimit("{p}", tokens=60_000, burst=5_000)]  # refills 1,000 tokens per second
    d = await backend.acquire(lim, 3_000, BASE)
    assert d.admitted and d.uses[0].bucket_tokens == 2_000 and d.uses[0].tokens == 3_000
    d = await backend.acquire(lim, 3_000, BASE)
    assert not d.admitted and d.refused_limit == "pacing" and d.retry_after_ms == 1_000
    assert d.uses[0].tokens == 3_000  # the window has room: pacing refused
    assert not (await backend.acquire(lim, 3_000, BASE + 999)).admitted
    d = await backend.acquire(lim, 3_000, BASE + 1_000)
    assert d.admitted and d.uses[0].bucket_tokens == 0
    # Larger than the burst: admitted on a full bucket (5 s of refill), which it leaves in debt.
    d = await backend.acquire(lim, 8_000, BASE + 1_000)
    assert not d.admitted and d.retry_after_ms == 5_000
    d = await backend.acquire(lim, 8_000, BASE + 6_000)
    assert d.admitted and d.uses[0].bucket_tokens == -3_000
    d = await backend.check(lim, 1, BASE + 6_000)
    assert not d.admitted and d.retry_after_ms == 3_001  # the debt, then one token
    assert (await backend.peek(lim, BASE + 7_500)).uses[0].bucket_tokens == -1_500


async def test_settlement_puts_unused_tokens_back_in_the_bucket_up_to_the_burst(backend):
    lim = [ScopeLimit("{ps}", tokens=60_000, burst=5_000)]
    d = await backend.acquire(lim, 5_000, BASE)
    assert not (await backend.check(lim, 4_000, BASE)).admitted
    await backend.settle(["{ps}"], d.bucket, -4_000, BASE)  # used 1,000 of 5,000
    assert (await backend.peek(lim, BASE)).uses[0].bucket_tokens == 4_000
    await backend.settle(["{ps}"], d.bucket, -1_000, BASE + 2_000)
    assert (await backend.peek(lim, BASE + 2_000)).uses[0].bucket_tokens == 5_000  # never above the burst
    await backend.settle(["{ps}"], d.bucket, 2_500, BASE + 2_000)  # used more than reserved: pays
    peek = (await backend.peek(lim, BASE + 2_000)).uses[0]
    assert peek.bucket_tokens == 2_500 and peek.tokens == 2_500


async def test_all_controls_together_charge_all_scopes_or_none(backend):
    lim = [ScopeLimit("{all}", tokens=60_000, concurrent=3, burst=10_000), ScopeLimit("{all}:m", tokens=60_000, burst=2_000)]
    assert (await backend.acquire(lim, 2_000, BASE, request_id="a")).admitted
    d = await backend.acquire(lim, 1_000, BASE, request_id="b")
    assert not d.admitted and d.refused_scope == 1 and d.refused_limit == "pacing"
    peek = await backend.peek(lim, BASE)
    assert [u.bucket_tokens for u in peek.uses] == [8_000, 0] and [u.inflight for u in peek.uses] == [1, 0]
    try:
        await backend.acquire(lim, 1, BASE + 5_000)
    except ValueError as exc:
        assert "request" in str(exc)
    else:
        raise AssertionError("a capped scope without a request id must be refused as a programming error")
