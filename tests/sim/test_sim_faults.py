"""Each fault does what it says, can be switched on mid-run and cleared again."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

STREAM = {"prompt": "tell me a story", "max_tokens": 20, "ignore_eos": True, "stream": True}


async def set_faults(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(f"{url}/sim/faults", data=orjson.dumps(body)) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def generation_status(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(f"{url}/v1/completions", data=orjson.dumps({"prompt": "x", "max_tokens": 1})) as resp:
        await resp.read()
        return resp.status


async def test_faults_merge_show_and_clear(start_sim, http) -> None:
    sim = await start_sim()
    await set_faults(http, sim.url, {"error_rate": 0.5})
    shown = await set_faults(http, sim.url, {"health_fail": True})
    assert shown["error_rate"] == 0.5 and shown["health_fail"] is True  # merged
    async with http.get(f"{sim.url}/sim/faults") as resp:
        assert (await resp.json()) == shown
    cleared = await set_faults(http, sim.url, {})
    assert cleared["error_rate"] == 0.0 and cleared["health_fail"] is False
    await set_faults(http, sim.url, {"jitter_ms": 5})
    async with http.delete(f"{sim.url}/sim/faults") as resp:
        assert (await resp.json())["jitter_ms"] == 0.0


@pytest.mark.parametrize(
    "body",
    [{"error_rate": 2}, {"no_such_fault": True}, {"die_after_chunks": -1}],
    ids=["rate-above-1", "unknown-key", "negative-chunks"],
)
async def test_invalid_fault_update_is_400(start_sim, http, body: dict) -> None:
    sim = await start_sim()
    async with http.post(f"{sim.url}/sim/faults", data=orjson.dumps(body)) as resp:
        err = await resp.json()
    assert resp.status == 400 and err["object"] == "error"


async def test_error_rate(start_sim, http) -> None:
    sim = await start_sim()
    assert await generation_status(http, sim.url) == 200
    await set_faults(http, sim.url, {"error_rate": 1.0})
    async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps({"prompt": "x"})) as resp:
        err = await resp.json()
    assert resp.status == 500 and err["code"] == 500 and err["object"] == "error"
    await set_faults(http, sim.url, {"error_body": False})
    async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps({"prompt": "x"})) as resp:
        assert resp.status == 500 and await resp.read() == b""  # a bare 500, as a proxy may answer
    await set_faults(http, sim.url, {"error_rate": 0.0, "error_body": True})
    assert await generation_status(http, sim.url) == 200


async def test_die_mid_stream_after_n_chunks(start_sim, http) -> None:
    sim = await start_sim()
    await set_faults(http, sim.url, {"die_after_chunks": 3})
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps(STREAM)) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                received += chunk
    assert received.count(b"data: ") == 3 and b"[DONE]" not in received
    await asyncio.sleep(0.05)
    assert sim.engine is not None and sim.engine.stats.finished["abort"] == 1  # the engine let it go
    await set_faults(http, sim.url, {"die_after_chunks": None})
    async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps(STREAM)) as resp:
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_metrics_hang_until_cleared(start_sim, http) -> None:
    sim = await start_sim()
    await set_faults(http, sim.url, {"metrics_hang": True})
    scrape = asyncio.create_task(http.get(f"{sim.url}/metrics"))
    done, _ = await asyncio.wait({scrape}, timeout=0.5)
    assert not done  # still hanging
    await sim.clear_faults()
    resp = await asyncio.wait_for(scrape, timeout=5)
    assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()
    resp.release()


async def test_health_fail(start_sim, http) -> None:
    sim = await start_sim()
    await set_faults(http, sim.url, {"health_fail": True})
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 503
    await set_faults(http, sim.url, {"health_fail": False})
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200


async def test_refuse_connections_then_listen_again(start_sim, http) -> None:
    sim = await start_sim()
    await set_faults(http, sim.url, {"refuse_connections": True, "for_s": 0.6})
    async with aiohttp.ClientSession() as fresh:  # a new connection is refused
        with pytest.raises(aiohttp.ClientConnectionError):
            async with fresh.get(f"{sim.url}/health"):
                pass
        deadline = time.monotonic() + 10
        while True:  # `for_s` reverted it: the same port listens again
            try:
                async with fresh.get(f"{sim.url}/health") as resp:
                    assert resp.status == 200
                    break
            except aiohttp.ClientConnectionError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
    assert not sim.faults.refuse_connections


async def test_refuse_connections_cleared_in_process(start_sim) -> None:
    sim = await start_sim()
    await sim.update_faults({"refuse_connections": True})
    async with aiohttp.ClientSession() as fresh:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with fresh.get(f"{sim.url}/health"):
                pass
        await sim.clear_faults()
        async with fresh.get(f"{sim.url}/health") as resp:
            assert resp.status == 200


async def test_jitter_delays_each_chunk(start_sim, http) -> None:
    sim = await start_sim(speed=10.0)
    await set_faults(http, sim.url, {"jitter_ms": 400})  # mean 200 simulated ms per chunk
    t0 = time.monotonic()
    async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps(STREAM)) as resp:
        raw = await resp.read()
        speed = float(resp.headers["x-sim-speed"])
    sim_seconds = (time.monotonic() - t0) * speed
    assert raw.count(b"data: ") == 21
    # 20 tokens take ~0.15 simulated s without jitter; 20 chunks × U(0, 0.4 s) add ~4 s, and
    # sleeps never end early, so 1.5 s is a safe floor.
    assert sim_seconds > 1.5


async def test_restart_drops_streams_and_zeroes_counters(start_sim, http) -> None:
    sim = await start_sim(speed=5.0)
    await generation_status(http, sim.url)
    assert sim.engine is not None and sim.engine.stats.generation_tokens == 1
    long = dict(STREAM, max_tokens=2000)

    async def read_stream() -> bytes:
        got = b""
        async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps(long)) as resp:
            async for chunk in resp.content.iter_any():
                got += chunk
        return got

    reader = asyncio.create_task(read_stream())
    while sim.engine.stats.generation_tokens < 10:
        await asyncio.sleep(0.02)
    await set_faults(http, sim.url, {"restart": True})
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(reader, timeout=10)
    assert sim.engine.stats.generation_tokens == 0 and sim.engine.pool.num_cached == 0
    assert not sim.engine.running and not sim.faults.active()  # restart is an action, not a state
    assert await generation_status(http, sim.url) == 200
