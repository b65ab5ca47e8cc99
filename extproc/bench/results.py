"""Summary statistics of replays and the one report shape shared by `demo --json` and `bench --json`.

    {"runs": [{"policy", "trace", "requests", "offered_rps", "successes",
               "errors": {reason: count},
               "ttft_ms": {"p50", "p90", "p99"}, "itl_ms": {"p50", "p99"}, "e2e_ms": {"p50", "p99"},
               "output_tokens_per_s", "goodput_rps", "prefix_cache_hit_rate",
               "endpoints": {address: share},
               "behind_schedule": {"threshold_ms", "count", "fraction", "max_lag_ms"},
               "speed"}],
     "slo": {"ttft_ms": 2000, "itl_ms": 100},
     "time_unit": "simulated" | "wall"}

Definitions (all over the run's requests that were sent):
  - latency percentiles are over successful requests (numpy's linear interpolation); `itl_ms`
    is the distribution of per-request mean ITL, (E2E − TTFT) / (output tokens − 1), over
    requests with at least 2 output tokens;
  - `offered_rps` = requests / trace span between the first and last arrival sent (None for
    fewer than two distinct arrivals);
  - `output_tokens_per_s` and `goodput_rps` divide by the run's duration, first send to last
    end; goodput counts successes with TTFT ≤ `slo.ttft_ms` and mean ITL ≤ `slo.itl_ms` (a
    single-token answer has no ITL and meets that half);
  - `endpoints` shares are of requests sent (`unknown` for responses without an endpoint header,
    only when some other response named one);
  - `behind_schedule.max_lag_ms` is wall time, whatever `time_unit` says: it measures the client;
  - `speed`: simulated seconds per wall second of the run (at 1, simulated time is wall time);
  - `prefix_cache_hit_rate` is the engines' own (vLLM's `prefix_cache_hits_total` /
    `prefix_cache_queries_total`, in tokens, over the run), when the caller scraped it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict
from rich.table import Table

from extproc.bench.loadgen import RunRecord

__all__ = [
    "SLO",
    "clock_note",
    "BehindSchedule",
    "LabeledRun",
    "Report",
    "RunSummary",
    "build_report",
    "merge_reports",
    "percentiles",
    "prefix_cache_counters",
    "prefix_cache_hit_rate",
    "render_report",
    "request_rows",
    "summarize_run",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SLO(_Model):
    """Per-request service-level objective: TTFT and mean ITL limits (milliseconds)."""

    ttft_ms: float = 2000.0
    itl_ms: float = 100.0


class TTFTPercentiles(_Model):
    p50: float | None
    p90: float | None
    p99: float | None


class TailPercentiles(_Model):
    p50: float | None
    p99: float | None


class BehindSchedule(_Model):
    """Sends later than `threshold_ms` behind schedule (wall milliseconds)."""

    threshold_ms: float
    count: int
    fraction: float
    max_lag_ms: float


class RunSummary(_Model):
    """One run (one policy on one trace); see the module docstring for definitions."""

    policy: str
    trace: str
    requests: int
    offered_rps: float | None
    successes: int
    errors: dict[str, int]
    ttft_ms: TTFTPercentiles
    itl_ms: TailPercentiles
    e2e_ms: TailPercentiles
    output_tokens_per_s: float | None
    goodput_rps: float | None
    prefix_cache_hit_rate: float | None
    endpoints: dict[str, float]
    behind_schedule: BehindSchedule
    speed: float = 1.0
    """Simulated seconds per wall second the latencies were measured at (1: they are wall time too)."""


def clock_note(time_unit: str, speed: float) -> str:
    """How to read a table's latencies: `simulated time (×10)` when the simulators ran faster
    or slower than real time, else nothing to add (at speed 1 simulated time is wall time)."""
    if time_unit == "simulated" and speed != 1.0:
        return f", simulated time (×{speed:g})"
    return "" if time_unit == "simulated" else f", {time_unit} time"


class Report(_Model):
    """The `--json` document of `demo` and `bench`.

    `settings` records how the runs were made, so a report can be reproduced: rate scales,
    simulator speed, seed, fleet, stream interval, and what `--extproc-config` laid over
    llm-extproc's config (`bench` only)."""

    runs: list[RunSummary]
    slo: SLO
    time_unit: Literal["simulated", "wall"]
    settings: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class LabeledRun:
    """A run with the labels it is reported under.

    Attributes:
        policy: routing policy or peer (e.g. `llm-extproc`, `envoy-round-robin`).
        trace: workload name.
        record: the load generator's raw results.
        prefix_cache_hit_rate: the engines' hit rate over the run (0..1), if scraped.
    """

    policy: str
    trace: str
    record: RunRecord
    prefix_cache_hit_rate: float | None = None


def percentiles(values: Iterable[float], qs: Sequence[float], *, scale: float = 1.0) -> list[float | None]:
    """Percentiles `qs` (0-100) of `values` × `scale`, linear interpolation; Nones when empty."""
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return [None for _ in qs]
    return [float(v) * scale for v in np.percentile(data, qs)]


def _rate(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


def summarize_run(run: LabeledRun, slo: SLO | None = None) -> RunSummary:
    """Summary statistics of one run (times in the run's own unit, milliseconds)."""
    slo = slo or SLO()
    results = run.record.results
    ok = [r for r in results if r.ok]
    errors = Counter(r.error or str(r.status) for r in results if not r.ok)
    ttft = percentiles((r.ttft_s for r in ok if r.ttft_s is not None), (50, 90, 99), scale=1000)
    itl = percentiles((r.itl_s for r in ok if r.itl_s is not None), (50, 99), scale=1000)
    e2e = percentiles((r.e2e_s for r in ok if r.e2e_s is not None), (50, 99), scale=1000)
    good = sum(
        1
        for r in ok
        if r.ttft_s is not None
        and r.ttft_s * 1000 <= slo.ttft_ms
        and (r.itl_s is None or r.itl_s * 1000 <= slo.itl_ms)
    )
    duration = run.record.duration_s
    span = run.record.offered_span_s
    named = Counter(r.endpoint for r in results if r.endpoint)
    if named:
        unknown = len(results) - sum(named.values())
        if unknown:
            named["unknown"] = unknown
    lags = [r.lag_s for r in results]
    threshold_ms = run.record.lag_threshold_s * 1000
    behind = sum(1 for lag in lags if lag * 1000 > threshold_ms)
    return RunSummary(
        policy=run.policy,
        trace=run.trace,
        requests=len(results),
        offered_rps=_rate(len(results), span),
        successes=len(ok),
        errors=dict(errors.most_common()),
        ttft_ms=TTFTPercentiles(p50=ttft[0], p90=ttft[1], p99=ttft[2]),
        itl_ms=TailPercentiles(p50=itl[0], p99=itl[1]),
        e2e_ms=TailPercentiles(p50=e2e[0], p99=e2e[1]),
        output_tokens_per_s=_rate(sum(r.output_tokens or 0 for r in ok), duration),
        goodput_rps=_rate(good, duration),
        prefix_cache_hit_rate=run.prefix_cache_hit_rate,
        endpoints={k: v / len(results) for k, v in sorted(named.items())},
        behind_schedule=BehindSchedule(
            threshold_ms=threshold_ms,
            count=behind,
            fraction=behind / len(results) if results else 0.0,
            max_lag_ms=max([0.0, *lags]) * 1000,
        ),
        speed=run.record.time_scale,
    )


def request_rows(runs: Sequence[LabeledRun]) -> Iterator[dict[str, Any]]:
    """One flat record per request of every run, for `bench --requests-out` (JSON Lines): which
    endpoint served it, how long it took and how late it was sent, to find what makes a tail.

    Keys: policy, trace, index, scheduled_s (trace seconds), sent_s (wall seconds since the run
    started), lag_ms (wall), input_tokens, max_tokens, output_tokens, endpoint, status, error,
    ttft_ms, e2e_ms, itl_ms (the run's time unit; None when not measured); route_debug (the
    router's explanation of the choice) when the replay kept it.
    """

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000, 3)

    for run in runs:
        for r in run.record.results:
            row = {
                "policy": run.policy,
                "trace": run.trace,
                "index": r.index,
                "scheduled_s": r.scheduled_s,
                "sent_s": round(r.sent_wall_s, 6),
                "lag_ms": round(r.lag_s * 1000, 3),
                "input_tokens": r.input_tokens,
                "max_tokens": r.max_tokens,
                "output_tokens": r.output_tokens,
                "endpoint": r.endpoint,
                "status": r.status,
                "error": r.error,
                "ttft_ms": ms(r.ttft_s),
                "e2e_ms": ms(r.e2e_s),
                "itl_ms": ms(r.itl_s),
            }
            if r.route_debug is not None:
                row["route_debug"] = r.route_debug
            yield row


def build_report(runs: Sequence[LabeledRun], slo: SLO | None = None, settings: dict[str, Any] | None = None) -> Report:
    """The report for `runs`, which must share one time unit (`settings`: see `Report`).

    Raises:
        ValueError: runs measured in different time units (simulated and wall).
    """
    slo = slo or SLO()
    units = {r.record.time_unit for r in runs}
    if len(units) > 1:
        raise ValueError(f"runs mix time units {sorted(units)}; report them separately")
    unit = units.pop() if units else "wall"
    return Report(runs=[summarize_run(r, slo) for r in runs], slo=slo, time_unit=unit, settings=settings)  # type: ignore[arg-type]


def merge_reports(reports: Sequence[Report]) -> tuple[Report, list[str]]:
    """One report holding the runs of `reports` in order (e.g. one `bench --json` per policy, run
    one at a time), and the `settings` keys on which they differ.

    `settings` is kept when every report has the same, else None (the differing keys say why:
    runs at different speeds or seeds did not replay the same requests the same way).

    Raises:
        ValueError: no report, or reports with different SLOs or time units (their goodput or
            latencies would not compare).
    """
    if not reports:
        raise ValueError("no report to merge")
    first = reports[0]
    for other in reports[1:]:
        if other.slo != first.slo:
            raise ValueError(f"reports use different SLOs ({first.slo} and {other.slo}); goodput would not compare")
        if other.time_unit != first.time_unit:
            raise ValueError(f"reports mix time units ({first.time_unit} and {other.time_unit}); report them separately")
    every = [r.settings or {} for r in reports]
    keys = sorted({k for s in every for k in s})
    differing = [k for k in keys if any(s.get(k) != every[0].get(k) for s in every[1:])]
    runs = [run for r in reports for run in r.runs]
    return Report(runs=runs, slo=first.slo, time_unit=first.time_unit, settings=None if differing else first.settings), differing


def prefix_cache_counters(metrics_text: str) -> tuple[float, float]:
    """`(hits, queries)` in tokens from one engine's Prometheus text (vLLM's names), summed over labels.

    Missing counters count as 0.
    """
    totals = {"vllm:prefix_cache_hits": 0.0, "vllm:prefix_cache_queries": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals and not sample.name.endswith("_created"):
                totals[name] += sample.value
    return totals["vllm:prefix_cache_hits"], totals["vllm:prefix_cache_queries"]


def prefix_cache_hit_rate(before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> float | None:
    """Fleet hit rate over a run from per-engine `(hits, queries)` before and after it (0..1).

    None when no queries happened in between.
    """
    hits = sum(a[0] for a in after) - sum(b[0] for b in before)
    queries = sum(a[1] for a in after) - sum(b[1] for b in before)
    return hits / queries if queries > 0 else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def render_report(report: Report) -> Table:
    """A rich table of the report's runs, one row per run."""
    note = clock_note(report.time_unit, report.runs[0].speed if report.runs else 1.0)
    table = Table(title=f"Runs (latencies in ms{note}; goodput SLO: TTFT ≤ {report.slo.ttft_ms:g} ms, "
                        f"ITL ≤ {report.slo.itl_ms:g} ms)")
    for name, justify in [
        ("policy", "left"), ("trace", "left"), ("req", "right"), ("ok", "right"), ("errors", "left"),
        ("TTFT p50/p90/p99", "right"), ("ITL p50/p99", "right"), ("E2E p50/p99", "right"),
        ("out tok/s", "right"), ("goodput rps", "right"), ("prefix hit", "right"), ("behind", "right"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for run in report.runs:
        errors = ", ".join(f"{k}×{v}" for k, v in list(run.errors.items())[:3]) or "–"
        table.add_row(
            run.policy,
            run.trace,
            str(run.requests),
            str(run.successes),
            errors,
            " / ".join(_fmt(v) for v in (run.ttft_ms.p50, run.ttft_ms.p90, run.ttft_ms.p99)),
            " / ".join(_fmt(v, 1) for v in (run.itl_ms.p50, run.itl_ms.p99)),
            " / ".join(_fmt(v) for v in (run.e2e_ms.p50, run.e2e_ms.p99)),
            _fmt(run.output_tokens_per_s),
            _fmt(run.goodput_rps, 2),
            "–" if run.prefix_cache_hit_rate is None else f"{run.prefix_cache_hit_rate:.1%}",
            f"{run.behind_schedule.fraction:.1%}",
        )
    return table
