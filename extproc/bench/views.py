"""Tables and figures for `demo` and `bench` beyond the shared run table (`results.render_report`).

  - `render_run_details`: one run, metric by metric: errors and 429s by reason, latencies, the
    share of requests each endpoint served (with its simulator profile);
  - `render_goodput`: goodput (requests/s meeting the SLO) and p99 TTFT per policy and load;
  - `plot_goodput`: goodput against offered load, one line per policy (PNG).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.table import Table

from extproc.bench.results import SLO, Report, RunSummary, clock_note

__all__ = ["plot_goodput", "render_goodput", "render_run_details"]


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} ms"


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def render_run_details(
    run: RunSummary, *, time_unit: str, profiles: Mapping[str, str] | None = None, slo: SLO | None = None
) -> Table:
    """One run as a two-column table (metric, value).

    Args:
        run: the run's summary.
        time_unit: `simulated` or `wall`; "simulated time" is printed only when the run's speed
            is not 1 (at speed 1 it is wall time).
        profiles: simulator profile by endpoint address, to label the endpoint shares; every
            address here gets a share row, in this order, 0.0% when it served no request.
        slo: the goodput SLO, named beside the goodput (default `SLO()`).
    """
    slo = slo or SLO()
    note = clock_note(time_unit, run.speed).removeprefix(", ")
    table = Table(title=f"{run.policy} on {run.trace}" + (f" ({note})" if note else ""), show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_row("requests", f"{run.requests:,}")
    table.add_row("successes", f"{run.successes:,}")
    table.add_row("errors", f"{sum(run.errors.values()):,}")
    table.add_row("  of which 429 (refused)", f"{sum(v for k, v in run.errors.items() if k.startswith('429')):,}")
    for reason, count in run.errors.items():
        table.add_row(f"  {reason}", f"{count:,}")
    table.add_row("TTFT p50 / p99", f"{_ms(run.ttft_ms.p50)} / {_ms(run.ttft_ms.p99)}")
    table.add_row("inter-token latency p50", "–" if run.itl_ms.p50 is None else f"{run.itl_ms.p50:.1f} ms")
    table.add_row("E2E p99", _ms(run.e2e_ms.p99))
    table.add_row("output tokens/s", _num(run.output_tokens_per_s, 0))
    table.add_row(f"goodput (req/s with TTFT ≤ {slo.ttft_ms:g} ms, ITL ≤ {slo.itl_ms:g} ms)", _num(run.goodput_rps, 2))
    table.add_row("offered load (req/s)", _num(run.offered_rps, 2))
    if run.prefix_cache_hit_rate is not None:
        table.add_row("prefix cache hit rate", f"{run.prefix_cache_hit_rate:.1%}")
    behind = run.behind_schedule
    table.add_row(
        f"sent > {behind.threshold_ms:g} ms late", f"{behind.count:,} ({behind.fraction:.1%}, max {behind.max_lag_ms:,.0f} ms wall)"
    )
    # every endpoint of the fleet in the fleet's order, 0.0% for one that served nothing (at light
    # load the TTFT cost may send nothing to the slower GPUs); then any it does not name (`unknown`)
    shares = dict.fromkeys(profiles or {}, 0.0) | dict(run.endpoints)
    for address, share in shares.items():
        label = f"{address} ({profiles[address]})" if profiles and address in profiles else address
        table.add_row(f"share {label}", f"{share:.1%}")
    return table


def render_goodput(report: Report) -> Table:
    """Goodput and p99 TTFT per policy (rows) and workload/load (columns)."""
    loads: list[str] = []
    cells: dict[str, dict[str, str]] = defaultdict(dict)
    for run in report.runs:
        if run.trace not in loads:
            loads.append(run.trace)
        late = " [red]behind[/red]" if run.behind_schedule.fraction > 0.01 else ""
        cells[run.policy][run.trace] = f"{_num(run.goodput_rps, 2)} rps / {_ms(run.ttft_ms.p99)}{late}"
    table = Table(
        title=f"Goodput (TTFT ≤ {report.slo.ttft_ms:g} ms, ITL ≤ {report.slo.itl_ms:g} ms) / p99 TTFT, "
        f"{report.time_unit} time"
    )
    table.add_column("policy", style="bold")
    for load in loads:
        table.add_column(load, justify="right")
    for policy, row in cells.items():
        table.add_row(policy, *(row.get(load, "–") for load in loads))
    return table


def plot_goodput(report: Report, path: str | Path) -> Path:
    """Write goodput against offered load (requests/s), one line per policy, to `path` (PNG)."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in report.runs:
        if run.offered_rps is not None and run.goodput_rps is not None:
            series[run.policy].append((run.offered_rps, run.goodput_rps))
    for policy, points in series.items():
        points.sort()
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=policy)
    top = max((x for points in series.values() for x, _ in points), default=1.0)
    ax.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="offered")
    ax.set_xlabel(f"offered load (requests/s, {report.time_unit} time)")
    ax.set_ylabel("goodput (requests/s meeting the SLO)")
    ax.set_title(f"Goodput vs load (SLO TTFT ≤ {report.slo.ttft_ms:g} ms, ITL ≤ {report.slo.itl_ms:g} ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    return path
