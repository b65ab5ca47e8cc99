"""The node agent's Prometheus metrics (on an injected registry) and its `/metrics` HTTP server.

Node metrics keep the design notes' names exactly, because operators' dashboards expect them
(STYLE: the deliberate exception to `llm_extproc_<subsystem>_...`):

    gpu_memory_used_bytes{gpu}        gpu_memory_total_bytes{gpu}     gpu_utilization_ratio{gpu}
    gpu_memory_utilization_ratio{gpu} gpu_temperature_celsius{gpu}    gpu_power_watts{gpu}
    gpu_ecc_uncorrected_errors{gpu}   gpu_fault{gpu}
    inference_latency_p95_ms          (TTFT P95 over the agent's window; NaN when unknown)
    inference_kv_cache_usage_ratio    inference_kv_blocks_free        inference_kv_blocks_total
    inference_requests_running        inference_requests_waiting

The agent's own state is `llm_extproc_agent_*`: `healthy`, `gpu_healthy`, `engine_healthy`,
`weight`, `sample_errors_total{source}` (source: gpu, engine_metrics, engine_health),
`last_sample_timestamp_seconds`. `gpu` is the device index (bounded by the node's GPU count).
A field the source cannot read (NotSupported), and every engine gauge of an agent that watches
no engine (or cannot read its `/metrics`), is NaN rather than a misleading 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from extproc.agent.report import NodeSample
from extproc.aio import start_site

__all__ = ["AgentMetrics", "MetricsServer", "SAMPLE_ERROR_SOURCES"]

SAMPLE_ERROR_SOURCES = ("gpu", "engine_metrics", "engine_health")

_GPU_GAUGES = (
    # (metric name, DeviceSample field, help)
    ("gpu_memory_used_bytes", "memory_used_bytes", "GPU memory in use (bytes), from NVML."),
    ("gpu_memory_total_bytes", "memory_total_bytes", "GPU memory size (bytes), from NVML."),
    ("gpu_utilization_ratio", "gpu_utilization", "Fraction of the last period a kernel ran on the GPU (0..1)."),
    ("gpu_memory_utilization_ratio", "memory_utilization", "Fraction of the last period GPU memory was busy (0..1)."),
    ("gpu_temperature_celsius", "temperature_c", "GPU core temperature (degrees Celsius)."),
    ("gpu_power_watts", "power_w", "GPU board power draw (watts)."),
    ("gpu_ecc_uncorrected_errors", "ecc_errors", "Uncorrected ECC errors since the driver loaded (volatile count)."),
)


def _value(x: float | int | None) -> float:
    return math.nan if x is None else float(x)


class AgentMetrics:
    """Every metric of the agent.

    Args:
        registry: where to register (never the global default registry).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._gpu = {
            field: Gauge(name, doc, ["gpu"], registry=registry) for name, field, doc in _GPU_GAUGES
        }
        self.gpu_fault = Gauge("gpu_fault", "1 when the GPU reports a fault (ECC, Xid, NVML error), else 0.", ["gpu"], registry=registry)
        self.latency_p95 = Gauge(
            "inference_latency_p95_ms",
            "P95 time to first token of the local engine over the agent's window (milliseconds); NaN when unknown.",
            registry=registry,
        )
        self.kv_usage = Gauge("inference_kv_cache_usage_ratio", "Fraction of the engine's KV block pool in use (0..1).", registry=registry)
        self.kv_free = Gauge("inference_kv_blocks_free", "Free KV blocks in the engine's pool (blocks).", registry=registry)
        self.kv_total = Gauge("inference_kv_blocks_total", "KV blocks in the engine's pool (blocks).", registry=registry)
        self.running = Gauge("inference_requests_running", "Requests running in the engine.", registry=registry)
        self.waiting = Gauge("inference_requests_waiting", "Requests waiting in the engine's queue.", registry=registry)
        self.healthy = Gauge("llm_extproc_agent_healthy", "1 when the node should take traffic (no device fault, engine /health passing).", registry=registry)
        self.gpu_healthy = Gauge("llm_extproc_agent_gpu_healthy", "1 when no GPU reports a fault.", registry=registry)
        self.engine_healthy = Gauge("llm_extproc_agent_engine_healthy", "1 when the engine's /health passes.", registry=registry)
        self.weight = Gauge("llm_extproc_agent_weight", "The node's routing weight (0..1), as sent in LoadReport.weight.", registry=registry)
        self.sample_errors = Counter(
            "llm_extproc_agent_sample_errors",
            "Failed readings, by source (gpu, engine_metrics, engine_health).",
            ["source"],
            registry=registry,
        )
        self.last_sample = Gauge(
            "llm_extproc_agent_last_sample_timestamp_seconds", "When the latest sample was taken (Unix seconds).", registry=registry
        )
        for source in SAMPLE_ERROR_SOURCES:
            self.sample_errors.labels(source)

    def observe(self, sample: NodeSample) -> None:
        """Set every gauge from a sample and count its failed readings."""
        for d in sample.devices:
            gpu = str(d.index)
            for field, gauge in self._gpu.items():
                gauge.labels(gpu).set(_value(getattr(d, field)))
            self.gpu_fault.labels(gpu).set(1 if d.fault else 0)
        gpu_errors = sum(d.read_errors for d in sample.devices)
        if gpu_errors:
            self.sample_errors.labels("gpu").inc(gpu_errors)
        e = sample.engine
        reachable = e is not None and e.reachable
        self.latency_p95.set(_value(e.ttft_p95_ms if e is not None else None))
        self.kv_usage.set(e.kv_usage if reachable else math.nan)
        self.kv_free.set(_value(e.kv_blocks_free if e is not None else None))
        self.kv_total.set(_value(e.kv_blocks_total if e is not None else None))
        self.running.set(e.running if reachable else math.nan)
        self.waiting.set(e.waiting if reachable else math.nan)
        self.engine_healthy.set(math.nan if e is None else float(e.healthy))
        if e is not None and e.metrics_error:
            self.sample_errors.labels("engine_metrics").inc()
        if e is not None and e.health_error:
            self.sample_errors.labels("engine_health").inc()
        self.gpu_healthy.set(0 if sample.gpu_fault else 1)
        self.healthy.set(1 if sample.healthy else 0)
        self.weight.set(sample.weight)
        self.last_sample.set(sample.taken_at)


class MetricsServer:
    """aiohttp server exposing a registry at `GET /metrics` and the node's health at
    `GET /healthz` (200 while serving, 503 otherwise: what Envoy's HTTP health checks of the
    tier clusters read, since Envoy only runs gRPC health checks on HTTP/2 clusters).

    Args:
        registry: what to expose.
        host, port: listen address (port 0 picks a free one; `.port` holds the bound port after
            `start()`).
        is_healthy: the node's overall verdict (the gRPC health service's "" status); None
            means always healthy.
    """

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, is_healthy: Callable[[], bool] | None = None
    ) -> None:
        self._is_healthy = is_healthy
        self._registry = registry
        self._host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen.

        Raises:
            OSError: the address cannot be bound.
        """
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        self._runner, self.port = await start_site(app, self._host, self.port)

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        ok = self._is_healthy is None or self._is_healthy()
        return web.Response(status=200 if ok else 503, text="SERVING\n" if ok else "NOT_SERVING\n")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry), headers={"content-type": CONTENT_TYPE_LATEST})
