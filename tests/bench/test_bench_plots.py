"""The PNG helpers write real images from runs and traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.bench.loadgen import RequestResult, RunRecord
from extproc.bench.plots import plot_runs, plot_trace
from extproc.bench.results import LabeledRun
from extproc.bench.traces import load_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(policy: str, ttfts: list[float]) -> LabeledRun:
    results = [
        RequestResult(index=i, scheduled_s=float(i), lag_s=0.0, input_tokens=10, max_tokens=5,
                      sent_wall_s=float(i), done_wall_s=i + 2.5, status=200, ttft_s=t, e2e_s=t + 1,
                      output_tokens=5, endpoint=f"10.0.0.{i % 2}:8000")
        for i, t in enumerate(ttfts)
    ]
    return LabeledRun(policy, "t", RunRecord(results, "simulated", 10.0, 12.5, len(results)))


@pytest.mark.parametrize("by", ["policy", "endpoint"])
def test_plot_runs(tmp_path: Path, by: str) -> None:
    runs = [_run("round-robin", [0.1, 0.5, 3.0, 0.2]), _run("llm-extproc", [0.1, 0.2, 0.3, 0.2])]
    path = plot_runs(runs, tmp_path / "runs.png", by=by)  # type: ignore[arg-type]
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_runs_without_successes(tmp_path: Path) -> None:
    assert plot_runs([], tmp_path / "empty.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_trace(tmp_path: Path, traces_dir: Path) -> None:
    path = plot_trace(load_trace(traces_dir / "azure.csv"), tmp_path / "trace.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
