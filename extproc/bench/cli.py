"""`llm-extproc analyze | demo | up | bench`: trace analysis, the local stack, policy comparison.

Options live here; what the stack commands do is in `extproc.bench.commands`.
"""

from __future__ import annotations

import enum
from pathlib import Path

import typer

__all__ = ["analyze", "bench", "demo", "up"]


class TraceFormatChoice(str, enum.Enum):
    """`--format` values."""

    auto = "auto"
    mooncake = "mooncake"
    azure = "azure"
    burstgpt = "burstgpt"
    sharegpt = "sharegpt"
    mtbench = "mtbench"


def analyze(
    path: Path = typer.Argument(
        ..., help="trace file (Mooncake JSONL, Azure 2023 CSV, BurstGPT CSV, ShareGPT JSON, MT-Bench "
        "question.jsonl), or 'synthetic' for the built-in workload"
    ),
    format: TraceFormatChoice = typer.Option(TraceFormatChoice.auto, "--format", help="trace format; auto detects it from the content"),
    json_path: Path | None = typer.Option(None, "--json", help="also write the analysis as JSON to this file"),
    plot: Path | None = typer.Option(None, "--plot", help="write length histograms and the arrival rate to this PNG"),
    truncate: int | None = typer.Option(
        None, "--truncate", min=1, help="report what head + tail truncation to this many tokens would cut"
    ),
    limit: int | None = typer.Option(None, "--limit", min=0, help="read at most this many requests"),
    rate: float = typer.Option(
        1.0, "--rate", min=0.0, help="arrival rate for ShareGPT, MT-Bench and 'synthetic' (requests/s)"
    ),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="multiply the trace's arrival rate"),
    start_offset: float = typer.Option(0.0, "--start-offset", help="skip this many seconds of the trace"),
    seed: int = typer.Option(0, "--seed", help="seed of synthesized arrivals / the synthetic workload"),
) -> None:
    """Token-length distribution, tiers, arrivals and prefix reuse of a trace."""
    import orjson
    from rich.console import Console

    from extproc.bench.analyze import analyze_trace, render_analysis
    from extproc.bench.traces import Trace, TraceFormatError, load_trace

    console = Console()
    err = Console(stderr=True)
    try:
        if str(path) == "synthetic" and not path.exists():
            from extproc.bench.workload import WorkloadSpec, synthetic_workload

            requests = synthetic_workload(WorkloadSpec(requests=10_000 if limit is None else limit, rate=rate, seed=seed))
            trace = Trace(path=path, format="synthetic", requests=requests, synthesized_arrivals=True)
        else:
            trace = load_trace(
                path,
                format=format.value,
                limit=limit,
                rate_scale=rate_scale,
                start_offset=start_offset,
                rate=rate,
                seed=seed,
            )
        analysis = analyze_trace(trace, truncate=truncate)
    except (TraceFormatError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    render_analysis(analysis, console)
    try:
        if json_path is not None:
            json_path.write_bytes(orjson.dumps(analysis, option=orjson.OPT_INDENT_2))
            console.print(f"wrote {json_path}")
        if plot is not None:
            from extproc.bench.plots import plot_trace

            plot_trace(trace, plot)
            console.print(f"wrote {plot}")
    except OSError as exc:
        err.print(f"[red]error:[/red] cannot write: {exc}", highlight=False)
        raise typer.Exit(2) from None


# ── demo, up, bench ─────────────────────────────────────────────────────────────────────────
# Defaults measured on the 2-core development machine (docs/benchmarks.md): the demo finishes in
# about two minutes including start-up, and no run falls behind its schedule for more than 1 %
# of its sends.
DEMO_REQUESTS = 400
DEMO_RATE = 4.0
DEMO_SPEED = 1.0
STREAM_INTERVAL = 8
BENCH_REQUESTS = 600
BENCH_RATE_SCALE = "1.0"
BENCH_POLICIES = "envoy-round-robin,envoy-least-request,llm-extproc"


def _policy_list() -> str:
    from extproc.bench.policies import POLICIES

    return "; ".join(f"{name} ({p.description})" for name, p in POLICIES.items())


def _fail(message: str) -> typer.Exit:
    from rich.console import Console

    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(2)


def _parse_scales(text: str) -> list[float]:
    import math

    try:
        scales = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _fail(f"--rate-scale must be numbers separated by commas, got {text!r}") from None
    if not scales or any(not (s > 0 and math.isfinite(s)) for s in scales):
        raise _fail(f"--rate-scale values must be positive numbers, got {text!r}")
    return scales


def _common(
    *, policy_names: str, speed: float, stream_interval: int, seed: int, port: int
):  # type: ignore[no-untyped-def]
    """Policies and stack settings from shared options; bad values exit 2 with a message."""
    from extproc.bench.policies import PolicyError, parse_policies
    from extproc.bench.stacks import PortBusyError, StackSettings, check_port_free

    try:
        policies = parse_policies(policy_names)
        check_port_free(port)
    except (PolicyError, PortBusyError) as exc:
        raise _fail(str(exc)) from None
    if not speed > 0:
        raise _fail(f"--speed must be > 0, got {speed}")
    return policies, StackSettings(speed=speed, stream_interval=stream_interval, seed=seed, port=port)


def _workload(trace: Path | None, format: TraceFormatChoice, requests: int | None, duration: float | None,
              rate_scale: float, rate: float, seed: int):  # type: ignore[no-untyped-def]
    from extproc.bench.runner import WorkloadOptions, load_workload
    from extproc.bench.traces import TraceFormatError

    try:
        return load_workload(WorkloadOptions(
            trace=trace, format=format.value, requests=requests, duration_s=duration, rate_scale=rate_scale,
            rate=rate, seed=seed,
        ))  # fmt: skip
    except (TraceFormatError, ValueError) as exc:
        raise _fail(str(exc)) from None


_TRACE_HELP = "trace to replay (formats of `analyze`); default: the synthetic workload (Poisson arrivals)"


def demo(
    trace: Path | None = typer.Option(None, "--trace", help=_TRACE_HELP),
    format: TraceFormatChoice = typer.Option(TraceFormatChoice.auto, "--format", help="trace format"),
    requests: int | None = typer.Option(None, "--requests", min=1, help=f"replay at most this many requests [synthetic default: {DEMO_REQUESTS}]"),
    duration: float | None = typer.Option(None, "--duration", help="replay only the first this-many seconds of arrivals"),
    rate_scale: float = typer.Option(1.0, "--rate-scale", help="multiply the arrival rate"),
    rate: float = typer.Option(DEMO_RATE, "--rate", help="arrival rate of the synthetic workload (requests/s)"),
    speed: float = typer.Option(DEMO_SPEED, "--speed", help="simulated seconds per wall second (simulators and replay)"),
    stream_interval: int = typer.Option(STREAM_INTERVAL, "--stream-interval", min=1, help="output tokens per streamed chunk"),
    policy: str = typer.Option("llm-extproc", "--policy", help="routing policy (see `bench --help`)"),
    seed: int = typer.Option(0, "--seed", help="seed of the workload and the simulators"),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="client-facing port (0 = any free port)"),
    json_path: Path | None = typer.Option(None, "--json", help="write the JSON summary (the bench report shape) here"),
    plot: Path | None = typer.Option(Path("llm-extproc-demo.png"), "--plot", help="PNG: TTFT CDF per endpoint, load over time"),
    slo_ttft_ms: float = typer.Option(2000.0, "--slo-ttft-ms", help="goodput SLO: TTFT limit (ms)"),
    slo_itl_ms: float = typer.Option(100.0, "--slo-itl-ms", help="goodput SLO: mean inter-token latency limit (ms)"),
) -> None:
    """The whole stack locally: Envoy, llm-extproc, four simulated vLLM endpoints (2× H100, 2× A100,
    Qwen3-8B) and a replayed workload; prints a result table, writes a PNG (and JSON)."""
    import asyncio

    from rich.console import Console

    from extproc.bench.commands import DemoOptions, Outputs, run_demo
    from extproc.bench.results import SLO
    from extproc.bench.runner import ReplayOptions

    policies, settings = _common(policy_names=policy, speed=speed, stream_interval=stream_interval, seed=seed, port=port)
    if len(policies) != 1:
        raise _fail("--policy takes one policy name")
    if policies[0].unavailable():
        raise _fail(f"{policies[0].name}: {policies[0].unavailable()}")
    if trace is None and requests is None and duration is None:
        requests = DEMO_REQUESTS
    workload = _workload(trace, format, requests, duration, rate_scale, rate, seed)
    options = DemoOptions(
        policy=policies[0], workload=workload, stack=settings, replay=ReplayOptions(speed=speed),
        outputs=Outputs(json_path=json_path, plot_path=plot), slo=SLO(ttft_ms=slo_ttft_ms, itl_ms=slo_itl_ms),
    )  # fmt: skip
    raise typer.Exit(asyncio.run(run_demo(options, Console())))


def up(
    policy: str = typer.Option("llm-extproc", "--policy", help="routing policy (see `bench --help`)"),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="client-facing port (0 = any free port)"),
    speed: float = typer.Option(1.0, "--speed", help="simulated seconds per wall second"),
    stream_interval: int = typer.Option(1, "--stream-interval", min=1, help="output tokens per streamed chunk"),
    seed: int = typer.Option(0, "--seed", help="seed of the simulators"),
) -> None:
    """The demo's stack, kept running for your own OpenAI clients; prints every URL. Ctrl-C stops it."""
    import asyncio

    from rich.console import Console

    from extproc.bench.commands import run_up

    policies, settings = _common(policy_names=policy, speed=speed, stream_interval=stream_interval, seed=seed, port=port)
    if len(policies) != 1:
        raise _fail("--policy takes one policy name")
    if policies[0].unavailable():
        raise _fail(f"{policies[0].name}: {policies[0].unavailable()}")
    raise typer.Exit(asyncio.run(run_up(policies[0], settings, Console())))


def bench(
    trace: Path | None = typer.Option(None, "--trace", help=_TRACE_HELP),
    policies: str = typer.Option(
        BENCH_POLICIES, "--policies", help="comma-separated policy names (listed above), or all"
    ),
    requests: int | None = typer.Option(BENCH_REQUESTS, "--requests", min=1, help="replay this many requests per run"),
    duration: float | None = typer.Option(None, "--duration", help="replay only the first this-many seconds of arrivals"),
    rate_scale: str = typer.Option(
        BENCH_RATE_SCALE, "--rate-scale", help="multiply the arrival rate; several (0.5,1.0,1.2) give goodput against load"
    ),
    rate: float = typer.Option(DEMO_RATE, "--rate", help="arrival rate of the synthetic workload (requests/s)"),
    format: TraceFormatChoice = typer.Option(TraceFormatChoice.auto, "--format", help="trace format"),
    seed: int = typer.Option(0, "--seed", help="seed of the workload and the simulators"),
    speed: float = typer.Option(1.0, "--speed", help="simulated seconds per wall second (≤ 2 keeps Python overheads small)"),
    stream_interval: int = typer.Option(STREAM_INTERVAL, "--stream-interval", min=1, help="output tokens per streamed chunk"),
    json_path: Path | None = typer.Option(None, "--json", help="write the report (JSON) here"),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: TTFT CDF per policy (+ <name>-goodput.png for several loads)"),
    slo_ttft_ms: float = typer.Option(2000.0, "--slo-ttft-ms", help="goodput SLO: TTFT limit (ms)"),
    slo_itl_ms: float = typer.Option(100.0, "--slo-itl-ms", help="goodput SLO: mean inter-token latency limit (ms)"),
    request_timeout: float = typer.Option(120.0, "--request-timeout", help="per-request limit (wall seconds)"),
) -> None:
    """Replay the same requests through each policy in turn (fresh simulators for each) and compare."""
    import asyncio

    from rich.console import Console

    from extproc.bench.commands import BenchOptions, Outputs, run_bench
    from extproc.bench.results import SLO
    from extproc.bench.runner import ReplayOptions

    chosen, settings = _common(policy_names=policies, speed=speed, stream_interval=stream_interval, seed=seed, port=0)
    scales = _parse_scales(rate_scale)
    if request_timeout <= 0:
        raise _fail(f"--request-timeout must be > 0, got {request_timeout}")
    workload = _workload(trace, format, requests, None, 1.0, rate, seed)
    options = BenchOptions(
        policies=chosen, workload=workload, rate_scales=scales, duration_s=duration, stack=settings,
        replay=ReplayOptions(speed=speed, request_timeout_s=request_timeout),
        outputs=Outputs(json_path=json_path, plot_path=plot), slo=SLO(ttft_ms=slo_ttft_ms, itl_ms=slo_itl_ms),
    )  # fmt: skip
    raise typer.Exit(asyncio.run(run_bench(options, Console())))


bench.__doc__ = (
    "Replay the same requests through each policy in turn (fresh simulators for each) and compare "
    "goodput and latency.\n\nPolicies: " + _policy_list() + "."
)
