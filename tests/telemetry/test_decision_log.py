"""The decision log: JSON lines written by a background thread, rotated by size, bounded queue,
tenant hashed; and `llm-extproc analyze` on a generated log matches numpy's own percentiles."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter
from typer.testing import CliRunner

from extproc.bench.analyze import analyze_trace
from extproc.bench.traces import load_trace
from extproc.cli import app
from extproc.config.schema import DecisionLogConfig
from extproc.pipeline.truncate import Truncation
from extproc.telemetry.decision_log import MAX_REQUEST_ID_CHARS, DecisionLog, DecisionRecord

FIELDS = {
    "time", "kind", "model", "tenant", "prompt_tokens", "output_budget", "endpoint", "tier", "predicted_ttft_ms",
    "observed_ttft_ms", "status", "outcome", "reason", "truncation", "decision_ms", "request_id", "prefix_blocks",
    "prefix_tokens",
}  # fmt: skip


def record(i: int, prompt: int, **extra) -> DecisionRecord:
    return DecisionRecord(time=1_700_000_000 + i * 0.25, kind="chat", model="m", prompt_tokens=prompt, **{"output_budget": 128, **extra})


def write_all(path: Path, records: list[DecisionRecord], **config) -> None:
    log = DecisionLog(DecisionLogConfig(path=str(path), **config))
    log.start()
    try:
        for r in records:
            log.write(r)
    finally:
        log.close()


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_rotates_by_size_and_keeps_backup_count(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "decisions.jsonl"  # the directory is created
    write_all(path, [record(i, 100 + i, endpoint="10.0.0.1:8000") for i in range(400)], max_bytes=8192, backup_count=2)
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["decisions.jsonl", "decisions.jsonl.1", "decisions.jsonl.2"]
    kept = lines(path.parent / "decisions.jsonl.2") + lines(path.parent / "decisions.jsonl.1") + lines(path)
    assert all(p.stat().st_size <= 8192 for p in path.parent.iterdir())
    # The newest lines survive, in order, whole; the oldest rotated away.
    assert [r["prompt_tokens"] for r in kept] == list(range(500 - len(kept), 500))
    assert all(set(r) == FIELDS for r in kept)


def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    dropped = Counter("dropped_total", "", registry=CollectorRegistry())
    log = DecisionLog(DecisionLogConfig(path=str(tmp_path / "d.jsonl"), queue_size=2), dropped)
    for i in range(5):  # not started: nothing drains the queue
        log.write(record(i, 10))
    assert dropped._value.get() == 3
    log.start()
    log.close()
    assert len(lines(tmp_path / "d.jsonl")) == 2


def test_fields_and_tenant_hash(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    cut = Truncation("messages", 50_000, 39_000, 12)
    r = record(0, 39_000, tenant="acme-corp", truncation=cut, predicted_ttft_s=0.1234567, decision_s=0.002)
    write_all(path, [r, record(1, 7)])
    first, second = lines(path)
    assert first["tenant"] == hashlib.sha256(b"acme-corp").hexdigest()[:16]
    assert b"acme-corp" not in path.read_bytes()
    assert first["truncation"] == {"cut": "messages", "tokens_before": 50_000, "tokens_after": 39_000,
                                   "tokens_dropped": 11_000, "messages_dropped": 12}  # fmt: skip
    assert first["predicted_ttft_ms"] == 123.457 and first["decision_ms"] == 2.0
    assert second["tenant"] is None and second["truncation"] is None


def test_a_long_client_request_id_is_cut(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    write_all(path, [record(0, 5, request_id="r" * 10_000), record(1, 5, request_id="abc")])
    first, second = lines(path)
    assert first["request_id"] == "r" * MAX_REQUEST_ID_CHARS and second["request_id"] == "abc"


def test_analyze_names_a_decision_logs_output_budget_and_leaves_refused_requests_out_of_it(tmp_path: Path) -> None:
    """A decision log's output column is each request's budget (max_tokens or the expected
    output), not what was generated; a refused request generated nothing, so its budget (here
    4,000, against 100 for every routed one) must not move the statistics."""
    routed = [record(i, 50, output_budget=100) for i in range(20)]
    refused = [record(20 + i, 50, output_budget=4000, outcome="rejected", reason="kv_capacity", status=429) for i in range(5)]
    path = tmp_path / "decisions.jsonl"
    write_all(path, routed + refused)
    analysis = analyze_trace(load_trace(path))
    assert analysis["output_label"] == "output budget" and analysis["refused"] == 5
    assert analysis["output_tokens"]["count"] == 20 and analysis["output_tokens"]["max"] == 100
    assert analysis["input_tokens"]["count"] == 25  # offered: still in the input lengths
    result = CliRunner().invoke(app, ["analyze", str(path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "output budget" in result.output
    assert "5 refused requests are in the input lengths, not in the output budget" in " ".join(result.output.split())


def test_analyze_on_a_generated_log_matches_numpy(tmp_path: Path) -> None:
    rng = np.random.default_rng(14)
    prompts = np.maximum(1, rng.lognormal(mean=6.0, sigma=1.4, size=3000).astype(np.int64))
    records = [record(i, int(n)) for i, n in enumerate(prompts)]
    # A truncated request counts at the length the client sent; a refusal before counting is skipped.
    records.append(record(3000, 40_000, truncation=Truncation("text", 70_000, 40_000)))
    records.append(DecisionRecord(time=1_700_001_000, kind="chat", outcome="rejected", reason="invalid_json", status=400))
    path = tmp_path / "decisions.jsonl"
    write_all(path, records)
    trace = load_trace(path)  # the format is detected from the content
    assert trace.format == "decisions" and trace.skipped == {"not_counted": 1}
    analysis = analyze_trace(trace)
    expected = np.append(prompts, 70_000)
    stats = analysis["input_tokens"]
    reference = np.percentile(expected, [50, 90, 99, 99.9])
    assert [stats["p50"], stats["p90"], stats["p99"], stats["p99.9"]] == pytest.approx(reference.tolist(), rel=1e-12)
    assert stats["count"] == expected.size and stats["max"] == 70_000
    assert stats["share_le_512"] == pytest.approx(float((expected <= 512).mean()))
    assert analysis["arrivals"]["span_s"] == pytest.approx(3000 * 0.25)
    sug = analysis["suggested_tiers"]
    p68, p90 = np.percentile(expected, [68, 90])
    assert sug["low_latency_below"] == 2 ** round(np.log2(p68)) and sug["high_throughput_above"] == 2 ** round(np.log2(p90))


def test_analyze_cli_reads_the_log_and_writes_the_plot(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    write_all(path, [record(i, 2 ** (i % 14) + i) for i in range(200)])
    png = tmp_path / "hist.png"
    result = CliRunner().invoke(app, ["analyze", str(path), "--plot", str(png), "--json", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    assert "format=decisions" in result.output and "Suggested tiers" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert orjson.loads((tmp_path / "a.json").read_bytes())["input_tokens"]["count"] == 200


def test_a_malformed_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    write_all(path, [record(0, 5)])
    with path.open("a") as fh:
        fh.write('{"time": 1, "kind": "chat", "prompt_tokens": "many", "output_budget": 5, "outcome": "routed"}\n')
    with pytest.raises(ValueError, match=r"decisions.jsonl:2: 'prompt_tokens' must be a positive integer"):
        load_trace(path)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_counts_lost_lines_and_closes_cleanly(capfd) -> None:
    # On a full disk each line's write used to print a Python traceback with the record to
    # stderr (logging's handleError), count nothing, and `close()` raised OSError at shutdown.
    dropped = Counter("dropped_total", "", registry=CollectorRegistry())
    log = DecisionLog(DecisionLogConfig(path="/dev/full"), dropped)
    log.start()
    for i in range(20):
        log.write(record(i, 10, endpoint="10.0.0.1:8000"))
    log.close()  # must not raise
    assert dropped._value.get() == 20
    err = capfd.readouterr().err
    assert "Traceback" not in err and "10.0.0.1:8000" not in err
