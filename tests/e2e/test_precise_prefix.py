"""Precise prefix routing end to end: two simulators publish vLLM KV-cache events, llm-extproc
subscribes (`kv_events`, with replay), Envoy routes. A long prompt's blocks reach the index from
the engine's own events, the same prompt follows them, and an engine that drops its cache
(`/reset_prefix_cache`, or a restart) drops its entries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.fleet import Fleet
from extproc.stack.server import ExtProcServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"
TTL_S = 0.5  # speculative pick entries: short, so what remains after it came from events
LONG = " ".join(f"clause {i} of the shared system prompt," for i in range(300))  # ~2.4k tokens


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[tuple[EnvoyProcess, ExtProcServerProcess, Fleet]]:
    workdir = tmp_path_factory.mktemp("precise")
    fleet = Fleet(("h100-qwen3-8b", "h100-qwen3-8b"), workdir=workdir, speed=1.0, kv_events=True)
    await fleet.start()
    endpoints = []
    for s in fleet.sims:
        assert s.kv_events_endpoint and s.kv_events_replay, "the simulator did not report its KV-event sockets"
        endpoints.append({"address": s.address, "models": [MODEL], "kv_events": s.kv_events_endpoint, "kv_events_replay": s.kv_events_replay})
    path = workdir / "llm-extproc.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": MODEL}],
                "endpoints": endpoints,
                "scheduling": {
                    "health_check": {"timeout_s": 2.0, "unhealthy_threshold": 3},
                    "prefix": {"speculative_ttl_s": TTL_S},
                },
            }
        )
    )
    server = ExtProcServerProcess(path, workdir=workdir)
    envoy: EnvoyProcess | None = None
    try:
        await server.start()
        ports = [("127.0.0.1", s.port) for s in fleet.sims]
        envoy = EnvoyProcess(rewrite_config(load_envoy_config("fail-open"), RunSettings(extproc=server.grpc_address, endpoints=ports)), workdir=workdir)
        await envoy.start()
        yield envoy, server, fleet
    finally:
        if envoy is not None:
            await envoy.aclose()
        await server.aclose()
        await fleet.aclose()


def chat(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "ignore_eos": True}


async def prefix_view(c: httpx.AsyncClient, server: ExtProcServerProcess) -> dict[str, dict]:
    eps = (await c.get(f"{server.admin_url}/api/v1/endpoints")).json()["endpoints"]
    return {e["address"]: e["prefix"] for e in eps}


async def eventually(probe: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await probe():  # type: ignore[misc]
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def warm(gw: httpx.AsyncClient, c: httpx.AsyncClient, server: ExtProcServerProcess, text: str) -> tuple[str, int]:
    """Serve `text` once; wait until its endpoint's index holds its blocks after the speculative
    entries expired (so they came from BlockStored events). Returns (endpoint, blocks)."""
    r = await gw.post("/v1/chat/completions", json=chat(text))
    assert r.status_code == 200, r.text
    served = r.headers["x-llm-endpoint"]
    prompt_blocks = r.json()["usage"]["prompt_tokens"] // 16
    await asyncio.sleep(TTL_S * 3)
    view = await prefix_view(c, server)
    assert view[served]["source"] == "precise"
    assert view[served]["blocks"] >= prompt_blocks - 1, view[served]
    return served, view[served]["blocks"]


async def test_served_prompt_is_indexed_from_events_and_followed(stack):
    envoy, server, fleet = stack
    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as gw, httpx.AsyncClient(trust_env=False, timeout=30) as c:
        served, _ = await warm(gw, c, server, LONG)
        (other,) = [a for a in fleet.addresses if a != served]
        assert (await prefix_view(c, server))[other]["blocks"] == 0
        text = (await c.get(f"{server.admin_url}/metrics")).text
        assert metric(text, "llm_extproc_kv_events_total", endpoint=served, type="stored", outcome="applied") >= 1
        assert metric(text, "llm_extproc_kv_event_errors_total") == 0
        # The same prompt again, one after the other and then two at once: each goes where
        # its blocks are.
        for _ in range(3):
            r = await gw.post("/v1/chat/completions", json=chat(LONG))
            assert r.headers["x-llm-endpoint"] == served
        both = await asyncio.gather(*(gw.post("/v1/chat/completions", json=chat(LONG)) for _ in range(2)))
        assert [r.headers["x-llm-endpoint"] for r in both] == [served, served]
        # A new long prompt twice at once: before any event, the first pick's speculative
        # entries make the second follow it.
        fresh = await asyncio.gather(*(gw.post("/v1/chat/completions", json=chat("Fresh. " + LONG)) for _ in range(2)))
        assert fresh[0].headers["x-llm-endpoint"] == fresh[1].headers["x-llm-endpoint"]


async def test_reset_prefix_cache_clears_the_endpoint(stack):
    envoy, server, fleet = stack
    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as gw, httpx.AsyncClient(trust_env=False, timeout=30) as c:
        served, _ = await warm(gw, c, server, LONG + " Reset case.")
        r = await c.post(f"http://{served}/reset_prefix_cache")  # vLLM's route: AllBlocksCleared
        assert r.status_code == 200

        async def cleared() -> bool:
            return (await prefix_view(c, server))[served]["blocks"] == 0

        await eventually(cleared)
        text = (await c.get(f"{server.admin_url}/metrics")).text
        assert metric(text, "llm_extproc_prefix_index_resets_total", endpoint=served, reason="cleared") == 1


async def test_restarted_engine_loses_its_entries(stack):
    envoy, server, fleet = stack
    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as gw, httpx.AsyncClient(trust_env=False, timeout=30) as c:
        served, _ = await warm(gw, c, server, LONG + " Restart case.")
        r = await c.post(f"http://{served}/sim/faults", json={"restart": True})
        assert r.status_code == 200

        async def dropped() -> bool:
            return (await prefix_view(c, server))[served]["blocks"] == 0

        await eventually(dropped)
        # Served again after the restart, the prompt's blocks come back from the new process's
        # events (its sequence numbers start at 0 again).
        again, _ = await warm(gw, c, server, LONG + " Restart case.")
        assert again in fleet.addresses
