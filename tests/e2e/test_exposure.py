"""What the gateway exposes (issue 18.1): through Envoy's listener a client reaches only the
paths the gateway serves — generation APIs, the model list, health — never an engine's admin
routes (`/metrics`, `/sim/faults`, `/tokenize`; vLLM's `/reset_prefix_cache`, LoRA, sleep),
with either shipped config and with llm-extproc down (fail-open's fallback path).

The engines are real simulators (in process), whose `/sim/faults` changes their behaviour:
the test checks that no request through the listener changed it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.sim.server import SimServer
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.ports import free_port
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import assert_openai_error, in_process_sims, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"
ADMIN_ROUTES = [("GET", "/metrics"), ("POST", "/sim/faults"), ("GET", "/sim/faults"), ("POST", "/tokenize"), ("POST", "/reset_prefix_cache"), ("GET", "/sim/state")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sims(qwen_counter) -> AsyncIterator[list[SimServer]]:
    async with in_process_sims(qwen_counter, 2, speed=50.0) as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(workdir: Path, sims: list[SimServer]) -> AsyncIterator[ExtProcServerProcess]:
    config = {"models": [{"name": MODEL}], "endpoints": [{"address": f"127.0.0.1:{s.port}", "models": [MODEL]} for s in sims]}
    proc = await start_server(workdir, config, "exposure-server")
    try:
        yield proc
    finally:
        await proc.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def envoys(workdir: Path, server: ExtProcServerProcess, sims: list[SimServer]) -> AsyncIterator[dict[str, EnvoyProcess]]:
    """fail-open and fail-closed in front of the server; fail-open in front of a gRPC port
    nothing listens on (llm-extproc down); fail-open with `/sim/state` allow-listed."""
    engines = [("127.0.0.1", s.port) for s in sims]
    variants = {
        "fail-open": ("fail-open", RunSettings(extproc=server.grpc_address, endpoints=engines)),
        "fail-closed": ("fail-closed", RunSettings(extproc=server.grpc_address)),
        "server-down": ("fail-open", RunSettings(extproc=("127.0.0.1", free_port()), endpoints=engines)),
        "allow-listed": ("fail-open", RunSettings(extproc=server.grpc_address, endpoints=engines, extra_served_paths=["/sim/state"])),
    }
    started: dict[str, EnvoyProcess] = {}
    try:
        for label, (name, settings) in variants.items():
            started[label] = EnvoyProcess(rewrite_config(load_envoy_config(name), settings), workdir=workdir, name=f"exposure-{label}")
            await started[label].start()
        yield started
    finally:
        for envoy in started.values():
            await envoy.aclose()


async def _faults(sims: list[SimServer]) -> list[dict]:
    async with httpx.AsyncClient(trust_env=False) as c:
        return [(await c.get(f"http://127.0.0.1:{s.port}/sim/faults")).json() for s in sims]


@pytest.mark.parametrize("label", ["fail-open", "fail-closed", "server-down"])
async def test_engine_admin_routes_are_unreachable_from_the_listener(envoys, sims, label):
    before = await _faults(sims)
    async with httpx.AsyncClient(base_url=envoys[label].url, trust_env=False, timeout=10) as c:
        for method, path in ADMIN_ROUTES:
            r = await c.request(method, path, json={"error_rate": 1.0, "health_fail": True})
            err = assert_openai_error(r, 404)
            assert err["code"] == "not_found", (method, path)
            assert "x-llm-endpoint" not in r.headers  # no engine answered
        # Encoded or dotted spellings normalise to the same refused path.
        for path in ("/sim/%66aults", "/v1/../sim/faults", "//metrics", "/v1/models/../../metrics"):
            assert (await c.post(path, json={"error_rate": 1.0})).status_code == 404, path
        # What the gateway serves still works.
        models = await c.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
        assert (await c.get("/health")).status_code == 200
        chat = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
    assert await _faults(sims) == before  # no fault was switched on through the gateway


async def test_the_allow_list_opens_a_path(envoys, sims):
    async with httpx.AsyncClient(base_url=envoys["allow-listed"].url, trust_env=False, timeout=10) as c:
        assert (await c.get("/sim/state")).status_code == 200
        assert_openai_error(await c.get("/metrics"), 404)
