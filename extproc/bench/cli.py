"""`llm-extproc analyze`: the token-length distribution, arrivals and prefix reuse of a trace."""

from __future__ import annotations

import enum
from pathlib import Path

import typer

__all__ = ["analyze"]


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
