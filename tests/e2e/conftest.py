"""The end-to-end stack: recording engines, the real `llm-extproc serve`, a real Envoy.

Everything is module-scoped (one stack per test module, on the module's event loop) and torn
down in reverse order; child processes are stopped by PID. Their logs stay in the module's
pytest temp dir (`envoy.log`, `llm-extproc.log`) for a failed run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import yaml

from extproc.stack.envoy import EnvoyProcess
from extproc.stack.ports import free_port
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import ALIAS, DEAD_MODEL, MODEL, Engines, start_envoy
from tests.e2e.fake_engines import Backend


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[Engines]:
    found = Engines(Backend("a"), Backend("b"), Backend("intruder"))
    started: list[Backend] = []
    try:
        for e in (found.a, found.b, found.intruder):
            await e.start()
            started.append(e)
        yield found
    finally:
        for e in started:
            await e.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def extproc_server(workdir: Path, engines: Engines) -> AsyncIterator[ExtProcServerProcess]:
    config = {
        # 128k context so the 200 KB prompt (~33k tokens) is routed, not refused as too long.
        "models": [{"name": MODEL, "aliases": [ALIAS], "max_model_len": 131072}, {"name": DEAD_MODEL, "path": "builtin:qwen3-8b"}],
        "endpoints": [
            *({"address": e.address, "models": [MODEL]} for e in engines.serving),
            {"address": f"127.0.0.1:{free_port()}", "models": [DEAD_MODEL]},
        ],
        # Fast probes, but a slow answer from an engine that shares the test client's event
        # loop (200 parallel requests) must not count as a dead engine.
        "scheduling": {"health_check": {"interval_s": 0.25, "timeout_s": 2.0, "unhealthy_threshold": 3}},
    }
    path = workdir / "llm-extproc.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    server = ExtProcServerProcess(path, workdir=workdir)
    await server.start()
    try:
        yield server
    finally:
        await server.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(workdir: Path, extproc_server: ExtProcServerProcess, engines: Engines) -> AsyncIterator[EnvoyProcess]:
    """Envoy on envoy/fail-open.yaml in front of the running server."""
    envoy = await start_envoy("fail-open", workdir=workdir, server=extproc_server, engines=engines)
    try:
        yield envoy
    finally:
        await envoy.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def client(gateway: EnvoyProcess, engines: Engines) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP/1.1 client for the gateway; the engines' records start empty for each test."""
    engines.clear()
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=60) as c:
        yield c
