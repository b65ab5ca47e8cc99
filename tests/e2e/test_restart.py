"""Restarting llm-extproc under streaming load (issue 18.3), with each shipped Envoy config.

The rollout the README advises: start the replacement on the same ports (SO_REUSEPORT,
`listen.reuse_port`), wait until it is ready, then SIGTERM the old process, whose grace period
(`limits.shutdown_grace_s`) is longer than the generations it carries. Every response body
crosses the server (telemetry sample_rate 1), so the old process holds every stream it routed
until it ends. Checked, through a real Envoy:

- no client sees an error, and every stream arrives whole (`[DONE]`), with either config;
- a generation outliving the grace period is cut with fail-closed and survives with fail-open
  (the README's reason to prefer fail-open, or a grace longer than the longest generation).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.sim.server import SimServer
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import in_process_sims, start_server, stream_chat

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"
GRACE_S = 3.0
CLIENTS = 6
SHORT_TOKENS = 40  # ~0.5-1 s on the simulated H100 at speed 1: well inside the grace period
LONG_TOKENS = 1000  # ~7 s at the simulated H100's ~7 ms per token: outlives the grace period


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sims(qwen_counter) -> AsyncIterator[list[SimServer]]:
    async with in_process_sims(qwen_counter, 2, speed=1.0) as started:
        yield started


class Rollout:
    """The current server process; `restart()` starts its replacement first, then drains it."""

    def __init__(self, workdir: Path, sims: list[SimServer]) -> None:
        self.workdir = workdir
        self.config = {
            "models": [{"name": MODEL}],
            "endpoints": [{"address": f"127.0.0.1:{s.port}", "models": [MODEL]} for s in sims],
            "limits": {"shutdown_grace_s": GRACE_S},
            "telemetry": {"sample_rate": 1.0},
        }
        self.current: ExtProcServerProcess | None = None
        self.generation = 0

    async def start(self, **ports: int) -> ExtProcServerProcess:
        self.generation += 1
        return await start_server(self.workdir, self.config, f"restart-{self.generation}", **ports)

    async def start_replacement(self) -> tuple[ExtProcServerProcess, float]:
        """Start the replacement on the current process's ports and wait until it is ready;
        returns the old process and the seconds it took."""
        old = self.current
        assert old is not None
        t0 = time.monotonic()
        self.current = await self.start(grpc_port=old.grpc_port, admin_port=old.admin_port)
        return old, time.monotonic() - t0

    @staticmethod
    async def drain(old: ExtProcServerProcess) -> float:
        """SIGTERM the old process and wait until it exited; returns the seconds it drained."""
        t0 = time.monotonic()
        await old.aclose(timeout_s=GRACE_S + 20)
        return time.monotonic() - t0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout(workdir: Path, sims: list[SimServer]) -> AsyncIterator[Rollout]:
    r = Rollout(workdir, sims)
    r.current = await r.start()
    try:
        yield r
    finally:
        await r.current.aclose()


async def _stream(c: httpx.AsyncClient, max_tokens: int) -> str:
    return await stream_chat(c, MODEL, max_tokens)


@pytest.mark.parametrize("config", ["fail-open", "fail-closed"])
async def test_restart_under_streaming_load_loses_nothing(workdir, rollout, sims, config):
    settings = RunSettings(extproc=rollout.current.grpc_address, endpoints=[("127.0.0.1", s.port) for s in sims])
    envoy = EnvoyProcess(rewrite_config(load_envoy_config(config), settings), workdir=workdir, name=f"envoy-restart-{config}")
    await envoy.start()
    stop = asyncio.Event()
    results: list[str] = []

    async def client() -> None:
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60) as c:
            while not stop.is_set():
                results.append(await _stream(c, SHORT_TOKENS))

    try:
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60) as c:
            loops = [asyncio.create_task(client()) for _ in range(CLIENTS)]
            await asyncio.sleep(1.0)
            old, ready_s = await rollout.start_replacement()
            # Envoy's connections to llm-extproc all predate the replacement: this stream's
            # ext_proc stream is on the old process.
            long_stream = asyncio.create_task(_stream(c, LONG_TOKENS))
            await asyncio.sleep(0.5)
            drain_s = await rollout.drain(old)
            await asyncio.sleep(1.0)  # the new process serves on
            stop.set()
            await asyncio.gather(*loops)
            long_result = await long_stream
    finally:
        await envoy.aclose()
    errors = [r for r in results if r != "ok"]
    print(f"{config}: {len(results)} streams, {len(errors)} errors; replacement ready in {ready_s:.1f} s, old drained in {drain_s:.1f} s")
    assert len(results) >= 3 * CLIENTS and not errors, errors[:5]
    # The old process drained for its full grace period: the long stream was still on it.
    assert drain_s >= GRACE_S - 0.5
    if config == "fail-open":
        assert long_result == "ok"  # Envoy carries on without the ext_proc stream
    else:
        assert long_result != "ok"  # cut at the end of the grace period: the README's warning
