"""PNG plots for runs and traces (matplotlib's Agg canvas; no pyplot, no display, no global state).

  - `plot_runs`: left, the TTFT CDF per policy (or per endpoint, pooled over the runs) with the
    SLO marked; right, requests in flight over time per run (the load each policy saw).
  - `plot_trace`: left, input and output length histograms on log-spaced bins; right, the
    arrival rate over time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from extproc.bench.results import SLO, LabeledRun
from extproc.bench.traces import Trace

__all__ = ["plot_runs", "plot_trace"]


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    return path


def _in_flight(run: LabeledRun) -> tuple[np.ndarray, np.ndarray]:
    """Step series (time in the run's unit, requests in flight) from send and end times."""
    scale = run.record.time_scale
    events = [(r.sent_wall_s * scale, 1) for r in run.record.results]
    events += [(r.done_wall_s * scale, -1) for r in run.record.results if r.done_wall_s is not None]
    events.sort()
    times = np.array([t for t, _ in events], dtype=float)
    level = np.cumsum([d for _, d in events])
    return times, level


def plot_runs(
    runs: Sequence[LabeledRun],
    path: str | Path,
    *,
    by: Literal["policy", "endpoint"] = "policy",
    slo: SLO | None = None,
) -> Path:
    """Write the TTFT CDF and load-over-time figure of `runs` to `path` (PNG).

    Args:
        runs: the runs to compare (their latencies in their own time unit).
        path: output file.
        by: one TTFT curve per run (`policy`) or per serving endpoint, pooled (`endpoint`).
        slo: marks the TTFT objective.

    Returns:
        `path`.
    """
    slo = slo or SLO()
    unit = runs[0].record.time_unit if runs else "wall"
    fig = Figure(figsize=(12, 4.5))
    cdf, load = fig.subplots(1, 2)
    groups: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        for r in run.record.results:
            if r.ok and r.ttft_s is not None:
                key = run.policy if by == "policy" else (r.endpoint or "unknown")
                groups[key].append(r.ttft_s * 1000)
    for key, values in sorted(groups.items()):
        xs = np.sort(values)
        cdf.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=f"{key} (n={xs.size})")
    cdf.axvline(slo.ttft_ms, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo.ttft_ms:g} ms")
    if groups:
        cdf.set_xscale("log")
    cdf.set_xlabel(f"TTFT (ms, {unit} time)")
    cdf.set_ylabel("fraction of successful requests")
    cdf.set_title(f"TTFT CDF by {by}")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize=8, loc="lower right")
    for run in runs:
        times, level = _in_flight(run)
        if times.size:
            load.step(times, level, where="post", label=run.policy)
    load.set_xlabel(f"time since first send (s, {unit})")
    load.set_ylabel("requests in flight")
    load.set_title("Load over time")
    load.grid(True, alpha=0.3)
    if runs:
        load.legend(fontsize=8)
    return _save(fig, path)


def plot_trace(trace: Trace, path: str | Path, *, tier_edges: tuple[int, int] = (512, 2048)) -> Path:
    """Write length histograms (log-spaced bins on a log axis, `tier_edges` in tokens dotted) and
    the arrival rate of `trace` to `path` (PNG); returns `path`."""
    fig = Figure(figsize=(12, 4.5))
    lengths, rate = fig.subplots(1, 2)
    inputs = np.array([r.input_tokens for r in trace.requests], dtype=float)
    outputs = np.array([r.output_tokens for r in trace.requests], dtype=float)
    if inputs.size:
        top = max(inputs.max(), outputs.max(), 2.0)
        bins = np.logspace(0, np.log10(top) + 0.01, 60)
        lengths.hist(inputs, bins=bins, alpha=0.6, label="input")
        lengths.hist(outputs, bins=bins, alpha=0.6, label="output")
        lengths.set_xscale("log")
        for edge in tier_edges:
            lengths.axvline(edge, color="grey", linestyle=":", linewidth=1)
        lengths.legend()
    lengths.set_xlabel(f"tokens (tier edges {tier_edges[0]:,} and {tier_edges[1]:,} dotted)")
    lengths.set_ylabel("requests")
    lengths.set_title(f"{trace.path.name}: token lengths")
    arrivals = np.array([r.arrival_s for r in trace.requests], dtype=float)
    if arrivals.size > 1 and arrivals[-1] > arrivals[0]:
        width = max(1.0, (arrivals[-1] - arrivals[0]) / 200)
        counts, edges = np.histogram(arrivals, bins=np.arange(arrivals[0], arrivals[-1] + width, width))
        rate.step(edges[:-1], counts / width, where="post")
        rate.set_title(f"arrival rate ({width:.0f} s bins)")
    else:
        rate.set_title("arrival rate")
    rate.set_xlabel("time (s)")
    rate.set_ylabel("requests/s")
    rate.grid(True, alpha=0.3)
    return _save(fig, path)
