"""Replay one workload through one running stack, with a progress bar, into a `LabeledRun`.

    workload = load_workload(WorkloadOptions(trace=None, requests=600, rate=4.0))
    run = await replay(stack, workload, prompts, ReplayOptions(speed=1.0), console=console)

Also here: building the workload `demo` and `bench` replay (a trace file, or the synthetic
workload when none is given), and `Interrupts`, the SIGINT/SIGTERM handling both commands share:
the first signal stops the replay in progress (what was measured is kept) or, between replays,
cancels the command's main task so that its cleanup stops every child; later signals are ignored
while that cleanup runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from extproc.bench.loadgen import LoadGenConfig, LoadGenerator
from extproc.bench.loadgen import Progress as LoadProgress
from extproc.bench.prompts import PromptSynthesizer
from extproc.bench.results import LabeledRun, prefix_cache_counters, prefix_cache_hit_rate
from extproc.bench.stacks import PolicyStack
from extproc.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, load_trace
from extproc.bench.workload import WorkloadSpec, synthetic_workload

__all__ = [
    "Interrupts",
    "auto_rate_scale",
    "auto_speed",
    "fit_context",
    "fleet_prefill_capacity",
    "ReplayOptions",
    "Workload",
    "WorkloadOptions",
    "load_workload",
    "replay",
    "scrape_prefix_counters",
    "with_messages",
    "ROUTE_DEBUG_HEADER",
]

ROUTE_DEBUG_HEADER = "x-llm-route-debug"
"""llm-extproc's explanation of a decision (`scheduling.explain_header`)."""


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """Which requests to replay.

    Attributes:
        trace: a trace file (formats of `analyze`), or None for the synthetic workload.
        format: the trace format, or `auto`.
        requests: replay at most this many (None: all of the trace; synthetic: see `rate`).
        duration_s: replay only requests arriving in the first this-many trace seconds
            (after rescaling).
        rate_scale: multiply the arrival rate (> 0).
        rate: arrival rate of the synthetic workload and of ShareGPT/MT-Bench (requests/s,
            before `rate_scale`).
        seed: seed of the synthetic workload and of synthesized arrivals.
        start_offset_s: skip this much of the trace's beginning (trace seconds).
    """

    trace: Path | None = None
    format: str = "auto"
    requests: int | None = None
    duration_s: float | None = None
    rate_scale: float = 1.0
    rate: float = 4.0
    seed: int = 0
    start_offset_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests to replay (sorted by arrival, first at 0 s) and the name reports use."""

    name: str
    requests: list[TraceRequest]

    def scaled(self, rate_scale: float) -> Workload:
        """The same requests with every arrival time divided by `rate_scale` (> 0)."""
        if not (rate_scale > 0 and math.isfinite(rate_scale)):
            raise ValueError(f"rate_scale must be a positive number, got {rate_scale}")
        return Workload(self.name, [dataclasses.replace(r, arrival_s=r.arrival_s / rate_scale) for r in self.requests])

    @property
    def offered_rps(self) -> float | None:
        """Requests per second over the span of arrivals (None below two distinct arrivals)."""
        if len(self.requests) < 2 or self.requests[-1].arrival_s <= self.requests[0].arrival_s:
            return None
        return len(self.requests) / (self.requests[-1].arrival_s - self.requests[0].arrival_s)


_SYNTHETIC_DEFAULT_REQUESTS = 1000


def fit_context(workload: Workload, max_model_len: int) -> tuple[Workload, int]:
    """Cut prompts that would not fit the engines' context to `max_model_len − output` tokens.

    A request over the limit would only measure the engine's 400 (the same for every policy),
    so it is replayed with its leading tokens kept (its leading prefix blocks, so prefix sharing
    survives) and its output length unchanged; outputs longer than half the context are halved
    first so that some prompt remains.

    Returns:
        the workload and how many requests were cut.
    """
    out, cut = [], 0
    for r in workload.requests:
        if r.input_tokens + r.output_tokens <= max_model_len:
            out.append(r)
            continue
        output = min(r.output_tokens, max_model_len // 2)
        tokens = max_model_len - output
        blocks = r.prefix_blocks[: -(-tokens // MOONCAKE_BLOCK_TOKENS)] if r.prefix_blocks else r.prefix_blocks
        out.append(dataclasses.replace(r, input_tokens=tokens, output_tokens=output, prefix_blocks=blocks))
        cut += 1
    return Workload(workload.name, out), cut


def with_messages(workload: Workload, prompts: PromptSynthesizer) -> Workload:
    """`workload` with each request's chat messages built (what the load generator would send).

    Request i gets the text the load generator gives index i (`PromptSynthesizer.messages_for`
    with key `str(i)`), so the replay is the same, minus the synthesis on the send path.
    """
    return Workload(
        workload.name,
        [dataclasses.replace(r, messages=prompts.messages_for(r, key=str(i))) for i, r in enumerate(workload.requests)],
    )


def fleet_prefill_capacity(profiles: Sequence[str]) -> float:
    """The fleet's prefill throughput if every step were full of prompt tokens (tokens/s).

    Σ over endpoints of 1 / b, b being the profile's per-batched-token step cost (calibration
    §10): the rate a compute-bound engine processes prompt tokens at, attention aside.
    """
    from extproc.sim.profiles import PROFILES

    return sum(1.0 / PROFILES[p].coefficients.b for p in profiles)


def auto_rate_scale(workload: Workload, profiles: Sequence[str], load: float) -> float:
    """The rate scale at which `workload` offers `load` × the fleet's prefill capacity.

    Offered work = (prompt + output tokens) / arrival span, tokens/s.

    Raises:
        ValueError: fewer than two distinct arrival times (no rate to scale).
    """
    rps = workload.offered_rps
    if rps is None:
        raise ValueError("the workload has no arrival rate to scale (fewer than two distinct arrival times)")
    tokens = sum(r.input_tokens + r.output_tokens for r in workload.requests) / len(workload.requests)
    return load * fleet_prefill_capacity(profiles) / (rps * tokens)


def auto_speed(offered_rps: float | None, max_wall_rps: float) -> float:
    """Simulator speed (≤ 1) that keeps the wall-clock request rate at most `max_wall_rps`.

    Below 1 the simulators run slower than real time: the same simulated load costs less CPU
    per wall second, and real overheads (HTTP, Python) weigh less in simulated latencies.
    """
    if not offered_rps or offered_rps <= max_wall_rps:
        return 1.0
    return max_wall_rps / offered_rps


def load_workload(options: WorkloadOptions) -> Workload:
    """Build the workload: the trace cut and rescaled, or the synthetic one (Poisson arrivals).

    Synthetic without `requests`: enough requests to cover `duration_s` at the scaled rate, or
    1,000 when no duration is given either.

    Raises:
        TraceFormatError: unreadable or malformed trace.
        ValueError: an option out of range.
    """
    if not (options.rate_scale > 0 and math.isfinite(options.rate_scale)):
        raise ValueError(f"--rate-scale must be a positive number, got {options.rate_scale}")
    if options.duration_s is not None and options.duration_s <= 0:
        raise ValueError(f"--duration must be > 0 seconds, got {options.duration_s}")
    if options.trace is None:
        rate = options.rate * options.rate_scale
        count = options.requests
        if count is None:
            count = math.ceil(rate * options.duration_s) + 1 if options.duration_s else _SYNTHETIC_DEFAULT_REQUESTS
        requests = synthetic_workload(WorkloadSpec(requests=count, rate=rate, seed=options.seed))
        name = "synthetic"
    else:
        trace = load_trace(
            options.trace,
            format=options.format,
            limit=options.requests,
            rate_scale=options.rate_scale,
            start_offset=options.start_offset_s,
            rate=options.rate,
            seed=options.seed,
        )
        requests, name = trace.requests, trace.path.name
    if options.duration_s is not None and requests:
        end = requests[0].arrival_s + options.duration_s
        requests = [r for r in requests if r.arrival_s <= end]
    if not requests:
        raise ValueError("the workload is empty (check --requests, --duration and --start-offset)")
    return Workload(name, requests)


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to replay.

    Attributes:
        speed: time compression; must equal the simulators' speed (latencies are simulated time).
        request_timeout_s: per-request limit (simulated seconds; wall = this / speed).
        lag_threshold_s: a send this late counts as behind schedule (wall seconds).
        progress: show a progress bar.
        session_header: send each request's session id in this header (None: not sent).
        closed_loop_sessions: a session's turn waits for its previous turn's answer
            (`LoadGenConfig.closed_loop_sessions`), plus `think_time_s` (simulated seconds).
        route_debug: keep each answer's `x-llm-route-debug` header (llm-extproc with
            `scheduling.explain_header` on) in the per-request lines.
        max_tokens: send this `max_tokens` on every request (`LoadGenConfig.max_tokens`;
            tokens), None: each request's output length.
    """

    speed: float = 1.0
    request_timeout_s: float = 120.0
    lag_threshold_s: float = 0.050
    progress: bool = True
    session_header: str | None = None
    closed_loop_sessions: bool = False
    think_time_s: float = 0.0
    route_debug: bool = False
    max_tokens: int | None = None


class Interrupts:
    """SIGINT/SIGTERM for a command that runs stacks and replays (see the module docstring).

    Use `with Interrupts(asyncio.current_task()) as interrupts:` inside the command's main
    coroutine; `interrupts.fired` tells whether to skip what is left.
    """

    def __init__(self, main: asyncio.Task[object] | None, *, on_signal: Callable[[str], None] | None = None) -> None:
        self._main = main
        self._on_signal = on_signal
        self._loadgen: LoadGenerator | None = None
        self._installed: list[int] = []
        self.fired = False

    def __enter__(self) -> Interrupts:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._fire, sig)
                self._installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        # Keep ignoring signals until the loop closes: the caller may still be cleaning up, and
        # the default SIGTERM action would kill us with children left behind.
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.add_signal_handler(sig, lambda: None)

    def _fire(self, sig: signal.Signals) -> None:
        if self.fired:
            return
        self.fired = True
        if self._on_signal is not None:
            self._on_signal(signal.Signals(sig).name)
        if self._loadgen is not None:
            self._loadgen.stop()
        elif self._main is not None:
            self._main.cancel()

    @contextlib.contextmanager
    def replaying(self, loadgen: LoadGenerator):  # type: ignore[no-untyped-def]
        """While inside, a signal stops `loadgen` instead of cancelling the main task."""
        self._loadgen = loadgen
        try:
            yield
        finally:
            self._loadgen = None


async def get_all(urls: Sequence[str], path: str, timeout_s: float = 2.0) -> list[httpx.Response] | None:
    """GET `<url><path>` of every url at once (`timeout_s` seconds each); the 200 answers in
    `urls`' order, or None when any fails (a transport error or another status)."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            responses = await asyncio.gather(*(client.get(f"{u}{path}") for u in urls))
    except httpx.HTTPError:
        return None
    if any(r.status_code != 200 for r in responses):
        return None
    return list(responses)


async def scrape_prefix_counters(urls: Sequence[str], timeout_s: float = 2.0) -> list[tuple[float, float]] | None:
    """`(hits, queries)` prefix-cache tokens of each engine (`<url>/metrics`); None if any fails."""
    responses = await get_all(urls, "/metrics", timeout_s)
    return None if responses is None else [prefix_cache_counters(r.text) for r in responses]


def _progress_bar(console: Console, label: str) -> Progress:
    return Progress(
        TextColumn(f"[bold]{label}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


async def replay(
    stack: PolicyStack,
    workload: Workload,
    prompts: PromptSynthesizer,
    options: ReplayOptions,
    *,
    console: Console,
    interrupts: Interrupts | None = None,
    label: str | None = None,
) -> LabeledRun:
    """Replay `workload` through the running `stack` (open loop) and label the result.

    The bar counts finished requests; the engines' prefix-cache counters are read before and
    after (none for a failed scrape). Latencies are in simulated time: at speed 1 the simulated
    and wall clocks agree, so a run whose responses all lacked `x-sim-speed` (every request
    failed before an engine answered) is labelled simulated too, keeping runs comparable.

    Returns:
        the run under `label` (default: the stack's policy name) and the workload's name.
    """
    config = LoadGenConfig(
        base_url=stack.url,
        model=_model_of(stack),
        speed=options.speed,
        request_timeout_s=options.request_timeout_s / options.speed,
        endpoint_headers=stack.endpoint_headers or ("x-llm-endpoint",),
        lag_threshold_s=options.lag_threshold_s,
        session_header=options.session_header,
        closed_loop_sessions=options.closed_loop_sessions,
        think_time_s=options.think_time_s,
        debug_header=ROUTE_DEBUG_HEADER if options.route_debug else None,
        max_tokens=options.max_tokens,
    )
    label = label or stack.policy.name
    bar = _progress_bar(console, label) if options.progress else None
    task = bar.add_task(label, total=len(workload.requests), stats="") if bar is not None else None

    def on_progress(p: LoadProgress) -> None:
        if bar is not None and task is not None:
            stats = f"sent {p.sent}  in flight {p.in_flight}  failed {p.failed}  behind {p.behind}"
            bar.update(task, completed=p.completed + p.failed, stats=stats)

    loadgen = LoadGenerator(config, prompts, on_progress=on_progress)
    # From here a signal stops this replay (keeping what it measured) instead of the command.
    with interrupts.replaying(loadgen) if interrupts is not None else contextlib.nullcontext():
        before = await scrape_prefix_counters(stack.fleet.urls)
        # Printed right before the first send (nothing awaits in between): a signal after it
        # finds requests measured.
        console.print(
            f"replaying {len(workload.requests):,} requests of {workload.name} through {label} "
            f"(offered {workload.offered_rps or 0:.2f} req/s, speed {options.speed:g})",
            highlight=False,
        )
        with bar if bar is not None else contextlib.nullcontext():
            record = await loadgen.run(workload.requests)
    after = await scrape_prefix_counters(stack.fleet.urls)
    if record.time_unit == "wall":
        record.time_unit = "simulated"
    hit_rate = prefix_cache_hit_rate(before, after) if before is not None and after is not None else None
    return LabeledRun(policy=label, trace=workload.name, record=record, prefix_cache_hit_rate=hit_rate)


def _model_of(stack: PolicyStack) -> str:
    from extproc.sim.profiles import PROFILES

    models = {PROFILES[p].model for p in stack.settings.profiles}
    if len(models) != 1:
        raise ValueError(f"the fleet serves several models {sorted(models)}; replays need one")
    return models.pop()
