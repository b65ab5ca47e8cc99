"""A closed loop of 1k-token prompts at concurrency 1, 64 and 256 against one simulator.

What a mock with a per-request sleep cannot do: inter-token latency (from `/metrics`, simulated
seconds) rises with the batch, the KV pool fills and requests wait, and the engine's request
and token counters equal what the client counted.

Sizes: each request is 1,024 prompt tokens + 32 output tokens = 66 blocks, so a pool of 10,000
blocks holds ~150 requests: concurrency 64 fits, 256 does not (waiting > 0, usage > 0.9).
Prompts are token ids (`/v1/completions` accepts them), so the client spends no CPU on
tokenization and keeps the offered concurrency up: the engine, not the client, must be the
bottleneck for the batch to grow.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from extproc.sim.workload import synthetic_prompt_ids

PROMPT = 1024
OUTPUT = 32
BLOCKS = 10_000
PHASES = {1: 6, 64: 128, 256: 512}  # concurrency -> requests


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """{sample name: value} of the unlabelled-by-reason samples, plus request_success by reason."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (f"/{s.labels['finished_reason']}" if "finished_reason" in s.labels else "")
            if "le" not in s.labels:
                out[key] = s.value
    return out


async def test_closed_loop_load_shows_batching_kv_pressure_and_exact_counters(start_sim, http) -> None:
    sim = await start_sim(speed=4.0, num_gpu_blocks=BLOCKS)
    rng = random.Random(0)
    prompts = [synthetic_prompt_ids(PROMPT, rng) for _ in range(sum(PHASES.values()))]
    client = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    next_prompt = iter(prompts)

    async def one() -> None:
        body = {"prompt": next(next_prompt), "max_tokens": OUTPUT, "ignore_eos": True}
        async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps(body)) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
        assert usage["completion_tokens"] == OUTPUT and usage["prompt_tokens"] == PROMPT
        client["requests"] += 1
        client["prompt_tokens"] += usage["prompt_tokens"]
        client["completion_tokens"] += usage["completion_tokens"]

    async def closed_loop(concurrency: int, total: int) -> None:
        left = [total]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                await one()

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    itl: dict[int, float] = {}
    peaks: dict[str, float] = {"waiting": 0.0, "kv": 0.0}
    for concurrency, total in PHASES.items():
        before = await scrape(http, sim.url)
        sampling = asyncio.Event()

        async def sampler(stop: asyncio.Event) -> None:
            while not stop.is_set():
                m = await scrape(http, sim.url)
                peaks["waiting"] = max(peaks["waiting"], m["vllm:num_requests_waiting"])
                peaks["kv"] = max(peaks["kv"], m["vllm:kv_cache_usage_perc"])
                await asyncio.sleep(0.02)

        probe: Any = asyncio.create_task(sampler(sampling)) if concurrency == 256 else None
        await asyncio.wait_for(closed_loop(concurrency, total), timeout=90)
        if probe is not None:
            sampling.set()
            await probe
        after = await scrape(http, sim.url)
        n = after["vllm:inter_token_latency_seconds_count"] - before["vllm:inter_token_latency_seconds_count"]
        s = after["vllm:inter_token_latency_seconds_sum"] - before["vllm:inter_token_latency_seconds_sum"]
        assert n == total * (OUTPUT - 1)
        itl[concurrency] = s / n

    # Decode slows as the batch grows (d·Σctx, and prefills of newcomers share the steps).
    assert itl[1] < itl[64] < itl[256]
    assert itl[256] >= 2 * itl[1], itl
    # The pool fills and requests queue at concurrency 256.
    assert peaks["waiting"] > 0 and peaks["kv"] > 0.9, peaks
    # Every request completed; the engine counted what the client counted.
    final = await scrape(http, sim.url)
    assert client["requests"] == sum(PHASES.values())
    assert final["vllm:request_success_total/length"] == client["requests"]
    assert final["vllm:prompt_tokens_total"] == client["prompt_tokens"]
    assert final["vllm:generation_tokens_total"] == client["completion_tokens"]
    assert final["vllm:num_requests_running"] == 0 and final["vllm:num_requests_waiting"] == 0
