"""Every policy × every seed in steady state, and the figures a skeptic accepts from them.

    runs = await run_seeded(options, make_workload, console)     # list[SteadyRun]
    result = SeededResult(..., runs=runs)                          # the JSON result file
    table = aggregate(result.valid_runs())                         # mean + 95 % interval per figure
    verdicts = compare_to(result.valid_runs(), "envoy-least-request")

Seed k means, for every policy alike: the trace sample (`make_workload(k)`: which conversations,
which window of a trace) and the simulators' randomness (`StackSettings.seed = k`). Every
(policy, seed) gets a fresh fleet. Invalid runs (`steady.SteadyRun.valid`) stay in the result
file, printed and marked, and out of means and verdicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict
from rich.console import Console

from extproc.bench.policies import Policy
from extproc.bench.results import SLO
from extproc.bench.runner import Interrupts, ReplayOptions, Workload, get_all, replay
from extproc.bench.stacks import PolicyStack, StackSettings
from extproc.bench.stats import Comparison, Interval, bootstrap_interval, compare
from extproc.bench.steady import SteadyRun, SteadySettings, client_usage, engine_request_counts, steady_run

__all__ = [
    "FIGURES",
    "Figure",
    "SeededOptions",
    "SeededResult",
    "aggregate",
    "compare_to",
    "run_seeded",
]


@dataclass(frozen=True, slots=True)
class Figure:
    """One reported figure of a steady run.

    Attributes:
        key: its name in result files and tables (`ttft_p99_ms`).
        label: its column heading.
        get: reads it from a `SteadyRun` (None when the run has no value).
        higher_is_better: direction for verdicts; None: reported, never compared (achieved rate).
        digits: decimals when printed; `percent`: printed as a percentage.
    """

    key: str
    label: str
    get: Callable[[SteadyRun], float | None]
    higher_is_better: bool | None
    digits: int = 0
    percent: bool = False


FIGURES: tuple[Figure, ...] = (
    Figure("ttft_p50_ms", "TTFT p50 (ms)", lambda r: r.summary.ttft_ms.p50, False),
    Figure("ttft_p99_ms", "TTFT p99 (ms)", lambda r: r.summary.ttft_ms.p99, False),
    Figure("tpot_p50_ms", "TPOT p50 (ms)", lambda r: r.summary.itl_ms.p50, False, 1),
    Figure("tpot_p99_ms", "TPOT p99 (ms)", lambda r: r.summary.itl_ms.p99, False, 1),
    Figure("e2e_p99_ms", "E2E p99 (ms)", lambda r: r.summary.e2e_ms.p99, False),
    Figure("goodput_rps", "goodput (req/s)", lambda r: r.summary.goodput_rps, True, 2),
    Figure("output_tokens_per_s", "output tok/s", lambda r: r.summary.output_tokens_per_s, True),
    Figure("prefix_hit", "prefix hit", lambda r: r.summary.prefix_cache_hit_rate, True, 1, True),
    Figure("hotspot", "hotspot", lambda r: r.hotspot, False, 2),
    Figure("achieved_rps", "achieved req/s", lambda r: r.achieved_rps, None, 2),
)
"""What every steady table reports, in column order. TPOT is the per-request mean inter-token
latency, (E2E − TTFT) / (output tokens − 1), the `itl_ms` of a bench report."""


class SeededResult(BaseModel):
    """A result file (docs/benchmarks/results/*.json): every run of one workload, with how it was made.

    Attributes:
        name: a short id (`mooncake-conv`), the file's stem.
        workload: what was replayed, in words (sample, rate, closed loop).
        commit / date: the code measured (git short hash) and when (UTC).
        command: the exact command that made this file.
        machine: the machine, in words (cores, what else ran).
        baseline: the policy verdicts compare against.
        seeds: the seeds run.
        settings: warm-up, min steady span, speed, fleet, SLO, load(s).
        runs: one per (policy, seed, load), invalid ones included.
        rerun: False for a figure carried over from an earlier page (said on the page).
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    workload: str
    commit: str
    date: str
    command: str
    machine: str
    baseline: str
    seeds: list[int]
    settings: dict[str, Any]
    runs: list[SteadyRun]
    rerun: bool = True
    external: list[dict[str, Any]] = []
    """Figures from the field's own clients (guidellm, inference-perf) on the same stacks."""

    def valid_runs(self, load: str | None = None) -> list[SteadyRun]:
        """The runs that count (valid), optionally of one load only."""
        return [r for r in self.runs if r.valid and (load is None or r.load == load)]


def aggregate(runs: Sequence[SteadyRun]) -> dict[str, dict[str, Interval]]:
    """Mean and 95 % bootstrap interval over seeds of every figure, by policy (in run order).

    A figure no run of the policy has (hotspot of a front that names no endpoint) is left out.
    """
    by_policy: dict[str, list[SteadyRun]] = {}
    for r in runs:
        by_policy.setdefault(r.policy, []).append(r)
    out: dict[str, dict[str, Interval]] = {}
    for policy, rs in by_policy.items():
        out[policy] = {}
        for fig in FIGURES:
            values = [fig.get(r) for r in rs]
            if any(v is not None for v in values):
                out[policy][fig.key] = bootstrap_interval(values)
    return out


def compare_to(runs: Sequence[SteadyRun], baseline: str) -> dict[str, dict[str, Comparison]]:
    """Every other policy against `baseline`, figure by figure, paired over the seeds both ran.

    Returns {} when the baseline has no run. Figures without a direction (achieved rate) and
    without values on both sides are left out.
    """
    base = {r.seed: r for r in runs if r.policy == baseline}
    if not base:
        return {}
    others: dict[str, dict[int, SteadyRun]] = {}
    for r in runs:
        if r.policy != baseline:
            others.setdefault(r.policy, {})[r.seed] = r
    out: dict[str, dict[str, Comparison]] = {}
    for policy, mine in others.items():
        seeds = sorted(set(mine) & set(base))
        out[policy] = {}
        for fig in FIGURES:
            if fig.higher_is_better is None or not seeds:
                continue
            a, b = [fig.get(mine[s]) for s in seeds], [fig.get(base[s]) for s in seeds]
            if any(x is not None and y is not None for x, y in zip(a, b)):
                out[policy][fig.key] = compare(a, b, higher_is_better=fig.higher_is_better)
    return out


@dataclass(frozen=True, slots=True)
class SeededOptions:
    """How to run every policy at every seed.

    Attributes:
        policies: in order (the baseline among them).
        seeds: e.g. (0, 1, 2).
        stack: fleet and speed; its `seed` is replaced by each seed.
        replay: how to replay (speed must equal the stack's).
        steady: warm-up and validity thresholds.
        load: the load label stored with each run (e.g. "1" for the workload's own rate).
        slo: the goodput SLO.
        workdir: child logs, one folder per run.
    """

    policies: Sequence[Policy]
    seeds: Sequence[int]
    stack: StackSettings
    replay: ReplayOptions
    steady: SteadySettings
    workdir: Path
    load: str = "1"
    slo: SLO = dataclasses.field(default_factory=SLO)


async def _engine_counts(stack: PolicyStack) -> dict[str, float] | None:
    """Requests each engine finished so far (its `/metrics`), None when a scrape fails."""
    sims = [s for s in stack.fleet.sims if s.port is not None]
    pages = await get_all([s.url for s in sims], "/metrics")
    return None if pages is None else engine_request_counts([p.text for p in pages], [s.address for s in sims])


def _classes(stack: PolicyStack) -> dict[str, str]:
    """Endpoint class (the simulator profile's GPU) by address, every endpoint of the fleet."""
    from extproc.sim.profiles import PROFILES

    return {s.address: PROFILES[s.profile].gpu.name for s in stack.fleet.sims if s.port is not None}


async def run_seeded(
    options: SeededOptions,
    make_workload: Callable[[int], tuple[Workload, Any]],
    console: Console,
    *,
    on_run: Callable[[SteadyRun], None] | None = None,
) -> list[SteadyRun]:
    """Seed by seed, policy by policy: a fresh stack, one replay, its steady figures.

    Args:
        make_workload: seed → (workload with messages built, prompt synthesizer).
        on_run: called after each run (e.g. to write the result file so far).

    A signal stops the replay in progress (its run is still judged) and skips the rest; a stack
    that fails to start raises (every child stopped first).
    """
    runs: list[SteadyRun] = []
    interrupts = Interrupts(asyncio.current_task(), on_signal=lambda s: console.print(f"{s}: stopping"))
    with interrupts:
        for seed in options.seeds:
            workload, prompts = make_workload(seed)
            for policy in options.policies:
                if interrupts.fired:
                    return runs
                settings = dataclasses.replace(options.stack, seed=seed)
                stack = PolicyStack(policy, settings, workdir=options.workdir / f"{policy.name}-s{seed}-x{options.load}")
                try:
                    console.print(f"seed {seed}: starting {policy.name}", highlight=False)
                    await stack.start()
                    before = await _engine_counts(stack) if not stack.endpoint_headers else None
                    with client_usage() as usage:
                        labeled = await replay(
                            stack, workload, prompts, options.replay, console=console, interrupts=interrupts
                        )
                    after = await _engine_counts(stack) if before is not None else None
                    classes = _classes(stack)
                finally:
                    with contextlib.suppress(Exception):
                        await stack.aclose()
                counts = {k: after[k] - before.get(k, 0.0) for k in after} if before is not None and after else None
                assert usage.result is not None
                run = steady_run(
                    labeled, seed=seed, load=options.load, settings=options.steady, usage=usage.result,
                    classes=classes, engine_counts=counts, slo=options.slo,
                )  # fmt: skip
                runs.append(run)
                mark = "valid" if run.valid else "INVALID: " + "; ".join(run.invalid_reasons)
                console.print(
                    f"seed {seed} {policy.name}: steady span {run.steady_span_s:,.0f} s, {run.summary.requests} requests, "
                    f"offered {run.offered_rps or 0:.2f} / achieved {run.achieved_rps or 0:.2f} req/s, TTFT p99 "
                    f"{run.summary.ttft_ms.p99 or 0:,.0f} ms, TPOT p99 {run.summary.itl_ms.p99 or 0:,.1f} ms, "
                    f"client CPU {run.client_cpu:.0%}; {mark}" + ("; " + "; ".join(run.notes) if run.notes else ""),
                    highlight=False,
                )  # fmt: skip
                if on_run is not None:
                    on_run(run)
    return runs
