"""`llm-extproc analyze | demo | up | bench`: trace analysis, the local stack, policy comparison.

Options live here; what the stack commands do is in `extproc.bench.commands`.
"""

from __future__ import annotations

import enum
from pathlib import Path

import typer

from extproc.clitools import fail as _fail

__all__ = ["analyze", "bench", "demo", "up"]


class TraceFormatChoice(str, enum.Enum):
    """`--format` values."""

    auto = "auto"
    mooncake = "mooncake"
    azure = "azure"
    burstgpt = "burstgpt"
    sharegpt = "sharegpt"
    mtbench = "mtbench"
    decisions = "decisions"


def analyze(
    path: Path = typer.Argument(
        ..., help="trace file (Mooncake JSONL, Azure 2023 CSV, BurstGPT CSV, ShareGPT JSON, MT-Bench "
        "question.jsonl, llm-extproc's own decision log), or 'synthetic' for the built-in workload"
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
    """Token-length distribution, tiers (and tier boundaries suggested for it), arrivals and prefix reuse of a
    trace or of llm-extproc's decision log."""
    import orjson
    from rich.console import Console

    from extproc.bench.analyze import analyze_trace, render_analysis
    from extproc.bench.traces import Trace, TraceFormatError, load_trace

    console = Console()
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
        raise _fail(str(exc)) from None
    render_analysis(analysis, console)
    try:
        if json_path is not None:
            json_path.write_bytes(orjson.dumps(analysis, option=orjson.OPT_INDENT_2))
            console.print(f"wrote {json_path}")
        if plot is not None:
            from extproc.bench.plots import plot_trace

            plot_trace(trace, plot, tier_edges=analysis["suggested_tiers"]["edges"])
            console.print(f"wrote {plot}")
    except OSError as exc:
        raise _fail(f"cannot write: {exc}") from None


# ── demo, up, bench ─────────────────────────────────────────────────────────────────────────
# Defaults measured on the 2-core development machine (docs/benchmarks.md): the demo finishes in
# about two minutes including start-up, and no run falls behind its schedule for more than 1 %
# of its sends.
DEMO_REQUESTS = 700
DEMO_RATE = 8.0
DEMO_SPEED = 1.0
STREAM_INTERVAL = 8
BENCH_REQUESTS = 600
BENCH_LOAD = 0.8
"""`--rate-scale auto`: offered prompt + output tokens/s as a fraction of the fleet's prefill capacity."""
BENCH_MAX_WALL_RPS = 15.0
"""`--speed auto`: the most requests per wall second the 2-core machine replays on schedule."""
BENCH_POLICIES = "envoy-round-robin,envoy-least-request,llm-extproc"
DEFAULT_FLEET_SPEC = "h100-qwen3-8b,h100-qwen3-8b,a100-qwen3-8b,a100-qwen3-8b"  # extproc.stack.fleet.DEFAULT_FLEET


def _policy_list() -> str:
    from extproc.bench.policies import POLICIES

    # One per line, under click's `\b` (no rewrapping): a wrapped list broke names at hyphens.
    return "\b\n" + "\n".join(f"  {name}: {p.description}" for name, p in POLICIES.items())


def _console():  # type: ignore[no-untyped-def]
    """stdout console; wide when not a terminal, so logs of tables stay readable."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


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
    *, policy_names: str, fleet: str, speed: float, stream_interval: int, seed: int, port: int
):  # type: ignore[no-untyped-def]
    """Policies and stack settings from shared options; bad values exit 2 with a message."""
    from extproc.bench.policies import PolicyError, parse_policies
    from extproc.bench.stacks import PortBusyError, StackSettings, check_port_free
    from extproc.sim.profiles import PROFILES
    from extproc.stack.fleet import NAMED_FLEETS, fleet_spec

    try:
        policies = parse_policies(policy_names)
        check_port_free(port)
    except (PolicyError, PortBusyError) as exc:
        raise _fail(str(exc)) from None
    if not speed > 0:
        raise _fail(f"--speed must be > 0, got {speed}")
    named = fleet_spec(fleet)
    profiles = named.profiles
    unknown = [p for p in profiles if p not in PROFILES]
    if not profiles or unknown:
        raise _fail(
            f"--fleet: unknown simulator profile(s) {unknown or fleet!r}; known: {', '.join(PROFILES)} (or a named fleet: {', '.join(NAMED_FLEETS)})"
        )
    models = {PROFILES[p].model for p in profiles}
    if len(models) > 1:
        raise _fail(f"--fleet: every endpoint must serve the same model, got {sorted(models)}")
    settings = StackSettings(
        profiles=profiles, speed=speed, stream_interval=stream_interval, seed=seed, port=port, roles=named.roles,
        lora=named.lora,
    )
    return policies, settings


def _workload(trace: Path | None, format: TraceFormatChoice, requests: int | None, duration: float | None,
              rate_scale: float, rate: float, seed: int, settings, console):  # type: ignore[no-untyped-def]
    """The workload, prompts fitted to the fleet's context; bad input exits 2."""
    from extproc.bench.runner import WorkloadOptions, fit_context, load_workload
    from extproc.bench.traces import TraceFormatError
    from extproc.sim.profiles import PROFILES

    try:
        workload = load_workload(WorkloadOptions(
            trace=trace, format=format.value, requests=requests, duration_s=duration, rate_scale=rate_scale,
            rate=rate, seed=seed,
        ))  # fmt: skip
    except (TraceFormatError, ValueError) as exc:
        raise _fail(str(exc)) from None
    limit = min(PROFILES[p].max_model_len for p in settings.profiles)
    workload, cut = fit_context(workload, limit)
    if cut:
        console.print(
            f"{cut:,} of {len(workload.requests):,} requests exceed the {limit:,}-token context: replayed with "
            "their leading tokens only", highlight=False,
        )  # fmt: skip
    return workload


_FLEET_HELP = (
    "simulator profiles, comma-separated (one endpoint each), or a named fleet: lora (4× H100, 32 LoRA adapters, 4 GPU slots each), pd (2 prefill + 2 decode H100s, P/D disaggregation)"
)
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
    fleet: str = typer.Option(DEFAULT_FLEET_SPEC, "--fleet", help=_FLEET_HELP),
    seed: int = typer.Option(0, "--seed", help="seed of the workload and the simulators"),
    port: int = typer.Option(0, "--port", min=0, max=65535, help="client-facing port (0 = any free port)"),
    json_path: Path | None = typer.Option(None, "--json", help="write the JSON summary (the bench report shape) here"),
    plot: Path | None = typer.Option(None, "--plot", help="write a PNG here: TTFT CDF per endpoint, load over time (`make demo`: out/demo.png)"),
    slo_ttft_ms: float = typer.Option(2000.0, "--slo-ttft-ms", help="goodput SLO: TTFT limit (ms)"),
    slo_itl_ms: float = typer.Option(100.0, "--slo-itl-ms", help="goodput SLO: mean inter-token latency limit (ms)"),
    extproc_config: Path | None = typer.Option(
        None, "--extproc-config", help="YAML merged into llm-extproc's config for the llm-extproc policies "
        "(e.g. scheduling.profiles.load-aware with other scorer weights)",
    ),
) -> None:
    """The whole stack locally: Envoy, llm-extproc, four simulated vLLM endpoints (2× H100, 2× A100,
    Qwen3-8B) and a replayed workload; prints a result table, and writes a PNG with --plot, JSON
    with --json (nothing into the working directory otherwise)."""
    import asyncio
    import dataclasses

    from extproc.bench.commands import DemoOptions, Outputs, run_demo
    from extproc.bench.results import SLO
    from extproc.bench.runner import ReplayOptions

    policies, settings = _common(policy_names=policy, fleet=fleet, speed=speed, stream_interval=stream_interval, seed=seed, port=port)
    if len(policies) != 1:
        raise _fail("--policy takes one policy name")
    if policies[0].unavailable():
        raise _fail(f"{policies[0].name}: {policies[0].unavailable()}")
    if trace is None and requests is None and duration is None:
        requests = DEMO_REQUESTS
    if extproc_config is not None:
        settings = dataclasses.replace(settings, server_overrides=_server_overrides(extproc_config, settings))
    console = _console()
    workload = _workload(trace, format, requests, duration, rate_scale, rate, seed, settings, console)
    options = DemoOptions(
        policy=policies[0], workload=workload, stack=settings, replay=ReplayOptions(speed=speed),
        outputs=Outputs(json_path=json_path, plot_path=plot), slo=SLO(ttft_ms=slo_ttft_ms, itl_ms=slo_itl_ms),
    )  # fmt: skip
    raise typer.Exit(asyncio.run(run_demo(options, console)))


def up(
    policy: str = typer.Option("llm-extproc", "--policy", help="routing policy (see `bench --help`)"),
    fleet: str = typer.Option(DEFAULT_FLEET_SPEC, "--fleet", help=_FLEET_HELP),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="client-facing port (0 = any free port)"),
    speed: float = typer.Option(1.0, "--speed", help="simulated seconds per wall second"),
    stream_interval: int = typer.Option(1, "--stream-interval", min=1, help="output tokens per streamed chunk"),
    seed: int = typer.Option(0, "--seed", help="seed of the simulators"),
    extproc_config: Path | None = typer.Option(
        None, "--extproc-config", help="YAML merged into llm-extproc's config for the llm-extproc policies "
        "(e.g. scheduling.profiles.load-aware with other scorer weights)",
    ),
    logs: Path | None = typer.Option(
        None, "--logs", help="write every child's log to this directory and keep it (default: a temp directory, "
        "removed on a clean stop)", file_okay=False,
    ),
) -> None:
    """The demo's stack, kept running for your own OpenAI clients; prints every URL. Ctrl-C stops it;
    so does a child (simulator, llm-extproc, Envoy) that exits on its own, named with its log tail."""
    import asyncio
    import dataclasses

    from extproc.bench.commands import run_up

    policies, settings = _common(policy_names=policy, fleet=fleet, speed=speed, stream_interval=stream_interval, seed=seed, port=port)
    if len(policies) != 1:
        raise _fail("--policy takes one policy name")
    if policies[0].unavailable():
        raise _fail(f"{policies[0].name}: {policies[0].unavailable()}")
    if extproc_config is not None:
        settings = dataclasses.replace(settings, server_overrides=_server_overrides(extproc_config, settings))
    console = _console()
    hint = _fleet_hint(policies[0], settings)
    if hint:
        console.print(hint, style="yellow", markup=False, highlight=False)
    raise typer.Exit(asyncio.run(run_up(policies[0], settings, console, logs)))


def _fleet_hint(policy, settings) -> str | None:  # type: ignore[no-untyped-def]
    """A line for a fleet the policy ignores half of: the LoRA fleet under an llm-extproc
    profile without an adapter scorer (it runs, adapter-blind), else None."""
    if settings.lora is None or policy.kind != "extproc":
        return None
    from extproc.config.schema import BUILTIN_PROFILES

    profile = BUILTIN_PROFILES.get(policy.profile or "")
    if profile is not None and any(s.type.startswith("lora-") for s in profile.scorers):
        return None
    return (
        f"note: the lora fleet under {policy.name} routes without regard to adapters "
        "(profile " + repr(policy.profile) + "); --policy llm-extproc-lora routes by adapter residency"
    )


def bench(
    trace: Path | None = typer.Option(None, "--trace", help=_TRACE_HELP),
    policies: str = typer.Option(
        BENCH_POLICIES, "--policies", help="comma-separated policy names (listed above), or all"
    ),
    requests: int | None = typer.Option(BENCH_REQUESTS, "--requests", min=1, help="replay this many requests per run"),
    duration: float | None = typer.Option(None, "--duration", help="replay only the first this-many seconds of arrivals"),
    rate_scale: str = typer.Option(
        "auto", "--rate-scale", help="multiply the arrival rate; several (0.5,1.0,1.2) give goodput against load; "
        f"auto: offer {BENCH_LOAD:g} × the fleet's prefill capacity in tokens/s (saturates envoy-least-request "
        "on the default fleet)",
    ),
    auto_load: float = typer.Option(BENCH_LOAD, "--auto-load", help="the load --rate-scale auto aims at (see there)"),
    rate: float = typer.Option(DEMO_RATE, "--rate", help="arrival rate of the synthetic workload (requests/s)"),
    format: TraceFormatChoice = typer.Option(TraceFormatChoice.auto, "--format", help="trace format"),
    fleet: str = typer.Option(DEFAULT_FLEET_SPEC, "--fleet", help=_FLEET_HELP),
    seed: int = typer.Option(0, "--seed", help="seed of the workload and the simulators"),
    speed: str = typer.Option(
        "auto", "--speed", help="simulated seconds per wall second; auto: 1, or slower when the offered load exceeds "
        f"{BENCH_MAX_WALL_RPS:g} requests per wall second (keeps the load generator on schedule on 2 cores)",
    ),
    stream_interval: int = typer.Option(STREAM_INTERVAL, "--stream-interval", min=1, help="output tokens per streamed chunk"),
    json_path: Path | None = typer.Option(None, "--json", help="write the report (JSON) here"),
    requests_out: Path | None = typer.Option(
        None, "--requests-out", help="write one JSON line per request (endpoint, TTFT, E2E, lag, ...) here"
    ),
    plot: Path | None = typer.Option(None, "--plot", help="PNG: TTFT CDF per policy (+ <name>-goodput.png for several loads)"),
    slo_ttft_ms: float = typer.Option(2000.0, "--slo-ttft-ms", help="goodput SLO: TTFT limit (ms)"),
    slo_itl_ms: float = typer.Option(100.0, "--slo-itl-ms", help="goodput SLO: mean inter-token latency limit (ms)"),
    request_timeout: float = typer.Option(120.0, "--request-timeout", help="per-request limit (simulated seconds)"),
    max_tokens: int | None = typer.Option(
        None, "--max-tokens", min=1, help="send this max_tokens on every request (at least its output length), "
        "min_tokens its output length and no ignore_eos, as clients with a huge budget do; default: max_tokens = "
        "the output length",
    ),
    extproc_config: Path | None = typer.Option(
        None, "--extproc-config", help="YAML merged into llm-extproc's config for the llm-extproc policies "
        "(e.g. scheduling.profiles.load-aware with other scorer weights)",
    ),
    report: str | None = typer.Option(
        None, "--report", help="run nothing: print the table of these --json reports (comma-separated, e.g. one "
        "per policy) as one; --json writes them as one report",
    ),
    tenants: str | None = typer.Option(
        None, "--tenants", help="multi-tenant mode: a YAML file (or inline YAML) of tenants, each with its own "
        "arrivals, workload, API key, retry behaviour and limits (extproc/bench/tenants.py); reports per tenant; "
        "one llm-extproc policy; --trace, --requests, --rate-scale and --rate do not apply",
    ),
) -> None:
    """Replay the same requests through each policy in turn (fresh simulators for each) and compare."""
    import asyncio
    import dataclasses

    from extproc.bench.commands import BenchOptions, Outputs, report_files, run_bench
    from extproc.bench.results import SLO
    from extproc.bench.runner import ReplayOptions, auto_rate_scale, auto_speed

    console = _console()
    if report is not None:
        paths = [Path(p.strip()) for p in report.split(",") if p.strip()]
        if not paths:
            raise _fail("--report takes one or more JSON files, comma-separated")
        if plot is not None or requests_out is not None:
            raise _fail("--report reads summaries only: --plot and --requests-out need the runs themselves")
        raise typer.Exit(report_files(paths, json_path, console))
    if tenants is not None:
        _bench_tenants(
            tenants, policies=policies, fleet=fleet, seed=seed, speed=speed, stream_interval=stream_interval,
            json_path=json_path, slo=SLO(ttft_ms=slo_ttft_ms, itl_ms=slo_itl_ms), request_timeout=request_timeout,
            extproc_config=extproc_config, console=console,
        )  # fmt: skip
    speed_value = 1.0 if speed == "auto" else _parse_speed(speed)
    chosen, settings = _common(
        policy_names=policies, fleet=fleet, speed=speed_value, stream_interval=stream_interval, seed=seed, port=0
    )
    if not (0 < request_timeout < float("inf")):  # also refuses NaN
        raise _fail(f"--request-timeout must be a finite number > 0, got {request_timeout}")
    if extproc_config is not None:
        settings = dataclasses.replace(settings, server_overrides=_server_overrides(extproc_config, settings))
    if not auto_load > 0:
        raise _fail(f"--auto-load must be > 0, got {auto_load}")
    workload = _workload(trace, format, requests, None, 1.0, rate, seed, settings, console)
    if rate_scale == "auto":
        try:
            scales = [round(auto_rate_scale(workload, settings.profiles, auto_load), 2)]
        except ValueError as exc:
            raise _fail(f"--rate-scale auto: {exc}") from None
        console.print(f"--rate-scale auto: ×{scales[0]:g} (offers {auto_load:g} × the fleet's prefill capacity)")
    else:
        scales = _parse_scales(rate_scale)
    if speed == "auto":
        speed_value = round(auto_speed((workload.offered_rps or 0) * max(scales), BENCH_MAX_WALL_RPS), 3)
        settings = dataclasses.replace(settings, speed=speed_value)
        console.print(f"--speed auto: {speed_value:g}")
    options = BenchOptions(
        policies=chosen, workload=workload, rate_scales=scales, duration_s=duration, stack=settings,
        replay=ReplayOptions(speed=speed_value, request_timeout_s=request_timeout, max_tokens=max_tokens),
        outputs=Outputs(json_path=json_path, plot_path=plot, requests_path=requests_out),
        slo=SLO(ttft_ms=slo_ttft_ms, itl_ms=slo_itl_ms),
    )  # fmt: skip
    raise typer.Exit(asyncio.run(run_bench(options, console)))


def _read_tenants(text: str):  # type: ignore[no-untyped-def]
    """`--tenants`: a file, or inline YAML (a value with a newline or starting with `{`)."""
    import yaml

    from extproc.bench.overlay import MAX_OVERLAY_BYTES
    from extproc.bench.tenants import TenantSpecError, parse_tenants

    inline = "\n" in text or text.lstrip().startswith("{")
    try:
        if inline:
            raw = text
        else:
            with Path(text).open("rb") as fh:
                data = fh.read(MAX_OVERLAY_BYTES + 1)
            if len(data) > MAX_OVERLAY_BYTES:
                raise _fail(f"--tenants: {text} is larger than {MAX_OVERLAY_BYTES} bytes")
            raw = data.decode("utf-8")
        return parse_tenants(yaml.safe_load(raw))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise _fail(f"--tenants: cannot read {'the inline spec' if inline else text}: {exc}") from None
    except TenantSpecError as exc:
        raise _fail(f"--tenants: {exc}") from None


def _bench_tenants(text: str, *, policies: str, fleet: str, seed: int, speed: str, stream_interval: int,
                   json_path: Path | None, slo, request_timeout: float, extproc_config: Path | None,
                   console) -> None:  # type: ignore[no-untyped-def]
    """`bench --tenants`: parse, build every tenant's workload, pick the speed, run; exits."""
    import asyncio
    import dataclasses

    from extproc.bench.commands import run_tenant_bench
    from extproc.bench.runner import auto_speed
    from extproc.bench.tenant_run import TenantRunOptions, prepare_tenants, tenant_server_overrides
    from extproc.bench.tenants import TenantSpecError
    from extproc.bench.traces import TraceFormatError
    from extproc.config.loader import ConfigError, config_from_mapping
    from extproc.bench.stacks import policy_server_config

    spec = _read_tenants(text)
    if policies == BENCH_POLICIES:
        policies = "llm-extproc"
    chosen, settings = _common(
        policy_names=policies, fleet=fleet, speed=1.0 if speed == "auto" else _parse_speed(speed),
        stream_interval=stream_interval, seed=seed, port=0,
    )  # fmt: skip
    if len(chosen) != 1 or chosen[0].kind != "extproc":
        raise _fail("--tenants runs one llm-extproc policy (tenants are told apart by its rate limiter)")
    if not (0 < request_timeout < float("inf")):
        raise _fail(f"--request-timeout must be a finite number > 0, got {request_timeout}")
    if extproc_config is not None:
        settings = dataclasses.replace(settings, server_overrides=_server_overrides(extproc_config, settings))
    sample = {f"127.0.0.1:{8000 + i}": p for i, p in enumerate(settings.profiles)}
    try:  # the tenants' limits and the spec's extproc_config, checked before anything starts
        merged = tenant_server_overrides(spec, settings.server_overrides)
        config_from_mapping(policy_server_config(chosen[0], dataclasses.replace(settings, server_overrides=merged), sample), source="--tenants")
    except ConfigError as exc:
        raise _fail(f"--tenants: the generated llm-extproc config is invalid: {exc}") from None
    options = TenantRunOptions(settings=settings, policy=chosen[0], slo=slo, seed=seed, request_timeout_s=request_timeout)
    try:
        prepared = prepare_tenants(spec, options)
    except (TenantSpecError, TraceFormatError, ValueError) as exc:
        raise _fail(f"--tenants: {exc}") from None
    if speed == "auto":
        total = sum(rate for _, rate in prepared)
        value = round(auto_speed(total, BENCH_MAX_WALL_RPS), 3)
        options = dataclasses.replace(options, settings=dataclasses.replace(settings, speed=value))
        console.print(f"--speed auto: {value:g} ({total:.1f} requests/s offered in all)", highlight=False)
    raise typer.Exit(asyncio.run(run_tenant_bench(spec, options, prepared, json_path, console)))


def _server_overrides(path: Path, fleet) -> dict:  # type: ignore[no-untyped-def]
    """`--extproc-config`: a YAML mapping that makes a valid llm-extproc config once merged into
    the one generated for `fleet` (its `profiles`, `roles` and `lora`: a `StackSettings` or an
    `extproc.stack.fleet.NamedFleet`; `extproc.bench.overlay.check_overlay`); anything else
    exits 2 with the reason."""
    from extproc.bench.overlay import OverlayError, check_overlay

    try:
        overrides, _ = check_overlay(path, fleet.profiles, roles=fleet.roles, lora=fleet.lora)
    except OverlayError as exc:
        raise _fail(f"--extproc-config: {exc}") from None
    _console().print(f"--extproc-config: {path} laid over llm-extproc's config for the llm-extproc policies", highlight=False)
    return overrides


def _parse_speed(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise _fail(f"--speed must be a number or auto, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise _fail(f"--speed must be > 0, got {text!r}")
    return value


bench.__doc__ = (
    "Replay the same requests through each policy in turn (fresh simulators for each) and compare "
    "goodput and latency. Policies:\n\n" + _policy_list()
)
