"""Trace analysis on the Mooncake fixture (numbers worked out by hand) and the `analyze` CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
from typer.testing import CliRunner

from extproc.bench.analyze import analyze_trace, arrival_stats, enough_spread, log2_histogram, suggest_tiers
from extproc.bench.traces import load_trace
from extproc.cli import app

# tests/testdata/traces/mooncake.jsonl, after the 0-output row is skipped:
#   t=0.0 in=1000 blocks [0,1] | t=0.5 in=1200 [0,1,2] | t=1.5 in=300 [3] | t=2.0 in=1100 [0,4,5]


@pytest.fixture(scope="module")
def analysis(traces_dir: Path) -> dict:
    return analyze_trace(load_trace(traces_dir / "mooncake.jsonl"), truncate=1024)


def test_lengths(analysis: dict) -> None:
    inp = analysis["input_tokens"]
    assert inp["count"] == 4 and inp["max"] == 1200
    assert inp["p50"] == pytest.approx(1050)  # between 1000 and 1100
    assert inp["share_le_512"] == pytest.approx(0.25)
    assert [(b["lo"], b["hi"], b["count"]) for b in inp["histogram"]] == [(256, 512, 1), (512, 1024, 1), (1024, 2048, 2)]
    assert analysis["skipped"] == {"zero_output_tokens": 1}


def test_tiers(analysis: dict) -> None:
    assert {k: v["count"] for k, v in analysis["tiers"].items()} == {"<512": 1, "512-2048": 3, ">2048": 0}


def test_arrivals(analysis: dict) -> None:
    a = analysis["arrivals"]
    assert a["span_s"] == 2.0 and a["mean_rps"] == 2.0
    # Per-second counts [2, 1, 1]: mean 4/3, population variance 2/9 → IoD 1/6.
    assert a["iod_1s"] == pytest.approx(1 / 6)
    # A 2 s trace has one bin, 2 s long: its peak is its mean, not 4 requests over 60 s.
    assert a["peak_1min_rps"] == pytest.approx(2.0)


def test_peak_of_a_trace_longer_than_a_minute_uses_full_bins() -> None:
    # 30 arrivals in the first minute, 6 in the second (span 90 s).
    arrivals = np.concatenate([np.linspace(0, 59, 30), np.linspace(60, 90, 6)])
    assert arrival_stats(arrivals)["peak_1min_rps"] == pytest.approx(30 / 60)


def test_suggested_tiers_need_spread() -> None:
    same = suggest_tiers(np.full(50, 2000))  # P68 and P90 both round to 2048
    assert enough_spread(same) is False and same["edges"] == (2048, 2048)
    assert enough_spread(suggest_tiers(np.array([], dtype=np.int64))) is False  # no traffic, no advice
    spread = suggest_tiers(np.concatenate([np.full(70, 100), np.full(20, 1000), np.full(10, 8000)]))
    assert enough_spread(spread) is True and spread["edges"][0] < spread["edges"][1]


def test_cli_says_when_tiers_cannot_be_suggested(tmp_path: Path) -> None:
    trace = tmp_path / "flat.jsonl"
    rows = [{"timestamp": i * 500, "input_length": 2000, "output_length": 10, "hash_ids": [i]} for i in range(20)]
    trace.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    result = CliRunner().invoke(app, ["analyze", str(trace)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "not enough spread in input lengths to suggest tiers" in result.output
    assert "high_throughput_above" not in result.output
    assert "skipped_rows=none" in result.output
    # 20 arrivals over 9.5 s: the peak minute is the whole log, so peak == mean (2.105 req/s).
    assert "mean 2.105 req/s, peak 1-min 2.11 req/s" in result.output


def test_prefix_reuse(analysis: dict) -> None:
    reuse = analysis["prefix_reuse"]
    assert reuse["block_refs"] == 9 and reuse["distinct_blocks"] == 6
    assert reuse["repeat_fraction"] == pytest.approx(3 / 9)  # 0,1 in row 2; 0 in row 4
    # Leading blocks already seen: row 2 has 2 (1,024 tokens), row 4 has 1 (512 tokens).
    assert reuse["cached_token_fraction"] == pytest.approx(1536 / 3600)
    assert reuse["lead1_fraction"] == 0.5 and reuse["lead2_fraction"] == 0.25


def test_truncation(analysis: dict) -> None:
    cut = analysis["truncation"]
    assert cut["requests_cut"] == 2 and cut["share_cut"] == 0.5
    assert cut["tokens_dropped"] == (1200 - 1024) + (1100 - 1024)
    assert cut["head_tokens_p50"] == pytest.approx((300 + 275) / 2)  # len/4 each


def test_no_prefix_reuse_without_blocks(traces_dir: Path) -> None:
    assert analyze_trace(load_trace(traces_dir / "azure.csv"))["prefix_reuse"] is None


def test_arrival_stats_of_one_request() -> None:
    assert arrival_stats(np.array([3.0]))["iod_1s"] is None
    assert log2_histogram(np.array([], dtype=int)) == []


def test_cli_prints_and_writes(traces_dir: Path, tmp_path: Path, analysis: dict) -> None:
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    result = CliRunner().invoke(
        app, ["analyze", str(traces_dir / "mooncake.jsonl"), "--json", str(out), "--plot", str(png), "--truncate", "1024"]
    )
    assert result.exit_code == 0, result.output
    assert "format=mooncake" in result.output and "Prefix reuse" in result.output
    assert "skipped_rows=zero_output_tokens: 1" in result.output
    assert orjson.loads(out.read_bytes()) == orjson.loads(orjson.dumps(analysis))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_synthetic_workload() -> None:
    result = CliRunner().invoke(app, ["analyze", "synthetic", "--limit", "3000", "--rate", "5"])
    assert result.exit_code == 0, result.output
    assert "format=synthetic" in result.output and "requests=3,000" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "azure"], "CSV header lacks"),
        (["--rate-scale", "0"], "rate_scale"),
    ],
    ids=["wrong-format", "bad-option"],
)
def test_cli_errors_are_clean(traces_dir: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["analyze", str(traces_dir / "burstgpt1.csv"), *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_cli_unknown_file_format(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("just some notes\n")
    result = CliRunner().invoke(app, ["analyze", str(path)])
    assert result.exit_code == 2
    assert "unknown format" in result.output and "notes.txt" in result.output
