"""The limiter: cost, refusals (429 / 400), settlement from usage, and Redis failures."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal

import orjson
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from extproc.errors import NoEndpointError
from extproc.metrics import Metrics
from extproc.ratelimit.config import RateLimitConfig
from extproc.ratelimit.limiter import RateLimiter
from extproc.ratelimit.memory import MemoryBackend
from extproc.ratelimit.metrics import RateLimitMetrics
from extproc.ratelimit.replies import TenantRateLimitedError, TooLargeForLimitError
from extproc.ratelimit.window import ScopeLimit
from extproc.telemetry.observer import StreamObserver
from extproc.types import LLMRequest, RequestKind, TokenCount
from tests.ratelimit.conftest import redis_backend

MODEL = "m"


def _limiter(backend=None, registry=None, **cfg) -> RateLimiter:
    config = RateLimitConfig(enabled=True, **cfg)
    return RateLimiter(
        config, MemoryBackend(config.buckets) if backend is None else backend, RateLimitMetrics(Metrics(registry or CollectorRegistry())), {MODEL: (100, 1000)}
    )


def _impatient_redis_limiter(redis_server, registry, **default) -> RateLimiter:
    """A limiter on `redis_server` whose backend gives up after 100 ms (the backend's timeout and
    the config's the same), `default` its default limits."""
    return _limiter(
        redis_backend(redis_server, timeout_ms=100), registry, default=default, redis={"url": redis_server.url, "timeout_ms": 100}
    )


def _req(prompt=10, max_tokens=None, n=1, body_bytes=100) -> LLMRequest:
    return LLMRequest(
        kind=RequestKind.CHAT, model=MODEL, served_model=MODEL, prompt_tokens=TokenCount(prompt), max_tokens=max_tokens, n=n,
        body_bytes=body_bytes,  # type: ignore[arg-type]
    )


def _sample(registry, name, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_cost_is_prompt_plus_output_budget_or_size():
    lim = _limiter()
    assert lim.cost(_req(10, max_tokens=20, n=2)) == 50
    assert lim.cost(_req(10)) == 110  # the model's default_output_tokens (100)
    assert lim.cost(_req(950)) == 950 + 50  # within the context left (1000 - 950)
    # A batched completion decodes n choices for each of its prompts: 3 prompts × n=2 × 20.
    batch = dataclasses.replace(_req(30, max_tokens=20, n=2), prompt_lengths=(10, 10, 10))
    assert lim.cost(batch) == 30 + 120
    # Without max_tokens, each prompt's own context bounds its output (the largest prompt's, as
    # the router's expected output), not the batch's summed prompts: 3 × 400 tokens leave 600
    # each, so the default (100) stands for every sequence.
    long_batch = dataclasses.replace(_req(1200), prompt_lengths=(400, 400, 400))
    assert lim.cost(long_batch) == 1200 + 3 * 100
    size = _limiter(cost="size", size_cost_base=3)
    assert size.cost(_req(body_bytes=100)) == 3 + 1
    assert size.cost(_req(body_bytes=10 * 1024 + 5)) == 3 + 10


async def test_refusal_is_a_429_naming_the_limit_with_openai_headers():
    registry = CollectorRegistry()
    lim = _limiter(registry=registry, default={"tokens_per_minute": 100, "requests_per_minute": 10})
    t = lim.tenant({"authorization": "Bearer sk-secret"})
    adm = await lim.admit(t, _req(30, max_tokens=30))
    assert adm is not None and adm.charged == 60
    assert adm.headers["x-ratelimit-remaining-tokens"] == "40"
    assert adm.headers["x-ratelimit-remaining-requests"] == "9"
    assert adm.headers["x-ratelimit-reset-tokens"].endswith("s")
    with pytest.raises(TenantRateLimitedError) as exc:
        await lim.admit(t, _req(30, max_tokens=30))
    err = exc.value
    assert err.status == 429
    body = orjson.loads(err.body())["error"]
    assert body["type"] == "tokens" and body["code"] == "rate_limit_exceeded"
    assert "tokens per min (TPM): Limit 100, Used 60, Requested 60" in body["message"]
    h = err.headers()
    assert 1 <= int(h["retry-after"]) <= 60
    assert set(h) == {"retry-after", *(f"x-ratelimit-{a}-{b}" for a in ("limit", "remaining", "reset") for b in ("tokens", "requests"))}
    assert "sk-secret" not in err.message
    label = t.label
    assert _sample(registry, "llm_extproc_ratelimit_requests_total", tenant=label, outcome="refused_tokens") == 1
    assert _sample(registry, "llm_extproc_ratelimit_tokens_refused_total", tenant=label) == 60
    assert _sample(registry, "llm_extproc_ratelimit_window_tokens", tenant=label) == 60


async def test_a_request_larger_than_the_whole_limit_is_a_400():
    lim = _limiter(tenants={"acme": {"tokens_per_minute": 1000, "models": {MODEL: {"tokens_per_minute": 50}}}}, tenant_header="x-t")
    t = lim.tenant({"x-t": "acme"})
    with pytest.raises(TooLargeForLimitError) as exc:
        await lim.admit(t, _req(30, max_tokens=30))
    assert exc.value.status == 400
    assert "more than the whole limit of 50 tokens per minute for tenant acme on model m" in exc.value.message


async def test_unlimited_tenant_is_not_counted():
    lim = _limiter(tenants={"vip": {}}, tenant_header="x-t")
    assert await lim.admit(lim.tenant({"x-t": "vip"}), _req()) is None
    assert await lim.admit(lim.tenant({}), _req()) is None  # no defaults: anonymous unlimited


def _observed(chunks: list[bytes], status=200, ctype="text/event-stream") -> StreamObserver:
    obs = StreamObserver(endpoint="e", model=MODEL, request_start_ns=0)
    obs.on_response_headers(status, ctype, None, 1)
    for i, c in enumerate(chunks):
        obs.on_body_chunk(c, False, 2 + i)
    return obs


def _event(content: str | None = None, usage: dict | None = None) -> bytes:
    obj: dict = {"choices": [{"delta": {"content": content}}] if content else []}
    if usage:
        obj["usage"] = usage
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def test_settlement_uses_usage_then_events_and_gives_back_the_rest():
    lim = _limiter(default={"tokens_per_minute": 1000})
    t = lim.tenant({})
    adm = await lim.admit(t, _req(10, max_tokens=500))
    assert adm.charged == 510 and adm.settle_by_usage
    # A stream that stopped early, with usage: prompt 10 + 7 generated.
    obs = _observed([_event("a"), _event(usage={"prompt_tokens": 10, "completion_tokens": 7})])
    obs.on_end("complete")
    used = lim.used_tokens(adm, obs.result)
    assert used == 17
    lim.settle(adm, used)
    lim.settle(adm, 0)  # once only
    assert (await lim.backend.peek(lim.scopes(t, MODEL))).uses[0].tokens == 17


async def test_an_aborted_stream_settles_with_what_it_generated():
    lim = _limiter(default={"tokens_per_minute": 1000})
    adm = await lim.admit(lim.tenant({}), _req(10, max_tokens=500))
    obs = _observed([_event("a"), _event("b"), _event("c")])  # no usage, cut short
    obs.on_end("client_abort")
    assert lim.used_tokens(adm, obs.result, tokens_per_event=2.0) == 10 + 6
    # No response at all (gone while queued): the prompt; an engine error: nothing.
    silent = StreamObserver(endpoint="e", model=MODEL, request_start_ns=0)
    silent.on_end("client_abort")
    assert lim.used_tokens(adm, silent.result) == 10
    failed = _observed([b'{"error": {"message": "boom"}}'], status=500, ctype="application/json")
    failed.on_end("complete")
    assert lim.used_tokens(adm, failed.result) == 0
    # A non-streamed answer cut before its body: unknown, the reservation stands.
    cut = _observed([], ctype="application/json")
    cut.on_end("client_abort")
    assert lim.used_tokens(adm, cut.result) is None


async def test_size_cost_is_never_settled():
    lim = _limiter(cost="size", default={"tokens_per_minute": 1000})
    adm = await lim.admit(lim.tenant({}), _req(body_bytes=4096))
    assert adm.charged == 1 + 4 and not adm.settle_by_usage
    assert not lim.wants_usage(adm.tenant)
    obs = _observed([_event(usage={"prompt_tokens": 1, "completion_tokens": 1})])
    obs.on_end("complete")
    assert lim.used_tokens(adm, obs.result) is None


@pytest.mark.parametrize("on_error", ["open", "closed"])
async def test_redis_stopped_mid_test_then_back(redis_server, on_error, caplog):
    registry = CollectorRegistry()
    backend = redis_backend(redis_server, timeout_ms=100, on_error=on_error)
    lim = _limiter(backend, registry, default={"tokens_per_minute": 1000}, redis={"url": redis_server.url, "on_error": on_error, "timeout_ms": 100})
    t = lim.tenant({"x-api-key": "sk-abc"})
    try:
        adm = await lim.admit(t, _req(10, max_tokens=10))
        assert adm is not None and adm.bucket is not None
        await redis_server.stop()
        caplog.set_level(logging.WARNING, logger="extproc.ratelimit.limiter")
        for _ in range(3):
            if on_error == "open":
                a = await lim.admit(t, _req(10, max_tokens=10))
                assert a is not None and a.bucket is None and not a.headers  # admitted, uncounted
                lim.settle(a, 5)  # nothing to settle: no backend call
            else:
                with pytest.raises(NoEndpointError) as exc:
                    await lim.admit(t, _req(10, max_tokens=10))
                assert exc.value.status == 503 and exc.value.code == "rate_limiter_unavailable"
        assert _sample(registry, "llm_extproc_ratelimit_backend_errors_total", backend="redis", operation="acquire") == 3
        assert _sample(registry, "llm_extproc_ratelimit_requests_total", tenant=t.label, outcome=f"backend_error_{on_error}") == 3
        lines = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(lines) == 1, "one log line per interval, not one per request"
        assert "sk-abc" not in caplog.text
        # Back (same port, empty): decisions count again without a restart.
        await redis_server.start()
        a = await lim.admit(t, _req(10, max_tokens=10))
        assert a is not None and a.bucket is not None
        assert a.headers["x-ratelimit-remaining-tokens"] == str(1000 - 20)
    finally:
        await lim.aclose()


async def test_redis_keys_expire_by_themselves(redis_server):
    backend = redis_backend(redis_server)
    lim = _limiter(backend, default={"tokens_per_minute": 1000})
    t = lim.tenant({"x-api-key": "k"})
    adm = await lim.admit(t, _req(10, max_tokens=10))
    lim.settle(adm, 12)
    await lim.aclose()  # waits for the remote settlement
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        keys = await client.keys("*")
        assert len(keys) == 1 and b"sk" not in keys[0] and t.id.encode() in keys[0]
        ttl = await client.pttl(keys[0])
        assert 60_000 < ttl <= 61_000
        fields = await client.hgetall(keys[0])
        assert sorted(v for k, v in fields.items() if k.startswith(b"t")) == [b"12"]
    finally:
        await client.aclose()



async def test_precheck_refuses_what_cannot_fit_before_counting():
    registry = CollectorRegistry()
    lim = _limiter(registry=registry, default={"tokens_per_minute": 1000})
    t = lim.tenant({})
    await lim.precheck(t, MODEL, 500, 1, 100)  # fits: nothing raised, nothing charged
    assert (await lim.backend.peek(lim.scopes(t, MODEL))).uses[0].tokens == 0
    await lim.admit(t, _req(100, max_tokens=500))
    with pytest.raises(TenantRateLimitedError) as exc:
        await lim.precheck(t, MODEL, 500, 1, 100)  # 600 used: 1 + 500 cannot fit
    assert "Requested 550" in exc.value.message  # 100 bytes × 1 token per byte (learned) × 0.5 + 500
    await lim.precheck(t, MODEL, 300, 1, 100)  # the least cost of this one fits
    await lim.precheck(t, MODEL, 5000, 1, 100)  # larger than the limit: admit answers the 400


async def test_remote_precheck_only_for_a_tenant_refused_within_a_second(redis_server):
    now = [100.0]
    config = RateLimitConfig(enabled=True, backend="redis", default={"tokens_per_minute": 1000})
    lim = RateLimiter(config, redis_backend(redis_server), RateLimitMetrics(Metrics(CollectorRegistry())), {MODEL: (100, 1000)}, clock=lambda: now[0])
    t = lim.tenant({})
    try:
        await lim.admit(t, _req(100, max_tokens=500))
        await lim.precheck(t, MODEL, 500, 1, 100)  # not refused yet: no round trip, passes
        with pytest.raises(TenantRateLimitedError):
            await lim.admit(t, _req(100, max_tokens=500))
        with pytest.raises(TenantRateLimitedError):
            await lim.precheck(t, MODEL, 500, 1, 100)  # under pressure: checked in Redis
        now[0] += 1.5
        await lim.precheck(t, MODEL, 500, 1, 100)  # pressure forgotten
    finally:
        await lim.aclose()


async def _settled(lim: RateLimiter) -> None:
    """Wait for remote settlements (a task each); a local one is done already."""
    import asyncio

    if lim._pending:
        await asyncio.gather(*lim._pending)


async def test_the_in_flight_slot_is_released_on_abort_error_unknown_and_never_held_by_a_refusal(backend):
    registry = CollectorRegistry()
    lim = _limiter(backend, registry, default={"tokens_per_minute": 100_000, "max_concurrent_requests": 1})
    t = lim.tenant({"authorization": "Bearer sk-anything"})
    scopes = lim.scopes(t, MODEL)
    try:
        first = await lim.admit(t, _req(10, max_tokens=100))
        assert first.request_id is not None
        with pytest.raises(TenantRateLimitedError) as exc:
            await lim.admit(t, _req(10, max_tokens=100))
        body = orjson.loads(exc.value.body())["error"]
        assert body["type"] == "requests" and "requests in flight: Limit 1, In flight 1" in body["message"]
        assert exc.value.headers()["retry-after"] == "1" and "x-ratelimit-remaining-tokens" in exc.value.headers()
        with pytest.raises(TenantRateLimitedError):  # and before tokenizing
            await lim.precheck(t, MODEL, 100, 1, 100)
        assert (await lim.backend.peek(scopes)).uses[0].inflight == 1  # refusals hold nothing
        assert _sample(registry, "llm_extproc_ratelimit_requests_total", tenant=t.label, outcome="refused_concurrency") == 2
        # Ends: a client abort mid-stream, an engine error, an answer of unknown cost.
        aborted = _observed([_event("a"), _event("b")])
        aborted.on_end("client_abort")
        failed = _observed([b'{"error": {"message": "boom"}}'], status=500, ctype="application/json")
        failed.on_end("complete")
        cut = _observed([], ctype="application/json")
        cut.on_end("client_abort")
        adm = first
        for result in (aborted.result, failed.result, cut.result):
            assert _sample(registry, "llm_extproc_ratelimit_inflight_requests", tenant=t.label) == 1
            lim.settle(adm, lim.used_tokens(adm, result))
            await _settled(lim)
            assert (await lim.backend.peek(scopes)).uses[0].inflight == 0
            # The gauge follows the end too (it stayed at the last decision's count: phantom load).
            assert _sample(registry, "llm_extproc_ratelimit_inflight_requests", tenant=t.label) == 0
            adm = await lim.admit(t, _req(10, max_tokens=100))  # the slot is free again
        assert (await lim.backend.peek(scopes)).uses[0].tokens == 12 + 0 + 110 + 110
    finally:
        await lim.aclose()


async def test_a_paced_refusal_says_when_the_bucket_will_admit():
    # A frozen clock: at 1,000 tokens per second a millisecond between the two admits (a loaded
    # machine) refills a token and the message says "Available 1".
    config = RateLimitConfig(enabled=True, default={"tokens_per_minute": 60_000, "burst_tokens": 1_000})
    lim = _limiter(MemoryBackend(config.buckets, clock_ms=lambda: 1_000_000), default={"tokens_per_minute": 60_000, "burst_tokens": 1_000})
    t = lim.tenant({})
    adm = await lim.admit(t, _req(100, max_tokens=900))
    assert adm.headers["x-ratelimit-remaining-tokens"] == "0"  # the bucket's, not the window's 59,000
    with pytest.raises(TenantRateLimitedError) as exc:
        await lim.admit(t, _req(100, max_tokens=400))
    assert "paced (TPM 60000, burst 1000): Available 0, Requested 500" in exc.value.message
    assert orjson.loads(exc.value.body())["error"]["type"] == "tokens"
    assert exc.value.retry_after_s == pytest.approx(0.5, abs=0.01)  # 500 tokens at 1,000 per second
    lim.settle(adm, 150)  # used 150 of 1,000: 850 back in the bucket
    assert (await lim.admit(t, _req(100, max_tokens=400))) is not None


async def test_redis_keys_holding_requests_in_flight_or_a_refilling_bucket_outlive_the_window(redis_server):
    backend = redis_backend(redis_server)
    lim = _limiter(backend, default={"tokens_per_minute": 1000, "max_concurrent_requests": 2, "burst_tokens": 100}, inflight_lease_s=300)
    t = lim.tenant({})
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        adm = await lim.admit(t, _req(10, max_tokens=10))
        (key,) = await client.keys("*")
        assert 60_000 < await client.pttl(key) <= 900_000  # the backend's lease (the fixture's default)
        lim.settle(adm, 20)
        await _settled(lim)
        # Nobody in flight; the bucket (80 of 100) refills in 1.2 s: the window's expiry again.
        assert 60_000 < await client.pttl(key) <= 61_000
    finally:
        await client.aclose()
        await lim.aclose()


async def test_precheck_at_the_headers_refuses_only_a_tenant_that_could_admit_nothing():
    registry = CollectorRegistry()
    lim = _limiter(registry=registry, default={"tokens_per_minute": 1000, "max_concurrent_requests": 2}, tenants={"m": {"models": {MODEL: {"tokens_per_minute": 10}}}}, tenant_header="x-t")
    t = lim.tenant({})
    await lim.precheck_headers(t)
    a = await lim.admit(t, _req(100, max_tokens=800))
    await lim.precheck_headers(t)  # 100 tokens left, one slot left: a small request could pass
    b = await lim.admit(t, _req(50, max_tokens=10))
    with pytest.raises(TenantRateLimitedError) as exc:  # both slots held
        await lim.precheck_headers(t)
    assert "requests in flight" in exc.value.message
    # Refused before its body: a request counted, no tokens (it read as 1 token per refusal).
    assert _sample(registry, "llm_extproc_ratelimit_requests_total", tenant=t.label, outcome="refused_concurrency") == 1
    assert _sample(registry, "llm_extproc_ratelimit_tokens_refused_total", tenant=t.label) == 0
    lim.settle(b, 60)
    await lim.precheck_headers(t)
    lim.settle(a, None)  # keeps its 900: the window holds 960 of 1000, a 1-token request fits
    await lim.precheck_headers(t)
    c = await lim.admit(t, _req(30, max_tokens=10))
    lim.settle(c, 40)
    with pytest.raises(TenantRateLimitedError):  # 1000 of 1000: nothing fits
        await lim.precheck_headers(t)
    # Per-model limits are not known before the body names the model: only the tenant's scope.
    m = lim.tenant({"x-t": "m"})
    await lim.admit(m, _req(5, max_tokens=5))
    await lim.precheck_headers(m)


async def test_precheck_estimates_the_prompt_from_the_tenants_sparsest_bytes_per_token():
    lim = _limiter(default={"tokens_per_minute": 1000})
    t = lim.tenant({})
    await lim.admit(t, _req(100, max_tokens=500, body_bytes=400))  # 0.25 tokens per byte; 600 used
    # A 4,000-byte body: at least 4000 × 0.25 × 0.5 = 500 prompt tokens + 10: cannot fit in 400.
    with pytest.raises(TenantRateLimitedError) as exc:
        await lim.precheck(t, MODEL, 10, 1, 4000)
    assert "Requested 510" in exc.value.message
    await lim.precheck(t, MODEL, 10, 1, 400)  # 50 + 10 fits
    # A sparser request (more bytes per token) lowers the estimate for the tenant from then on.
    await lim.admit(t, _req(10, max_tokens=10, body_bytes=400))  # 0.025 tokens per byte
    await lim.precheck(t, MODEL, 10, 1, 4000)  # 50 + 10 fits in the 380 left
    # Each tenant learns its own: this one's sparse request puts its estimate near 0 (1 token).
    fresh = lim.tenant({"authorization": "Bearer sk-new"})
    await lim.admit(fresh, _req(980, max_tokens=10, body_bytes=1_000_000))  # 0.00098 per byte
    with pytest.raises(TenantRateLimitedError) as exc:
        await lim.precheck(fresh, MODEL, 10, 1, 100)
    assert "Requested 11" in exc.value.message


async def _kill_clients(server) -> None:
    """`CLIENT KILL TYPE normal` from a client of its own (what Redis's idle `timeout`, a proxy,
    or an operator does to the limiter's pooled connections)."""
    admin = aioredis.Redis.from_url(server.url)
    try:
        await admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    finally:
        await admin.aclose()


async def test_a_dropped_pooled_connection_before_settlement_does_not_hold_the_slot(redis_server):
    """The limiter's pooled connections are killed between admission and settlement: the
    settlement goes through on a fresh connection, so a cap-1 tenant's next request is admitted
    (not refused for the 900 s lease); the same for the give-back of a cancelled admission."""
    registry = CollectorRegistry()
    lim = _limiter(redis_backend(redis_server), registry, default={"tokens_per_minute": 100_000, "max_concurrent_requests": 1})
    t = lim.tenant({"authorization": "Bearer sk-anything"})
    scopes = lim.scopes(t, MODEL)
    try:
        adm = await lim.admit(t, _req(10, max_tokens=100))
        await _kill_clients(redis_server)
        lim.settle(adm, 50)
        await _settled(lim)
        assert (await lim.backend.peek(scopes)).uses[0].inflight == 0
        adm = await lim.admit(t, _req(10, max_tokens=100))  # admitted: the slot came back
        assert adm is not None and adm.bucket is not None
        # A give-back (what a cancelled admission's undo sends) on a pool whose connections died.
        await _kill_clients(redis_server)
        await lim.backend.settle(adm.keys, adm.bucket, -adm.charged, request_id=adm.request_id)
        assert (await lim.backend.peek(scopes)).uses[0].inflight == 0
        assert _sample(registry, "llm_extproc_ratelimit_backend_errors_total", backend="redis", operation="settle") == 0
    finally:
        await lim.aclose()


async def test_a_settlement_redis_cannot_take_waits_and_is_delivered_before_the_next_decision(redis_server):
    """Redis holds every script (`CLIENT PAUSE ... WRITE`) past the settlement's timeout: the
    settlement is kept (counted, not lost) and delivered before the next decision once Redis
    answers, so a cap-1 tenant's next request is admitted rather than refused for the lease."""
    registry = CollectorRegistry()
    lim = _impatient_redis_limiter(redis_server, registry, tokens_per_minute=100_000, max_concurrent_requests=1)
    t = lim.tenant({"authorization": "Bearer sk-anything"})
    scopes = lim.scopes(t, MODEL)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        adm = await lim.admit(t, _req(10, max_tokens=100))
        await admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
        lim.settle(adm, 50)
        await _settled(lim)
        assert _sample(registry, "llm_extproc_ratelimit_settlements_pending") == 1
        assert _sample(registry, "llm_extproc_ratelimit_settlements_deferred_total", outcome="queued") == 1
        await admin.execute_command("CLIENT", "UNPAUSE")
        nxt = await lim.admit(t, _req(10, max_tokens=100))  # the slot came back before this decision
        assert nxt is not None and nxt.bucket is not None
        assert (await lim.backend.peek(scopes)).uses[0].inflight == 1
        assert _sample(registry, "llm_extproc_ratelimit_settlements_pending") == 0
        assert _sample(registry, "llm_extproc_ratelimit_settlements_deferred_total", outcome="flushed") == 1
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
        await lim.aclose()


async def test_a_redis_stall_holds_no_slot_after_it_ends_and_no_request_is_needed_to_free_them(redis_server):
    """Redis paused by SIGSTOP under load, cap 4: the acquires sent during the stall time out and
    fail open, yet sit in Redis's input buffer and run when it resumes; a settlement made during
    the stall cannot be delivered. Once Redis runs again, with no further request, the limiter's
    background retry delivers the settlement and aborts the timed-out acquires: nothing is in
    flight and only the settled request's tokens count (before: the late acquires held the
    tenant's slots for the 900 s lease and the settlement waited for the next admit)."""
    registry = CollectorRegistry()
    lim = _impatient_redis_limiter(redis_server, registry, tokens_per_minute=1_000_000, max_concurrent_requests=4)
    t = lim.tenant({"authorization": "Bearer sk-anything"})
    scopes = lim.scopes(t, MODEL)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.gather(*(lim.backend.peek(scopes) for _ in range(6)))  # six pooled connections
        held = await lim.admit(t, _req(10, max_tokens=100))
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            late = await asyncio.gather(*(lim.admit(t, _req(10, max_tokens=100)) for _ in range(6)))
            assert all(a is not None and a.bucket is None for a in late)  # failed open, uncounted
            lim.settle(held, 50)
            await _settled(lim)
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        assert _sample(registry, "llm_extproc_ratelimit_settlements_pending") >= 1
        deadline = loop.time() + 6.0
        while True:
            use = (await lim.backend.peek(scopes)).uses[0]
            if use.inflight == 0 and _sample(registry, "llm_extproc_ratelimit_settlements_pending") == 0:
                break
            assert loop.time() < deadline, f"still {use.inflight} in flight after the stall"
            await asyncio.sleep(0.1)
        assert use.tokens == 50  # the late acquires gave their tokens back (or never charged)
        more = [await lim.admit(t, _req(10, max_tokens=100)) for _ in range(4)]  # the whole cap is free
        assert all(a is not None and a.bucket is not None for a in more)
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
        await lim.aclose()


async def test_an_abort_gives_back_an_acquire_that_ran_and_refuses_one_that_runs_after_it(redis_server):
    """The two orders a stalled Redis can run them in: acquire then abort (slot and tokens back),
    abort then acquire (a tombstone: the late acquire charges nothing)."""
    backend = redis_backend(redis_server)
    scope = [ScopeLimit("{t}", 1000, -1, 1, -1)]
    try:
        assert (await backend.acquire(scope, 100, request_id="a")).admitted
        await backend.abort(["{t}"], 100, "a")
        assert (await backend.peek(scope)).uses[0].inflight == 0 and (await backend.peek(scope)).uses[0].tokens == 0
        await backend.abort(["{t}"], 100, "a")  # twice: harmless
        await backend.abort(["{t}"], 100, "b")
        late = await backend.acquire(scope, 100, request_id="b")
        assert not late.admitted
        use = (await backend.peek(scope)).uses[0]
        assert use.inflight == 0 and use.tokens == 0
        assert (await backend.acquire(scope, 100, request_id="c")).admitted  # others unaffected
    finally:
        await backend.aclose()


async def test_a_429_gives_one_wait_in_body_reset_header_and_retry_after():
    """Charges in two buckets: the window empties one bucket after the oldest charge leaves; the
    429 names the latter everywhere (body, x-ratelimit-reset-requests, retry-after rounded up)."""
    now = [1_000_172]
    config = RateLimitConfig(enabled=True, default={"requests_per_minute": 2})
    backend = MemoryBackend(config.buckets, clock_ms=lambda: now[0])
    lim = RateLimiter(config, backend, RateLimitMetrics(Metrics(CollectorRegistry())), {MODEL: (100, 1000)})
    t = lim.tenant({"authorization": "Bearer sk-secret"})
    first = await lim.admit(t, _req())
    assert first is not None and first.headers["x-ratelimit-reset-requests"] == "59.828s"  # until bucket 1000+60
    now[0] += 1_000
    second = await lim.admit(t, _req())
    # Admitted in a new bucket: the time until the window is empty restarts (~60 s again).
    assert second is not None and second.headers["x-ratelimit-reset-requests"] == "59.828s"
    with pytest.raises(TenantRateLimitedError) as exc:
        await lim.admit(t, _req())
    h = exc.value.headers()
    message = orjson.loads(exc.value.body())["error"]["message"]
    assert "Please try again in 58.828s." in message  # the first charge leaves first
    assert h["x-ratelimit-reset-requests"] == "58.828s"
    assert h["retry-after"] == "59"
