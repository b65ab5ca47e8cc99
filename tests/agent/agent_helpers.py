"""Helpers for the node agent's tests: a fake vLLM node and a polling wait.

`FakeEngine` is a tiny aiohttp app that answers what the agent reads from a vLLM node —
`/metrics` (vLLM's names, from mutable fields), `/health` (status settable) and the
simulator's `/sim/gpu` shape — so a test changes the node's state and watches the agent react.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["FakeEngine", "TTFT_BOUNDS", "eventually"]

TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds (seconds) of the fake TTFT histogram's finite buckets."""


@dataclass
class FakeEngine:
    """A fake vLLM node. Change the fields; every request reads them afresh.

    `ttft_counts` holds per-bucket (not cumulative) counts, added by `observe_ttft`; `/metrics`
    accumulates them as Prometheus does.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int = 1000
    block_size: int = 16
    legacy: bool = False
    health_status: int = 200
    metrics_status: int = 200
    gpu: dict[str, Any] = field(
        default_factory=lambda: {"memory_used_bytes": 10 * 2**30, "memory_total_bytes": 80 * 2**30, "utilization": 0.0}
    )
    ttft_counts: dict[float, int] = field(default_factory=dict)
    url: str = ""
    _runner: web.AppRunner | None = None

    def observe_ttft(self, seconds: float, n: int = 1) -> None:
        """Record `n` requests whose first token took `seconds`."""
        bound = next((b for b in TTFT_BOUNDS if seconds <= b), float("inf"))
        self.ttft_counts[bound] = self.ttft_counts.get(bound, 0) + n

    def exposition(self) -> str:
        usage = "vllm:gpu_cache_usage_perc" if self.legacy else "vllm:kv_cache_usage_perc"
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="m"}} {self.running}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}',
            f"# TYPE {usage} gauge",
            f'{usage}{{model_name="m"}} {self.kv_usage}',
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
            f'num_gpu_blocks="{self.num_gpu_blocks}"}} 1.0',
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        cumulative = 0
        for b in (*TTFT_BOUNDS, float("inf")):
            cumulative += self.ttft_counts.get(b, 0)
            le = "+Inf" if b == float("inf") else repr(b)
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {cumulative}')
        lines.append(f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {cumulative}')
        lines.append('vllm:time_to_first_token_seconds_sum{model_name="m"} 0.0')
        return "\n".join(lines) + "\n"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/sim/gpu", self._gpu)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        self.url = f"http://127.0.0.1:{port}"

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status)
        return web.Response(text=self.exposition(), content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _gpu(self, request: web.Request) -> web.Response:
        return web.json_response(self.gpu)


async def eventually(check: Callable[[], bool], *, timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll `check()` every 10 ms until it is true; fail after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.01)
