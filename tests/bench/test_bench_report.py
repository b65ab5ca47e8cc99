"""`llm-extproc bench --report`: the table of several `bench --json` reports (e.g. one per policy,
each run under its own lock) as one, read back without starting anything."""

from __future__ import annotations

from pathlib import Path

import orjson
from typer.testing import CliRunner

from extproc.bench.loadgen import RequestResult, RunRecord
from extproc.bench.results import SLO, LabeledRun, Report, build_report
from extproc.cli import app


def _report_file(path: Path, policy: str, **report_options) -> Path:  # type: ignore[no-untyped-def]
    results = [
        RequestResult(index=i, scheduled_s=float(i), lag_s=0.0, input_tokens=100, max_tokens=11, sent_wall_s=float(i),
                      done_wall_s=i + 1.0, status=200, endpoint="A", ttft_s=0.1 * (i + 1), e2e_s=1.0 + i, output_tokens=11)
        for i in range(3)
    ]  # fmt: skip
    record = RunRecord(results, "simulated", 0.27, wall_duration_s=4.0, planned=3)
    report = build_report([LabeledRun(policy, "trace.csv", record)], settings={"speed": 0.27, "seed": 0}, **report_options)
    path.write_bytes(orjson.dumps(report.model_dump(mode="json")))
    return path


def test_report_prints_one_table_over_per_policy_json_and_writes_it_as_one(tmp_path: Path) -> None:
    """Per-policy `bench --json` files, read back: one table as `bench` prints it, no run started."""
    a = _report_file(tmp_path / "a.json", "envoy-least-request")
    b = _report_file(tmp_path / "b.json", "llm-extproc")
    merged = tmp_path / "merged.json"
    result = CliRunner().invoke(app, ["bench", "--report", f"{a},{b}", "--json", str(merged)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "simulated time (×0.27)" in result.output
    rows = [line for line in result.output.splitlines() if "trace.csv" in line]
    assert [row.split()[1] for row in rows] == ["envoy-least-request", "llm-extproc"]
    assert all("200 / 280 / 298" in row for row in rows)  # TTFT p50/p90/p99 of 100, 200, 300 ms
    report = Report.model_validate_json(merged.read_bytes())
    assert [r.policy for r in report.runs] == ["envoy-least-request", "llm-extproc"]
    assert report.settings == {"speed": 0.27, "seed": 0}


def test_report_refuses_unreadable_or_incomparable_files(tmp_path: Path) -> None:
    a = _report_file(tmp_path / "a.json", "envoy-least-request")
    strict = _report_file(tmp_path / "strict.json", "llm-extproc", slo=SLO(ttft_ms=500))
    (tmp_path / "bad.json").write_text('{"runs": 3}')
    cases = [
        ([f"{a},{tmp_path / 'missing.json'}"], "cannot read"),
        ([f"{a},{tmp_path / 'bad.json'}"], "is not a bench --json report"),
        ([f"{a},{strict}"], "different SLOs"),
        ([","], "one or more JSON files"),
        ([str(a), "--plot", str(tmp_path / "x.png")], "--plot and --requests-out need the runs"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(app, ["bench", "--report", *args], env={"COLUMNS": "250"})
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)
