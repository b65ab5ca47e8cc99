"""Endpoints added and removed by a configuration reload while traffic flows, through a real
Envoy (fail-closed: no fallback can hide a wrong destination) and the project's simulators.

The server runs as `llm-extproc serve` on a file the test rewrites; the static discovery source
notices (polled) or is told by SIGHUP. Checked: every request succeeds (an endpoint that leaves
finishes its in-flight streams), an added endpoint starts receiving requests, no request
arrives at a removed endpoint after the server has removed it (the simulators count arrivals
in this process), and the server's /metrics has no series left for it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from extproc.sim.server import SimServer
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.server import ExtProcServerProcess
from tests.agent.agent_helpers import eventually
from tests.e2e.e2e_helpers import in_process_sims, stream_chat

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"
CLIENTS = 6
MAX_REQUESTS = 1500  # the load loop's bound, far above what the phases need


class CountingSim(SimServer):
    """A simulator that notes the monotonic time of every generation request reaching it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.arrivals: list[float] = []

    def _routes(self, app: web.Application) -> None:
        @web.middleware
        async def note(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.method == "POST":
                self.arrivals.append(time.monotonic())
            return await handler(request)

        app.middlewares.append(note)
        super()._routes(app)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sims(qwen_counter) -> AsyncIterator[list[CountingSim]]:
    async with in_process_sims(qwen_counter, 3, speed=2.0, sim_class=CountingSim, stream_interval=2) as started:
        yield started  # type: ignore[misc]


def write_config(path: Path, sims: list[CountingSim], *, watch: bool = True) -> None:
    config = {
        "models": [{"name": MODEL}],
        "endpoints": [{"address": s.address, "models": [MODEL]} for s in sims],
        "discovery": {"sources": [{"type": "static", "watch": watch, "poll_interval_s": 0.1}]},
        "scheduling": {"health_check": {"interval_s": 0.25, "timeout_s": 2.0}},
        "telemetry": {"sample_rate": 1.0},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    tmp.replace(path)  # atomically, as a ConfigMap update lands


async def listed(admin: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    body = (await admin.get("/api/v1/endpoints")).json()
    return {e["address"]: e for e in body["endpoints"]}


class Load:
    """`CLIENTS` loops of streamed requests through Envoy until stopped (or MAX_REQUESTS)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _client(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=60) as c:
            while not self._stop.is_set() and len(self.results) < MAX_REQUESTS:
                self.results.append(await stream_chat(c, MODEL, 60))

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(CLIENTS)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_reload_adds_and_removes_endpoints_under_load(workdir: Path, sims: list[CountingSim]):
    a, b, c = sims
    path = workdir / "reload.yaml"
    write_config(path, [a, b])
    server = ExtProcServerProcess(path, workdir=workdir, name="reload")
    await server.start()
    # Envoy's fallback cluster (unused with fail-closed) holds only the endpoint that never leaves.
    settings = RunSettings(extproc=server.grpc_address, endpoints=[("127.0.0.1", a.port)])
    envoy = EnvoyProcess(rewrite_config(load_envoy_config("fail-closed"), settings), workdir=workdir, name="envoy-reload")
    await envoy.start()
    load = Load(envoy.url)
    try:
        async with httpx.AsyncClient(base_url=server.admin_url, trust_env=False, timeout=10) as admin:
            load.start()
            await eventually(lambda: len(load.results) >= 30, timeout_s=20, what="first requests")

            write_config(path, [a, b, c])  # c joins
            await eventually(lambda: len(c.arrivals) >= 5, timeout_s=20, what="requests reaching the added endpoint")

            write_config(path, [a, c])  # b leaves while it carries streams
            draining_seen = False
            deadline = time.monotonic() + 20
            while True:
                now = await listed(admin)
                if b.address not in now:
                    break
                draining_seen |= now[b.address]["draining"]
                assert time.monotonic() < deadline, "b was never removed"
                await asyncio.sleep(0.01)
            removed_at = time.monotonic()
            b_total = len(b.arrivals)
            done_then = len(load.results)
            await eventually(lambda: len(load.results) >= done_then + 40, timeout_s=30, what="requests after the removal")
            await load.stop()

            metrics = (await admin.get("/metrics")).text
            final = await listed(admin)
    finally:
        await load.stop()
        await envoy.aclose()
        await server.aclose()

    bad = [r for r in load.results if r != "ok"]
    assert bad == [], f"{len(bad)} of {len(load.results)} requests failed: {bad[:5]}"
    assert len(b.arrivals) == b_total, "requests reached b after it was removed"
    assert not [t for t in b.arrivals if t > removed_at]
    assert b_total > 0 and len(c.arrivals) >= 5 and len(a.arrivals) > 0
    assert set(final) == {a.address, c.address}
    assert f'"{b.address}"' not in metrics, [line for line in metrics.splitlines() if b.address in line][:5]
    assert f'endpoint="{c.address}"' in metrics
    # How the removal went, for the log of a failed run: whether b was seen draining first.
    print(f"requests: {len(load.results)}; b draining seen: {draining_seen}; arrivals a/b/c: {len(a.arrivals)}/{b_total}/{len(c.arrivals)}")


async def test_sighup_reloads_when_watching_is_off_and_a_bad_file_changes_nothing(workdir: Path, sims: list[CountingSim]):
    a, b, _ = sims
    path = workdir / "sighup.yaml"
    write_config(path, [a], watch=False)
    server = ExtProcServerProcess(path, workdir=workdir, name="sighup")
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.admin_url, trust_env=False, timeout=10) as admin:
            write_config(path, [a, b], watch=False)
            await asyncio.sleep(0.5)
            assert set(await listed(admin)) == {a.address}  # not watched: nothing yet
            pid = server._proc.pid  # noqa: SLF001 - the test signals the process it started
            assert pid is not None
            os.kill(pid, signal.SIGHUP)
            async def both() -> bool:
                return set(await listed(admin)) == {a.address, b.address}
            deadline = time.monotonic() + 10
            while not await both():
                assert time.monotonic() < deadline, "SIGHUP did not reload"
                await asyncio.sleep(0.05)

            path.write_text("models: [oops\n", encoding="utf-8")  # invalid YAML
            os.kill(pid, signal.SIGHUP)
            await asyncio.sleep(0.5)
            assert set(await listed(admin)) == {a.address, b.address}
            assert server._proc.running  # noqa: SLF001
    finally:
        await server.aclose()
    log = (workdir / "sighup.log").read_text()
    assert "configuration reload (SIGHUP) refused" in log
