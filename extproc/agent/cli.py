"""`llm-extproc agent`: run the node agent until SIGTERM/SIGINT.

Prints one line when ready:
`agent listening grpc=HOST:PORT metrics=HOST:PORT node=NAME gpu-source=SPEC`.
Exit status 2 for unusable options (a bad `--gpu-source`, `nvml` without the NVML library),
1 when a port cannot be bound.
"""

from __future__ import annotations

import typer

__all__ = ["agent"]


def agent(
    engine_url: str = typer.Option(
        "http://127.0.0.1:8000", help="the local engine's base URL (/metrics, /health); 'none' to watch no engine"
    ),
    gpu_source: str = typer.Option("nvml", help="nvml | sim:URL (a simulator's base URL, e.g. sim:http://127.0.0.1:8001) | none"),
    grpc_port: int = typer.Option(9100, min=0, max=65535, help="gRPC port: grpc.health.v1 + llm_extproc.v1.NodeLoad (0 = any free port)"),
    metrics_port: int = typer.Option(9101, min=0, max=65535, help="Prometheus /metrics port (0 = any free port)"),
    host: str = typer.Option("127.0.0.1", help="listen address of both ports (0.0.0.0 to serve other hosts)"),
    period: float = typer.Option(1.0, help="sampling period (seconds); also NodeLoad.Watch's cadence"),
    node: str = typer.Option("", help="node name in reports (default: the host name)"),
    engine_timeout: float = typer.Option(1.0, help="timeout of each engine or sim request (seconds)"),
    unhealthy_after: int = typer.Option(2, help="consecutive failed engine /health probes before NOT_SERVING"),
    latency_window: float = typer.Option(30.0, help="window of the TTFT P95 (seconds)"),
    alpha: float = typer.Option(1 / 3, help="weight of the latency term min(1, latency-ref-ms / TTFT P95)"),
    beta: float = typer.Option(1 / 3, help="weight of the free-KV term free_kv / total_kv"),
    gamma: float = typer.Option(1 / 3, help="weight of the idle-GPU term 1 - gpu_util"),
    latency_ref_ms: float = typer.Option(200.0, help="TTFT P95 (ms) at or below which the latency term is 1"),
    log_level: str = typer.Option("info", help="debug, info, warning, error, critical"),
) -> None:
    """Run the node agent: NVML + the local engine's metrics → health, load reports, Prometheus."""
    import asyncio
    import sys

    from extproc.agent.app import AgentSettings, NodeAgent
    from extproc.agent.devices import GpuSourceError
    from extproc.agent.sources import gpu_source_from_spec
    from extproc.agent.weight import WeightParams
    from extproc.clitools import fail, setup_logging, skip_final_collection, stop_on_signals

    setup_logging(log_level)
    try:
        weight = WeightParams(alpha=alpha, beta=beta, gamma=gamma, latency_ref_ms=latency_ref_ms)
        extra = {"node": node} if node else {}
        settings = AgentSettings(
            host=host,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            period_s=period,
            engine_url=None if engine_url in ("", "none") else engine_url,
            engine_timeout_s=engine_timeout,
            unhealthy_after=unhealthy_after,
            latency_window_s=latency_window,
            weight=weight,
            **extra,
        )
        source = gpu_source_from_spec(gpu_source, timeout_s=engine_timeout)
    except (ValueError, GpuSourceError) as exc:
        raise fail(str(exc)) from None

    async def run() -> None:
        app = NodeAgent(settings, source)
        stop = stop_on_signals()
        try:
            await app.start()
        except GpuSourceError as exc:
            raise fail(str(exc)) from None
        except OSError as exc:
            raise fail(str(exc), 1) from None
        print(
            f"agent listening grpc={host}:{app.grpc_port} metrics={host}:{app.metrics_port} "
            f"node={settings.node} gpu-source={gpu_source}",
            flush=True,
        )
        await stop.wait()
        print("agent shutting down", file=sys.stderr, flush=True)
        await app.aclose()

    asyncio.run(run())
    skip_final_collection()
