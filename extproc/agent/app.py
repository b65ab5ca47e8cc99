"""`NodeAgent`: the node agent's lifecycle — sample, publish, serve, stop.

Every `period_s` seconds the agent reads the GPU source and the engine concurrently, turns
them into a `NodeSample` (verdict, weight), updates the Prometheus gauges, publishes the
`LoadReport` to `NodeLoad` watchers and sets the `grpc.health.v1` statuses
(`extproc.agent.service`). One `grpc.aio` server on `grpc_port` serves NodeLoad and Health;
an aiohttp server on `metrics_port` serves `/metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc._proto.llm_extproc.v1 import node_load_pb2_grpc as pb_grpc
from extproc.agent.devices import GpuSource
from extproc.agent.engine import EngineProbe, EngineSample
from extproc.agent.exporter import AgentMetrics, MetricsServer
from extproc.agent.report import NodeSample, assess, to_proto
from extproc.agent.service import ENGINE_SERVICE, GPU_SERVICE, NODE_LOAD_SERVICE, NodeLoadServicer, ReportBoard
from extproc.agent.weight import WeightParams

__all__ = ["AgentSettings", "NodeAgent"]

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """What the agent listens on and how it samples.

    Attributes:
        host: listen address of both servers.
        grpc_port / metrics_port: ports (0 picks a free one; see `NodeAgent.grpc_port`).
        period_s: sampling period (seconds); also the `NodeLoad.Watch` cadence.
        engine_url: the local engine's base URL, or None to watch no engine.
        engine_timeout_s: per-request timeout towards the engine and `sim:` GPU (seconds).
        unhealthy_after: consecutive engine `/health` failures before NOT_SERVING.
        latency_window_s: TTFT P95 window (seconds).
        node: the node's name in reports (default: the host name).
        weight: the weight formula's coefficients.

    Raises:
        ValueError: a non-positive period, timeout or window, or `unhealthy_after` < 1.
    """

    host: str = "0.0.0.0"
    grpc_port: int = 9100
    metrics_port: int = 9101
    period_s: float = 1.0
    engine_url: str | None = "http://127.0.0.1:8000"
    engine_timeout_s: float = 1.0
    unhealthy_after: int = 2
    latency_window_s: float = 30.0
    node: str = field(default_factory=socket.gethostname)
    weight: WeightParams = field(default_factory=WeightParams)

    def __post_init__(self) -> None:
        for name in ("period_s", "engine_timeout_s", "latency_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be at least 1, got {self.unhealthy_after}")
        for name in ("grpc_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {getattr(self, name)}")


def _grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class NodeAgent:
    """One node agent.

    Args:
        settings: listen addresses and sampling settings.
        gpu: the GPU source (not started; `start()` starts it).
        registry: Prometheus registry (a fresh one by default; never the global one).

    After `start()`: `grpc_port` and `metrics_port` hold the bound ports, `latest` the latest
    sample, `metrics` the gauges, `board` the published reports.
    """

    def __init__(self, settings: AgentSettings, gpu: GpuSource, *, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = AgentMetrics(registry if registry is not None else CollectorRegistry())
        self.board = ReportBoard()
        self.latest: NodeSample | None = None
        self.grpc_port = 0
        self.metrics_port = 0
        self._gpu = gpu
        self._engine: EngineProbe | None = None
        self._health = health.aio.HealthServicer()
        self._statuses: dict[str, int] = {}
        self._grpc: grpc.aio.Server | None = None
        self._http: MetricsServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the sources, take a first sample, then serve and keep sampling.

        Raises:
            GpuSourceError: the GPU source cannot be used.
            OSError: a listen address cannot be bound.
        """
        s = self.settings
        await self._gpu.start()
        try:
            if s.engine_url:
                self._engine = EngineProbe(
                    s.engine_url,
                    timeout_s=s.engine_timeout_s,
                    latency_window_s=s.latency_window_s,
                    unhealthy_after=s.unhealthy_after,
                )
                await self._engine.start()
            await self.sample_once()
            await self._serve_grpc()
            self._http = MetricsServer(
                self.metrics.registry, s.host, s.metrics_port, is_healthy=lambda: self.latest is not None and self.latest.healthy
            )
            await self._http.start()
            self.metrics_port = self._http.port
        except BaseException:
            await self.aclose()
            raise
        self._task = asyncio.create_task(self._loop(), name="agent-sampler")
        log.info("agent sampling every %.3g s; gRPC on port %d, metrics on port %d", s.period_s, self.grpc_port, self.metrics_port)

    async def _serve_grpc(self) -> None:
        address = _grpc_address(self.settings.host, self.settings.grpc_port)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_NodeLoadServicer_to_server(NodeLoadServicer(self.board), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot listen on {address} (address in use or not available)")
        await server.start()
        self._grpc = server
        self.grpc_port = port

    async def aclose(self, grace_s: float = 1.0) -> None:
        """Stop sampling, end Watch streams, report NOT_SERVING, stop both servers, close sources."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.board.close()
        await self._health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
            self._grpc = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._engine is not None:
            await self._engine.aclose()
            self._engine = None
        await self._gpu.aclose()

    async def _loop(self) -> None:
        period = self.settings.period_s
        while True:
            started = time.monotonic()
            try:
                await self.sample_once()
            except Exception:  # never let the sampler die; the next period tries again
                log.exception("sample failed")
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def _engine_sample(self) -> EngineSample | None:
        return await self._engine.sample() if self._engine is not None else None

    async def sample_once(self) -> NodeSample:
        """Read the GPU source and the engine now; publish the result everywhere."""
        taken_at = time.time()
        devices, engine = await asyncio.gather(self._gpu.sample(), self._engine_sample())
        sample = assess(self.settings.node, taken_at, devices, engine, self.settings.weight)
        previous, self.latest = self.latest, sample
        self.metrics.observe(sample)
        self.board.publish(to_proto(sample))
        await self._set_health(sample)
        if previous is None or previous.healthy != sample.healthy:
            if sample.healthy:
                log.info("node %s healthy", sample.node)
            else:
                log.warning("node %s NOT serving: %s", sample.node, sample.reason)
        return sample

    async def _set_health(self, sample: NodeSample) -> None:
        node = _SERVING if sample.healthy else _NOT_SERVING
        wanted = {"": node, NODE_LOAD_SERVICE: node, GPU_SERVICE: _NOT_SERVING if sample.gpu_fault else _SERVING}
        if sample.engine is not None:
            wanted[ENGINE_SERVICE] = _SERVING if sample.engine.healthy else _NOT_SERVING
        for service, status in wanted.items():
            if self._statuses.get(service) != status:
                self._statuses[service] = status
                await self._health.set(service, status)
