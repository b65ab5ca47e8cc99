"""Parsing vLLM's /metrics (both generations) and the scraper's staleness behaviour."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.scraper import MetricsScraper, histogram_quantile, parse_vllm_metrics

from .conftest import serve_get

MODERN = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.42
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="25000"} 1.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 250.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="Qwen/Qwen3-8B"} 10.0
vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="Qwen/Qwen3-8B"} 20.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen3-8B"} 20.0
vllm:time_to_first_token_seconds_count{model_name="Qwen/Qwen3-8B"} 20.0
vllm:time_to_first_token_seconds_sum{model_name="Qwen/Qwen3-8B"} 3.0
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="Qwen/Qwen3-8B"} 5.0
"""

LEGACY = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 2.0
vllm:num_requests_running{model_name="b"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="a"} 0.9
"""


def test_modern_names():
    m = parse_vllm_metrics(MODERN)
    assert (m.running, m.waiting, m.kv_usage, m.num_gpu_blocks, m.block_size) == (7, 3, 0.42, 25000, 16)
    assert (m.prefix_queries, m.prefix_hits) == (1000.0, 250.0)
    assert m.free_blocks == 14500  # 25000 × (1 − 0.42)
    assert m.ttft_p95_s is None  # needs two scrapes


def test_legacy_names_and_summing_over_models():
    m = parse_vllm_metrics(LEGACY)
    assert (m.running, m.waiting, m.kv_usage, m.num_gpu_blocks, m.free_blocks) == (3, 0, 0.9, None, None)


def test_ttft_p95_from_bucket_deltas():
    first = parse_vllm_metrics(MODERN)
    later = MODERN.replace('le="0.1",model_name="Qwen/Qwen3-8B"} 10.0', 'le="0.1",model_name="Qwen/Qwen3-8B"} 10.0')
    later = later.replace('le="0.5",model_name="Qwen/Qwen3-8B"} 20.0', 'le="0.5",model_name="Qwen/Qwen3-8B"} 40.0')
    later = later.replace('le="+Inf",model_name="Qwen/Qwen3-8B"} 20.0', 'le="+Inf",model_name="Qwen/Qwen3-8B"} 40.0')
    second = parse_vllm_metrics(later, first)
    # 20 new observations, all in (0.1, 0.5]: p95 = 0.1 + 0.4 · 19/20 = 0.48 s
    assert second.ttft_p95_s == pytest.approx(0.48)


def test_histogram_quantile():
    assert histogram_quantile(0.5, {}) is None
    assert histogram_quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert histogram_quantile(0.5, {1.0: 10.0, 2.0: 20.0, float("inf"): 20.0}) == pytest.approx(1.0)


def test_malformed_exposition_is_an_error():
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:num_requests_waiting{model_name=\"a\" oops\n")


async def test_hanging_metrics_age_into_staleness_and_recover():
    answering = asyncio.Event()  # cleared: every scrape hangs (past the scraper's timeout) until set again
    answering.set()

    async def metrics(request):
        await asyncio.wait({asyncio.ensure_future(answering.wait())}, timeout=5)
        return web.Response(text=MODERN)

    async def until(predicate, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, "condition not reached in time"
            await asyncio.sleep(0.02)

    runner, port = await serve_get("/metrics", metrics)
    store = Datastore([EndpointConfig(address=f"127.0.0.1:{port}", models=["m"])])
    ep = store.all()[0]
    results = []
    scraper = MetricsScraper(store, interval_s=0.05, timeout_s=0.2, on_scrape=lambda e, ok, s: results.append(ok))
    try:
        await scraper.start()
        assert ep.engine is not None and ep.engine.waiting == 3
        answering.clear()
        await until(lambda: ep.metrics_age(time.monotonic()) > 0.5)  # the old snapshot ages
        assert results[-1] is False
        answering.set()  # the hung scrapes answer late; the next ones in time
        await until(lambda: results[-1] is True)
        assert ep.metrics_age(time.monotonic()) < 0.3
    finally:
        await scraper.aclose()
        await runner.cleanup()


@pytest.mark.parametrize("bad", ["-5", "0", "inf", "-inf", "nan", "1e400", "0.5", "many"])
def test_cache_config_values_that_are_not_positive_counts_are_unknown(bad):
    # num_gpu_blocks="-5" made every request a 400 "can never fit" (the client blamed for the
    # engine's garbage); "inf" raised OverflowError, failing (and logging a traceback for)
    # every scrape of the endpoint. Unknown is what such a value tells us.
    text = f'vllm:cache_config_info{{block_size="{bad}",num_gpu_blocks="{bad}"}} 1.0\nvllm:num_requests_running 3\n'
    m = parse_vllm_metrics(text)
    assert m.block_size is None and m.num_gpu_blocks is None
    assert m.running == 3  # the rest of the scrape still counts


@pytest.mark.parametrize("gauge", ["vllm:num_requests_running", "vllm:num_requests_waiting"])
@pytest.mark.parametrize("bad", ["+Inf", "NaN", "-1"])
def test_request_gauges_that_are_not_counts_fail_the_scrape_cleanly(gauge, bad):
    # `int(inf)` raised OverflowError, which escaped the scrape's except clause and logged a
    # traceback on every scrape; a ValueError is what the scrape already treats as unreadable.
    with pytest.raises(ValueError, match=gauge):
        parse_vllm_metrics(f"{gauge} {bad}\n")


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-0.5"])
def test_kv_usage_that_is_not_a_fraction_fails_the_scrape(bad):
    with pytest.raises(ValueError, match="kv_cache_usage_perc"):
        parse_vllm_metrics(f"vllm:kv_cache_usage_perc {bad}\n")


def test_kv_usage_a_hair_above_one_is_full():
    assert parse_vllm_metrics("vllm:kv_cache_usage_perc 1.0000001\n").kv_usage == 1.0


async def test_an_exposition_past_max_bytes_fails_the_scrape_unread():
    """An engine's /metrics was read whole into memory and parsed, whatever its size: one
    series per LoRA adapter name it chose to report, say."""
    lora = "".join(f'vllm:lora_adapter_loaded{{adapter_name="junk-{i:07d}",level="gpu"}} 1\n' for i in range(20_000))

    async def metrics(request):
        return web.Response(text=MODERN + lora)

    runner, port = await serve_get("/metrics", metrics)
    store = Datastore([EndpointConfig(address=f"127.0.0.1:{port}", models=["m"])])
    ep = store.all()[0]
    scraper = MetricsScraper(store, timeout_s=5.0, max_bytes=len(MODERN) + 1000)
    try:
        scraper._session = aiohttp.ClientSession()  # scrape() alone: no background loops
        assert await scraper.scrape(ep) is False and ep.engine is None
        scraper._max_bytes = 10 * len(lora)
        assert await scraper.scrape(ep) is True and len(ep.engine.lora.gpu) == 20_000
    finally:
        await scraper.aclose()
        await runner.cleanup()
