"""500 streamed requests through a real Envoy onto simulated engines, a third of them abandoned
by their clients mid-stream and a third before the first byte: afterwards every in-flight count
and every KV reservation on the server is back to zero."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.fleet import SimProcess
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.ports import free_ports
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import start_beside

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sim_stack(tmp_path_factory) -> AsyncIterator[tuple[EnvoyProcess, ExtProcServerProcess]]:
    workdir: Path = tmp_path_factory.mktemp("aborts")
    # Simulators in their own processes: the client load in this process must not slow the
    # engines' health and metrics answers (an in-process engine shares this event loop).
    ports = free_ports(2)
    sims = [SimProcess("h100-qwen3-8b", name=f"sim-{i}", workdir=workdir, speed=10, stream_interval=2, seed=i, port=p) for i, p in enumerate(ports)]
    path = workdir / "llm-extproc.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": MODEL}],
                "endpoints": [{"address": f"127.0.0.1:{p}", "models": [MODEL]} for p in ports],
                # A loaded CI machine answers slowly: do not call an engine dead over one slow probe.
                "scheduling": {"health_check": {"timeout_s": 2.0, "unhealthy_threshold": 3}},
            }
        )
    )
    server = ExtProcServerProcess(path, workdir=workdir)
    await start_beside(server, sims)
    cfg = rewrite_config(
        load_envoy_config("fail-open"),
        RunSettings(extproc=server.grpc_address, endpoints=[("127.0.0.1", s.port) for s in sims]),
    )
    envoy = EnvoyProcess(cfg, workdir=workdir)
    await envoy.start()
    try:
        yield envoy, server
    finally:
        await envoy.aclose()
        await server.aclose()
        for s in sims:
            await s.aclose()


def _server_state(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("llm_extproc_endpoint_inflight_requests", "llm_extproc_endpoint_reserved_kv_blocks"):
                out[f"{s.name}{{{s.labels['endpoint']}}}"] = s.value
            elif s.name == "llm_extproc_grpc_streams_active":
                out[s.name] = s.value
    return out


async def test_random_client_aborts_leave_no_reservation(sim_stack):
    envoy, server = sim_stack
    rng = random.Random(7)
    outcomes = {"complete": 0, "abort_mid_stream": 0, "abort_before_response": 0}
    sem = asyncio.Semaphore(40)
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=50)

    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60, limits=limits) as client:

        async def one(i: int) -> None:
            mode = rng.choice(list(outcomes))
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"request {i} " + "word " * rng.randint(5, 400)}],
                "max_tokens": rng.randint(8, 64),
                "stream": True,
            }
            async with sem:
                if mode == "abort_before_response":
                    task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                    await asyncio.sleep(rng.uniform(0.0, 0.05))
                    task.cancel()
                    try:
                        await task
                    except (asyncio.CancelledError, httpx.HTTPError):
                        pass
                else:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200, (await r.aread()).decode()
                        async for _ in r.aiter_bytes():
                            if mode == "abort_mid_stream":
                                break  # leaving the context closes the connection mid-stream
            outcomes[mode] += 1

        await asyncio.gather(*(one(i) for i in range(500)))

        assert sum(outcomes.values()) == 500 and min(outcomes.values()) > 100
        deadline = time.monotonic() + 20
        while True:
            state = _server_state((await client.get(f"{server.admin_url}/metrics")).text)
            if state and all(v == 0 for v in state.values()):
                break
            assert time.monotonic() < deadline, f"leaked: { {k: v for k, v in state.items() if v} }"
            await asyncio.sleep(0.2)
        assert len(state) == 5  # 2 endpoints × (in-flight, reserved blocks) + open streams


async def test_a_streaming_request_counts_in_flight_until_it_ends(sim_stack):
    """An unobserved request (no response-body messages after its response headers) still
    counts in flight while it streams and stops when it ends: Envoy keeps a request's ext_proc
    stream open for the request's whole life and resets it at the end, which is the server's
    end-of-request signal whether or not the body passes through it."""
    envoy, server = sim_stack
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count slowly"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }

    async def inflight(client: httpx.AsyncClient) -> tuple[int, int]:
        eps = (await client.get(f"{server.admin_url}/api/v1/endpoints")).json()["endpoints"]
        return sum(e["inflight"] for e in eps), sum(e["decode_inflight"] for e in eps)

    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60) as client:
        # Several, so that some are unobserved whatever the telemetry sample picks.
        streams = [client.stream("POST", "/v1/chat/completions", json=body) for _ in range(6)]
        responses = [await s.__aenter__() for s in streams]
        try:
            readers = [r.aiter_bytes() for r in responses]
            for reader in readers:
                await reader.__anext__()  # the first token: every request is past prefill
            await asyncio.sleep(0.3)  # well past any ext_proc stream end
            assert await inflight(client) == (6, 6)
            for reader in readers:
                async for _ in reader:
                    pass
        finally:
            for s in streams:
                await s.__aexit__(None, None, None)
        deadline = time.monotonic() + 5
        while await inflight(client) != (0, 0):
            assert time.monotonic() < deadline, "requests that ended still count in flight"
            await asyncio.sleep(0.05)
