"""The local inference engine as the node agent sees it: vLLM's `/metrics` and `/health`.

Each `sample()` fetches both concurrently. `/metrics` is parsed by the balancer's own vLLM
parser (`extproc.datastore.scraper.parse_vllm_metrics`: running/waiting requests, KV usage
under both vLLM names, `cache_config_info{block_size,num_gpu_blocks}`, cumulative TTFT
buckets). TTFT P95 covers the recent window: the bucket deltas between the newest scrape and
the newest scrape at least `latency_window_s` older (or the oldest one kept, early on), through
Prometheus' `histogram_quantile` interpolation. A counter reset (the engine restarted) starts
the window afresh.

`/health` decides health: not 2xx, a timeout or a refused connection is a failure; the first
probe decides outright, after that `unhealthy_after` consecutive failures flip it to unhealthy
and one success flips it back. `/metrics` failing alone is not a fault (the engine may be
serving fine with a slow exporter): the sample is then `reachable=False` with no load data.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import aiohttp

from extproc.datastore.scraper import EngineMetrics, histogram_quantile, parse_vllm_metrics

__all__ = ["EngineProbe", "EngineSample"]


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One reading of the engine.

    Attributes:
        url: the engine's base URL.
        reachable: `/metrics` answered 200 and parsed.
        healthy: `/health` verdict (see the module docstring).
        kv_blocks_total: the KV pool (blocks, `num_gpu_blocks`); None if not exported.
        kv_blocks_free: `num_gpu_blocks × (1 − kv_usage)` (blocks); None if not exported.
        block_size: tokens per KV block; None if not exported.
        kv_usage: fraction of the KV pool in use (0..1).
        running / waiting: requests running / waiting in the engine (count).
        ttft_p95_ms: P95 time to first token over the window (milliseconds); None when no
            request got its first token in the window, or before two scrapes.
        metrics_error / health_error: why `/metrics` / `/health` failed this time, else None.
    """

    url: str
    reachable: bool
    healthy: bool
    kv_blocks_total: int | None = None
    kv_blocks_free: int | None = None
    block_size: int | None = None
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    ttft_p95_ms: float | None = None
    metrics_error: str | None = None
    health_error: str | None = None

    @property
    def kv_free_fraction(self) -> float | None:
        """Free KV blocks / total KV blocks (0..1), None when the pool size is unknown."""
        if not self.kv_blocks_total or self.kv_blocks_free is None:
            return None
        return self.kv_blocks_free / self.kv_blocks_total


class EngineProbe:
    """Samples one engine.

    Args:
        url: base URL (`http://127.0.0.1:8000`).
        timeout_s: per-request timeout (seconds).
        latency_window_s: TTFT P95 window (seconds).
        unhealthy_after: consecutive `/health` failures before the engine counts as unhealthy.

    Nothing is opened until `start()`.
    """

    def __init__(
        self, url: str, *, timeout_s: float = 1.0, latency_window_s: float = 30.0, unhealthy_after: int = 2
    ) -> None:
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be at least 1, got {unhealthy_after}")
        if latency_window_s <= 0:
            raise ValueError(f"latency_window_s must be positive, got {latency_window_s}")
        self.url = url.rstrip("/")
        self._timeout = timeout_s
        self._window = latency_window_s
        self._unhealthy_after = unhealthy_after
        self._session: aiohttp.ClientSession | None = None
        self._ttft: deque[tuple[float, dict[float, float]]] = deque()
        self._failures = 0
        self._healthy: bool | None = None  # None until the first probe

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout),
            connector=aiohttp.TCPConnector(limit=4, keepalive_timeout=30),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str) -> tuple[int, str]:
        assert self._session is not None, "start() first"
        async with self._session.get(self.url + path) as resp:
            return resp.status, await resp.text()

    @staticmethod
    def _describe(exc: BaseException) -> str:
        if isinstance(exc, asyncio.TimeoutError):
            return "timeout"
        return str(exc) or type(exc).__name__

    async def _health(self) -> str | None:
        try:
            status, _ = await self._get("/health")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"/health: {self._describe(exc)}"
        return None if 200 <= status < 300 else f"/health: status {status}"

    async def _metrics(self) -> tuple[EngineMetrics | None, str | None]:
        try:
            status, text = await self._get("/metrics")
            if status != 200:
                return None, f"/metrics: status {status}"
            return parse_vllm_metrics(text), None
        except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError) as exc:
            return None, f"/metrics: {self._describe(exc)}"

    def _ttft_p95_ms(self, now: float, buckets: dict[float, float]) -> float | None:
        if self._ttft and any(buckets.get(le, 0.0) < c for le, c in self._ttft[-1][1].items()):
            self._ttft.clear()  # counters went down: the engine restarted
        self._ttft.append((now, buckets))
        # Keep as the base the newest scrape at least one window old, so the delta spans the window.
        while len(self._ttft) >= 2 and self._ttft[1][0] <= now - self._window:
            self._ttft.popleft()
        if len(self._ttft) < 2:
            return None
        base = self._ttft[0][1]
        q = histogram_quantile(0.95, {le: c - base.get(le, 0.0) for le, c in buckets.items()})
        return None if q is None else q * 1000.0

    async def sample(self) -> EngineSample:
        """Fetch `/metrics` and `/health` now; never raises for an engine problem."""
        (m, metrics_error), health_error = await asyncio.gather(self._metrics(), self._health())
        if health_error is None:
            self._failures = 0
            self._healthy = True
        else:
            self._failures += 1
            if self._healthy is None or self._failures >= self._unhealthy_after:
                self._healthy = False
        healthy = bool(self._healthy)
        if m is None:
            return EngineSample(self.url, False, healthy, metrics_error=metrics_error, health_error=health_error)
        return EngineSample(
            url=self.url,
            reachable=True,
            healthy=healthy,
            kv_blocks_total=m.num_gpu_blocks,
            kv_blocks_free=m.free_blocks,
            block_size=m.block_size,
            kv_usage=m.kv_usage,
            running=m.running,
            waiting=m.waiting,
            ttft_p95_ms=self._ttft_p95_ms(time.monotonic(), m.ttft_buckets),
            health_error=health_error,
        )
