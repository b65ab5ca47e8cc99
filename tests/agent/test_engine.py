"""`EngineProbe` against a fake vLLM node: load figures, TTFT P95 over the window, health."""

from __future__ import annotations

import asyncio

import pytest

from extproc.agent.engine import EngineProbe
from tests.agent.agent_helpers import FakeEngine


@pytest.fixture
async def probe(engine: FakeEngine):
    p = EngineProbe(engine.url, timeout_s=1.0, latency_window_s=60.0, unhealthy_after=2)
    await p.start()
    yield p
    await p.aclose()


@pytest.mark.parametrize("legacy", [False, True], ids=["kv_cache_usage_perc", "gpu_cache_usage_perc"])
async def test_load_figures_from_both_vllm_generations(engine: FakeEngine, probe: EngineProbe, legacy: bool) -> None:
    engine.legacy = legacy
    engine.running, engine.waiting, engine.kv_usage = 7, 3, 0.25
    s = await probe.sample()
    assert (s.reachable, s.healthy, s.metrics_error, s.health_error) == (True, True, None, None)
    assert (s.running, s.waiting, s.kv_usage) == (7, 3, 0.25)
    # 1000 blocks, a quarter in use → 750 free.
    assert (s.kv_blocks_total, s.kv_blocks_free, s.block_size) == (1000, 750, 16)
    assert s.kv_free_fraction == pytest.approx(0.75)


async def test_ttft_p95_comes_from_bucket_deltas_not_the_lifetime_histogram(engine: FakeEngine, probe: EngineProbe) -> None:
    engine.observe_ttft(4.0, n=1000)  # an old slow period, before the agent's first scrape
    first = await probe.sample()
    assert first.ttft_p95_ms is None  # one scrape: no delta yet
    engine.observe_ttft(0.02, n=100)  # all recent requests land in the (0.01, 0.025] bucket
    s = await probe.sample()
    # Rank 95 of 100 in (10 ms, 25 ms], linear interpolation: 10 + 15 × 95/100 = 24.25 ms.
    assert s.ttft_p95_ms == pytest.approx(24.25)
    idle = await probe.sample()  # the window still starts at the first scrape
    assert idle.ttft_p95_ms == pytest.approx(24.25)


async def test_window_slides_past_old_observations(engine: FakeEngine) -> None:
    probe = EngineProbe(engine.url, latency_window_s=0.2)
    await probe.start()
    try:
        await probe.sample()
        engine.observe_ttft(2.0, n=50)  # slow burst
        slow = await probe.sample()
        assert slow.ttft_p95_ms is not None and slow.ttft_p95_ms > 1000
        await asyncio.sleep(0.3)
        await probe.sample()  # now at least one window after the burst
        engine.observe_ttft(0.04, n=20)
        await asyncio.sleep(0.3)
        fast = await probe.sample()
        assert fast.ttft_p95_ms is not None and fast.ttft_p95_ms <= 50
    finally:
        await probe.aclose()


async def test_engine_restart_resets_the_window(engine: FakeEngine, probe: EngineProbe) -> None:
    engine.observe_ttft(0.5, n=10)
    await probe.sample()
    engine.ttft_counts.clear()  # counters start from zero again
    s = await probe.sample()
    assert s.ttft_p95_ms is None  # no negative deltas, no bogus quantile
    engine.observe_ttft(0.08, n=10)
    s = await probe.sample()
    assert s.ttft_p95_ms is not None and 50 < s.ttft_p95_ms <= 100


async def test_health_flips_after_consecutive_failures_and_back_after_one_success(
    engine: FakeEngine, probe: EngineProbe
) -> None:
    assert (await probe.sample()).healthy
    engine.health_status = 503
    one = await probe.sample()
    assert one.healthy and one.health_error == "/health: status 503"  # 1 of 2 failures
    assert not (await probe.sample()).healthy
    engine.health_status = 200
    assert (await probe.sample()).healthy


async def test_metrics_failing_alone_is_not_unhealthy(engine: FakeEngine, probe: EngineProbe) -> None:
    engine.metrics_status = 500
    s = await probe.sample()
    assert (s.reachable, s.healthy, s.metrics_error) == (False, True, "/metrics: status 500")
    assert s.kv_blocks_total is None


async def test_unreachable_engine_is_unhealthy_from_the_first_probe(engine: FakeEngine) -> None:
    url = engine.url
    await engine.aclose()
    probe = EngineProbe(url, timeout_s=0.5)
    await probe.start()
    try:
        s = await probe.sample()
    finally:
        await probe.aclose()
    assert not s.reachable and not s.healthy
    assert s.health_error is not None and s.health_error.startswith("/health: ")
