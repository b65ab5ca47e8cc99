"""What `llm-extproc demo`, `up` and `bench` do, once their options are parsed (`extproc.bench.cli`).

Each runs in one asyncio loop of the calling process: the load generator lives here, every
simulator, llm-extproc, Envoy and peer router is a child process in its own session, stopped by
PID on the way out, whether the command ends normally, fails, or gets SIGINT/SIGTERM
(`runner.Interrupts`). Child logs go to a temporary directory, removed after a clean run and
kept (its path printed) after a failure.

Return values are exit codes: 0 done, 1 a child failed, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import orjson
from rich.console import Console

from extproc.bench.policies import Policy
from extproc.bench.results import SLO, LabeledRun, Report, build_report, merge_reports, render_report, request_rows
from extproc.bench.runner import Interrupts, ReplayOptions, Workload, replay
from extproc.bench.stacks import PolicyStack, StackSettings

__all__ = ["BenchOptions", "DemoOptions", "Outputs", "report_files", "run_bench", "run_demo", "run_tenant_bench", "run_up"]

_BEHIND_WARN = 0.01  # behind-schedule fraction above which a run is flagged (CPU headroom gone)


@dataclass(frozen=True, slots=True)
class Outputs:
    """Where results go: the JSON report, the PNG figure and one JSON line per request
    (`bench` only; None: not written)."""

    json_path: Path | None = None
    plot_path: Path | None = None
    requests_path: Path | None = None


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """`demo`: one policy, one workload."""

    policy: Policy
    workload: Workload
    stack: StackSettings
    replay: ReplayOptions
    outputs: Outputs
    slo: SLO


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """`bench`: every policy on the same requests at every rate scale.

    Attributes:
        workload: the requests at rate scale 1 (each scale divides their arrival times).
        rate_scales: the loads to run, in order.
        duration_s: keep only arrivals within this many seconds of the first, after scaling.
    """

    policies: Sequence[Policy]
    workload: Workload
    rate_scales: Sequence[float]
    duration_s: float | None
    stack: StackSettings
    replay: ReplayOptions
    outputs: Outputs
    slo: SLO


class _Logs:
    """A dir for child logs: a temp dir removed when all went well and kept (and named)
    otherwise, or the directory given (`path`), created if missing and never removed."""

    def __init__(self, prefix: str, path: Path | None = None) -> None:
        self.given = path is not None
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
        self.path = path if path is not None else Path(tempfile.mkdtemp(prefix=prefix))
        self.keep = self.given

    def finish(self, console: Console) -> None:
        if self.keep:
            console.print(f"child logs kept in {self.path}", highlight=False)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def _prepare(workload: Workload):  # type: ignore[no-untyped-def]
    """The prompt synthesizer over the default tokenizer, and `workload` with every request's
    messages built ahead (seconds of CPU: run it in a thread while a stack starts).

    Built ahead, a burst of simultaneous arrivals (Mooncake's timestamps have coarse steps) is
    sent on time instead of waiting on prompt synthesis one request after another.
    """
    from extproc.bench.prompts import PromptSynthesizer
    from extproc.bench.runner import with_messages
    from extproc.pipeline.tokens import TokenCounter

    prompts = PromptSynthesizer(TokenCounter.from_source("builtin:qwen3"))
    return prompts, with_messages(workload, prompts)


def _describe(stack: PolicyStack) -> str:
    counts: dict[str, int] = {}
    roles = stack.settings.roles or ("both",) * len(stack.settings.profiles)
    for p, role in zip(stack.settings.profiles, roles):
        key = p if role == "both" else f"{p} {role}"  # P/D roles (`--fleet pd`)
        counts[key] = counts.get(key, 0) + 1
    fleet = ", ".join(f"{n}× {p}" for p, n in counts.items())
    return f"{stack.policy.description}; fleet: {fleet}; speed {stack.settings.speed:g}"


def _warn_behind(console: Console, report: Report) -> None:
    for run in report.runs:
        b = run.behind_schedule
        if b.fraction > _BEHIND_WARN:
            console.print(
                f"[yellow]warning:[/yellow] {run.policy} ({run.trace}): the load generator fell behind its "
                f"schedule for {b.fraction:.1%} of sends (max {b.max_lag_ms:,.0f} ms late): the CPU was "
                "saturated, so the offered load was lower than planned; use a lower --speed or --rate-scale",
                highlight=False,
            )


def _write_json(report: Report, path: Path, console: Console) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report.model_dump(mode="json"), option=orjson.OPT_INDENT_2))
    console.print(f"wrote {path}", highlight=False)


async def _start(stack: PolicyStack, console: Console) -> None:
    console.print(f"starting: {_describe(stack)}", highlight=False)
    await stack.start()


def _print_services(stack: PolicyStack, console: Console) -> None:
    for what, url in stack.services():
        console.print(f"  {what}: {url}", highlight=False, soft_wrap=True)


async def _guarded(
    work: Callable[[Interrupts], Awaitable[None]], logs: _Logs, console: Console
) -> Literal["done", "interrupted", "failed"]:
    """Run `work` under `Interrupts`; a signal or an error becomes an outcome, never a traceback.

    `work` must stop what it started itself (try/finally): this only reports. The logs are
    kept after a failure.
    """
    interrupts = Interrupts(asyncio.current_task(), on_signal=lambda s: console.print(f"{s}: stopping"))
    try:
        with interrupts:
            await work(interrupts)
    except asyncio.CancelledError:
        if not interrupts.fired:
            raise
    except Exception as exc:  # noqa: BLE001 - a child failed or a port was taken: say so, exit 1
        logs.keep = True
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return "failed"
    finally:
        logs.finish(console)
    return "interrupted" if interrupts.fired else "done"


async def run_demo(options: DemoOptions, console: Console) -> int:
    """Start the stack, replay the workload with a progress bar, print and write the results."""
    from extproc.bench.plots import plot_runs
    from extproc.bench.views import render_run_details

    logs = _Logs("llm-extproc-demo-")
    stack = PolicyStack(options.policy, options.stack, workdir=logs.path)
    runs: list[LabeledRun] = []

    async def work(interrupts: Interrupts) -> None:
        prepared = asyncio.ensure_future(asyncio.to_thread(_prepare, options.workload))
        try:
            await _start(stack, console)
            _print_services(stack, console)
            prompts, workload = await prepared
            runs.append(await replay(stack, workload, prompts, options.replay, console=console, interrupts=interrupts))
        finally:
            prepared.cancel()
            await stack.aclose()

    outcome = await _guarded(work, logs, console)
    if outcome == "interrupted":
        console.print("interrupted; every process started was stopped")
    if not runs:
        return 1 if outcome == "failed" else 130
    report = build_report(runs, options.slo)
    console.print(render_run_details(report.runs[0], time_unit=report.time_unit, profiles=_profiles(stack), slo=report.slo))
    _warn_behind(console, report)
    try:
        if options.outputs.plot_path is not None:
            options.outputs.plot_path.parent.mkdir(parents=True, exist_ok=True)
            labeled = _label_endpoints(runs[0], _profiles(stack))
            plot_runs([labeled], options.outputs.plot_path, by="endpoint", slo=options.slo)
            console.print(f"wrote {options.outputs.plot_path}", highlight=False)
        if options.outputs.json_path is not None:
            _write_json(report, options.outputs.json_path, console)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot write: {exc}", highlight=False)
        return 2
    return 130 if outcome == "interrupted" else 0


def _model(settings: StackSettings) -> str:
    from extproc.sim.profiles import PROFILES

    return PROFILES[settings.profiles[0]].model


def _profiles(stack: PolicyStack) -> dict[str, str]:
    return {s.address: s.profile for s in stack.fleet.sims if s.port is not None}


def _label_endpoints(run: LabeledRun, profiles: dict[str, str]) -> LabeledRun:
    """A copy of `run` whose endpoints read `ip:port (profile)`, for figure legends."""
    results = [
        replace(r, endpoint=f"{r.endpoint} ({profiles[r.endpoint]})") if r.endpoint in profiles else r
        for r in run.record.results
    ]
    return replace(run, record=replace(run.record, results=results))


UP_WATCH_S = 1.0
"""How often `up` checks that every child still runs (seconds)."""


async def run_up(policy: Policy, settings: StackSettings, console: Console, logs_dir: Path | None = None) -> int:
    """Start the stack, print its URLs, and keep it running until SIGINT/SIGTERM (exit 0) or
    until a child exits on its own (exit 1, naming it with its log tail; the rest is stopped).
    The children's logs go to `logs_dir` when given (kept), else to a temp directory it prints:
    removed when the stack stops cleanly (every `up` left one in /tmp before), kept and named
    when something failed."""
    logs = _Logs("llm-extproc-up-", logs_dir)
    stack = PolicyStack(policy, settings, workdir=logs.path)

    async def work(interrupts: Interrupts) -> None:
        try:
            await _start(stack, console)
            console.print("ready:", highlight=False)
            _print_services(stack, console)
            kept = "kept" if logs.given else "removed when it stops; kept if something fails; --logs DIR keeps them"
            console.print(f"  logs: {logs.path} ({kept})", highlight=False, soft_wrap=True)
            console.print(
                f"try: curl -s {stack.url}/v1/chat/completions -H 'content-type: application/json' "
                f"-d '{{\"model\": \"{_model(settings)}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}], \"max_tokens\": 20}}'",
                highlight=False, soft_wrap=True,
            )
            console.print("Ctrl-C stops everything.", highlight=False)
            while True:  # until a signal cancels us, or a child dies
                await asyncio.sleep(UP_WATCH_S)
                dead = stack.exited_child()
                if dead is not None:
                    raise dead.failure("exited while the stack was up; stopping the rest")
        finally:
            await stack.aclose()

    outcome = await _guarded(work, logs, console)
    if outcome == "failed":
        return 1
    console.print("stopped; every process started was stopped")
    return 0


async def run_bench(options: BenchOptions, console: Console) -> int:
    """Every policy in turn, at every rate scale, each on a fresh fleet; then tables, JSON, plots.

    A policy whose peer router is not installed is skipped with a note; an interrupted bench
    still reports the runs it finished.
    """
    logs = _Logs("llm-extproc-bench-")
    runs: list[LabeledRun] = []
    skipped: list[str] = []

    async def work(interrupts: Interrupts) -> None:
        prepared = asyncio.ensure_future(asyncio.to_thread(_prepare, options.workload))  # while the first stack starts
        try:
            for scale in options.rate_scales:
                for policy in options.policies:
                    reason = policy.unavailable()
                    if reason is not None:
                        note = f"{policy.name}: skipped, {reason}"
                        if note not in skipped:
                            skipped.append(note)
                            # markup=False: the install hint's `[bench]` is not a style tag.
                            console.print(note, style="yellow", markup=False, highlight=False)
                        continue
                    if interrupts.fired:
                        return
                    stack = PolicyStack(policy, options.stack, workdir=logs.path / f"{policy.name}-x{scale:g}")
                    try:
                        await _start(stack, console)
                        prompts, base = await prepared
                        workload = _scaled(base, options, scale)
                        runs.append(
                            await replay(stack, workload, prompts, options.replay, console=console, interrupts=interrupts)
                        )
                    finally:
                        await stack.aclose()
        finally:
            prepared.cancel()

    outcome = await _guarded(work, logs, console)
    if outcome == "interrupted":
        console.print("interrupted; every process started was stopped; results so far:")
    status = {"done": 0, "interrupted": 130, "failed": 1}[outcome]
    if not runs:
        if outcome == "done":
            console.print("nothing ran: every policy asked for was skipped (see above)", highlight=False)
        return status or 1
    settings = {
        "rate_scales": list(options.rate_scales),
        "speed": options.stack.speed,
        "seed": options.stack.seed,
        "fleet": list(options.stack.profiles),
        "stream_interval": options.stack.stream_interval,
        "extproc_config": dict(options.stack.server_overrides) if options.stack.server_overrides else None,
    }
    report = build_report(runs, options.slo, settings)
    console.print(render_report(report))
    if len(options.rate_scales) > 1:
        from extproc.bench.views import render_goodput

        console.print(render_goodput(report))
    _warn_behind(console, report)
    for note in skipped:
        console.print(note, markup=False, highlight=False)
    try:  # the data first: a figure that cannot be written must not cost the results
        if options.outputs.json_path is not None:
            _write_json(report, options.outputs.json_path, console)
        if options.outputs.requests_path is not None:
            _write_requests(runs, options.outputs.requests_path, console)
        if options.outputs.plot_path is not None:
            _plot_bench(options, runs, report, console)
    except OSError as exc:
        console.print(f"[red]error:[/red] cannot write: {exc}", highlight=False)
        return status or 2
    return status


def report_files(paths: Sequence[Path], json_path: Path | None, console: Console) -> int:
    """`bench --report`: the table `bench` prints, over the runs of several `--json` reports
    (e.g. one per policy, each run under its own lock), optionally written back as one report.

    Returns 0, or 2 when a file cannot be read, is not a report, or the reports do not compare
    (different SLOs or time units); reports whose settings differ are shown with a warning.
    """
    from pydantic import ValidationError

    from extproc.bench.views import render_goodput

    reports = []
    for path in paths:
        try:
            reports.append(Report.model_validate_json(path.read_bytes()))
        except OSError as exc:
            console.print(f"[red]error:[/red] cannot read {path}: {exc}", highlight=False)
            return 2
        except ValidationError as exc:
            console.print(f"[red]error:[/red] {path} is not a bench --json report: {exc}", highlight=False)
            return 2
    try:
        report, differing = merge_reports(reports)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    if differing:
        console.print(
            f"[yellow]warning:[/yellow] the reports' settings differ ({', '.join(differing)}): their runs did not "
            "replay the same requests the same way", highlight=False,
        )  # fmt: skip
    console.print(render_report(report))
    if len({run.trace for run in report.runs}) > 1:
        console.print(render_goodput(report))
    _warn_behind(console, report)
    if json_path is not None:
        try:
            _write_json(report, json_path, console)
        except OSError as exc:
            console.print(f"[red]error:[/red] cannot write: {exc}", highlight=False)
            return 2
    return 0


def _write_requests(runs: list[LabeledRun], path: Path, console: Console) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        for row in request_rows(runs):
            fh.write(orjson.dumps(row) + b"\n")
    console.print(f"wrote {path} (one JSON line per request)", highlight=False)


def _scaled(base: Workload, options: BenchOptions, scale: float) -> Workload:
    workload = base.scaled(scale)
    if len(options.rate_scales) > 1:
        workload = replace(workload, name=f"{workload.name} ×{scale:g}")
    if options.duration_s is not None and workload.requests:
        end = workload.requests[0].arrival_s + options.duration_s
        workload = replace(workload, requests=[r for r in workload.requests if r.arrival_s <= end])
    return workload


def _plot_bench(options: BenchOptions, runs: list[LabeledRun], report: Report, console: Console) -> None:
    """TTFT CDF per policy at the highest load to `--plot`; goodput vs load beside it when several."""
    from extproc.bench.plots import plot_runs
    from extproc.bench.views import plot_goodput

    path = options.outputs.plot_path
    assert path is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    last = runs[-1].trace
    plot_runs([r for r in runs if r.trace == last], path, by="policy", slo=options.slo)
    console.print(f"wrote {path} (TTFT CDF per policy, {last})", highlight=False)
    if len(options.rate_scales) > 1:
        goodput = path.with_name(f"{path.stem}-goodput{path.suffix or '.png'}")
        plot_goodput(report, goodput)
        console.print(f"wrote {goodput} (goodput vs offered load)", highlight=False)


async def run_tenant_bench(spec, options, prepared, json_path: Path | None, console: Console) -> int:  # type: ignore[no-untyped-def]
    """`bench --tenants`: one multi-tenant run (`tenant_run.run_tenants`), its per-tenant table
    and JSON report. Exit 0 done, 1 a child failed, 2 cannot write, 130 interrupted."""
    from extproc.bench.tenant_results import TenantReport, render_tenants
    from extproc.bench.tenant_run import run_tenants

    logs = _Logs("llm-extproc-tenants-")
    reports: list[TenantReport] = []

    async def work(interrupts: Interrupts) -> None:
        console.print(f"starting: {options.policy.description}; speed {options.settings.speed:g}", highlight=False)
        reports.append(await run_tenants(spec, options, console=console, workdir=logs.path, prepared=prepared))

    outcome = await _guarded(work, logs, console)
    if not reports:
        return 1 if outcome == "failed" else 130
    console.print(render_tenants(reports[0]))
    if json_path is not None:
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_bytes(orjson.dumps(reports[0].model_dump(mode="json"), option=orjson.OPT_INDENT_2))
        except OSError as exc:
            console.print(f"[red]error:[/red] cannot write: {exc}", highlight=False)
            return 2
        console.print(f"wrote {json_path}", highlight=False)
    return 0
