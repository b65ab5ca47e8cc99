"""The external clients' drivers: the traces they are given, their reports read back, their failures.

The clients themselves (guidellm, inference-perf) live in their own virtualenvs and are run by
scripts/bench_clients.py; these tests hold the parts that are ours.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from extproc.bench.clients import ClientError, guidellm, inference_perf, run_client, tokenizer_dir
from extproc.bench.traces import TraceRequest, load_trace


def _requests() -> list[TraceRequest]:
    return [
        TraceRequest(arrival_s=10.0, input_tokens=1100, output_tokens=40, prefix_blocks=(7, 8, 9)),
        TraceRequest(arrival_s=10.5, input_tokens=600, output_tokens=20, prefix_blocks=(7, 11)),
        TraceRequest(arrival_s=12.25, input_tokens=1500, output_tokens=5, prefix_blocks=(7,)),
    ]


def test_guidellm_trace_keeps_shared_blocks_times_and_lengths(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    assert guidellm.write_trace(list(reversed(_requests())), path, stretch=2.0) == 3
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [0.0, 1.0, 4.5]  # gaps from the first, × 2
    assert [(r["input_length"], r["output_length"]) for r in rows] == [(1100, 40), (600, 20), (1500, 5)]
    assert rows[0]["hash_ids"] == [7, 8, 9] and rows[1]["hash_ids"] == [7, 11]  # the shared first block stays shared
    assert rows[2]["hash_ids"][0] == 7 and len(rows[2]["hash_ids"]) == 3  # 1,500 tokens: two fresh 512-token blocks
    assert len(set(rows[2]["hash_ids"][1:]) & {7, 8, 9, 11}) == 0
    with pytest.raises(ValueError):
        guidellm.write_trace([], path)


def test_inference_perf_trace_is_an_azure_trace_our_own_reader_reads_back(tmp_path) -> None:
    path = tmp_path / "t.csv"
    inference_perf.write_trace(_requests(), path)
    back = load_trace(path, format="azure").requests
    assert [(r.input_tokens, r.output_tokens) for r in back] == [(1100, 40), (600, 20), (1500, 5)]
    assert [r.arrival_s for r in back] == pytest.approx([0.0, 0.5, 2.25], abs=1e-6)


def test_reports_are_read_into_the_pages_figures(tmp_path) -> None:
    stat = {"percentiles": {"p50": 20.0, "p99": 90.0}, "mean": 30.0}
    g = tmp_path / "g.json"
    g.write_text(json.dumps({"benchmarks": [{"duration": 60.0, "metrics": {
        "request_totals": {"successful": 99, "errored": 1},
        "time_to_first_token_ms": {"successful": stat}, "inter_token_latency_ms": {"successful": stat},
        "time_per_output_token_ms": {"successful": stat}, "output_tokens_per_second": {"successful": {"mean": 500.0}},
        "requests_per_second": {"successful": {"mean": 1.65}},
    }}]}))  # fmt: skip
    figures = guidellm.parse_report(g)
    assert figures["ok"] == 99 and figures["ttft_p99_ms"] == 90.0 and figures["tpot_p50_ms"] == 20.0
    assert figures["output_tokens_per_s"] == 500.0 and figures["rps"] == 1.65
    latency = {"median": 0.02, "p99": 0.09}
    ip = tmp_path / "summary_lifecycle_metrics.json"
    ip.write_text(json.dumps({"benchmark_time_seconds": 61.0, "failures": {"count": 2}, "successes": {
        "count": 98, "latency": {"time_to_first_token": latency, "time_per_output_token": latency, "inter_token_latency": {"median": 0.0}},
        "throughput": {"output_tokens_per_sec": 480.0, "requests_per_sec": 1.6},
    }}))  # fmt: skip
    figures = inference_perf.parse_report(ip)
    assert figures["ttft_p50_ms"] == pytest.approx(20.0) and figures["tpot_p99_ms"] == pytest.approx(90.0)
    assert figures["itl_p50_ms"] == 0.0 and figures["errored"] == 2
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ClientError):
        guidellm.parse_report(tmp_path / "bad.json")
    with pytest.raises(ClientError):
        inference_perf.parse_report(tmp_path / "bad.json")


def test_the_clients_configs_name_the_stack_the_trace_and_a_local_tokenizer(tmp_path) -> None:
    assert (tokenizer_dir() / "tokenizer.json").is_file()
    g = guidellm.scenario("http://127.0.0.1:1", "m", tmp_path / "t.jsonl", tokenizer_dir(), tmp_path / "r.json")["spec"]
    assert g["backend"]["target"] == "http://127.0.0.1:1" and g["profile"]["kind"] == "replay"
    assert g["data"][0]["hash_id_block_size"] == 512 and g["tokenizer"]["model"] == str(tokenizer_dir())
    cfg = inference_perf.config("http://127.0.0.1:1", "m", tmp_path / "t.csv", tokenizer_dir(), tmp_path / "out", duration_s=90)
    assert cfg["load"]["type"] == "trace_replay" and cfg["load"]["stages"] == [{"rate": 1, "duration": 90}]
    assert cfg["tokenizer"]["pretrained_model_name_or_path"] == str(tokenizer_dir())


def test_a_client_that_fails_or_writes_nothing_is_a_clear_error(tmp_path) -> None:
    report = tmp_path / "r.json"
    with pytest.raises(ClientError, match="exited 3"):
        run_client([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], workdir=tmp_path, report=report, timeout_s=30)
    with pytest.raises(ClientError, match="without r.json"):
        run_client([sys.executable, "-c", "pass"], workdir=tmp_path, report=report, timeout_s=30)
    with pytest.raises(ClientError, match="cannot run"):
        run_client([str(tmp_path / "missing")], workdir=tmp_path, report=report, timeout_s=30)
    script = f"import os, pathlib; pathlib.Path({str(report)!r}).write_text(os.environ.get('HF_HUB_OFFLINE', ''))"
    assert run_client([sys.executable, "-c", script], workdir=tmp_path, report=report, timeout_s=30) == report
    assert report.read_text() == "1"  # offline: no tokenizer download
    assert (tmp_path / f"{Path(sys.executable).name}.log").exists()  # its output kept for a reader
