"""Summary statistics and the shared report shape, on hand-computed inputs."""

from __future__ import annotations

import orjson
import pytest
from rich.console import Console

from extproc.bench.loadgen import RequestResult, RunRecord
from extproc.bench.results import (
    SLO,
    LabeledRun,
    build_report,
    merge_reports,
    percentiles,
    prefix_cache_counters,
    prefix_cache_hit_rate,
    render_report,
    request_rows,
    summarize_run,
)


def _ok(i: int, *, sched: float, ttft: float, e2e: float, out: int, endpoint: str | None, lag: float = 0.0,
        sent: float = 0.0, done: float = 1.0) -> RequestResult:
    return RequestResult(
        index=i, scheduled_s=sched, lag_s=lag, input_tokens=100, max_tokens=out, sent_wall_s=sent,
        done_wall_s=done, status=200, endpoint=endpoint, ttft_s=ttft, e2e_s=e2e, output_tokens=out,
    )


def _record(time_unit: str = "wall", scale: float = 1.0) -> RunRecord:
    results = [
        # ITL = (1.1 - 0.1) / (11 - 1) = 100 ms: exactly at the SLO, so it counts as good.
        _ok(0, sched=0.0, ttft=0.1, e2e=1.1, out=11, endpoint="A"),
        # ITL = 2.0 / 40 = 50 ms; sent 60 ms late.
        _ok(1, sched=1.0, ttft=0.3, e2e=2.3, out=41, endpoint="A", lag=0.06),
        # TTFT 2.5 s misses the SLO; ITL 200 ms.
        _ok(2, sched=2.0, ttft=2.5, e2e=4.5, out=11, endpoint="B", sent=2.0, done=6.0),
        # One output token: no ITL, meets that half of the SLO.
        _ok(3, sched=3.0, ttft=0.2, e2e=0.2, out=1, endpoint="B"),
        RequestResult(index=4, scheduled_s=4.0, lag_s=0.01, input_tokens=100, max_tokens=5, status=429,
                      error="429 rate_limit_exceeded", done_wall_s=4.1),
    ]
    return RunRecord(results, time_unit, scale, wall_duration_s=6.0, planned=5)


def test_percentiles_interpolate_linearly() -> None:
    assert percentiles([100, 200, 300, 2500], (50, 90, 99)) == pytest.approx([250, 1840, 2434])
    assert percentiles([], (50, 99)) == [None, None]
    assert percentiles([0.1, 0.3], (50,), scale=1000) == pytest.approx([200])


def test_summary_on_hand_computed_run() -> None:
    s = summarize_run(LabeledRun("least-load", "fixture", _record(), prefix_cache_hit_rate=0.25))
    assert s.requests == 5 and s.successes == 4
    assert s.offered_rps == pytest.approx(5 / 4.0)  # 5 requests over 4 trace seconds
    assert s.errors == {"429 rate_limit_exceeded": 1}
    # TTFT of the successes: 100, 300, 2500, 200 ms.
    assert (s.ttft_ms.p50, s.ttft_ms.p90, s.ttft_ms.p99) == pytest.approx((250, 1840, 2434))
    # Per-request ITL: 100, 50, 200 ms (the 1-token answer has none).
    assert (s.itl_ms.p50, s.itl_ms.p99) == pytest.approx((100, 198))
    # E2E: 1100, 2300, 4500, 200 ms.
    assert (s.e2e_ms.p50, s.e2e_ms.p99) == pytest.approx((1700, 4434))
    assert s.output_tokens_per_s == pytest.approx((11 + 41 + 11 + 1) / 6.0)
    assert s.goodput_rps == pytest.approx(3 / 6.0)  # requests 0, 1 and 3 meet the SLO
    assert s.prefix_cache_hit_rate == 0.25
    assert s.endpoints == pytest.approx({"A": 0.4, "B": 0.4, "unknown": 0.2})
    assert s.behind_schedule.count == 1
    assert s.behind_schedule.fraction == pytest.approx(0.2)
    assert s.behind_schedule.max_lag_ms == pytest.approx(60)
    assert s.behind_schedule.threshold_ms == pytest.approx(50)


def test_stricter_slo_lowers_goodput() -> None:
    s = summarize_run(LabeledRun("p", "t", _record()), SLO(ttft_ms=250, itl_ms=60))
    # Request 0 fails ITL (100 ms), 1 and 2 fail TTFT (300 ms, 2.5 s); only 3 (200 ms, no ITL) is good.
    assert s.goodput_rps == pytest.approx(1 / 6.0)


def test_simulated_time_divides_by_simulated_duration() -> None:
    s = summarize_run(LabeledRun("p", "t", _record("simulated", 10.0)))
    assert s.goodput_rps == pytest.approx(3 / 60.0)


def test_report_has_the_shared_json_shape() -> None:
    report = build_report([LabeledRun("a", "t", _record()), LabeledRun("b", "t", _record())])
    doc = orjson.loads(orjson.dumps(report.model_dump()))
    assert set(doc) == {"runs", "slo", "time_unit", "settings"} and doc["settings"] is None  # bench fills settings
    assert doc["slo"] == {"ttft_ms": 2000, "itl_ms": 100} and doc["time_unit"] == "wall"
    assert set(doc["runs"][0]) == {
        "policy", "trace", "requests", "offered_rps", "successes", "errors", "ttft_ms", "itl_ms", "e2e_ms",
        "output_tokens_per_s", "goodput_rps", "prefix_cache_hit_rate", "endpoints", "behind_schedule", "speed",
    }
    assert set(doc["runs"][0]["ttft_ms"]) == {"p50", "p90", "p99"}
    assert set(doc["runs"][0]["itl_ms"]) == set(doc["runs"][0]["e2e_ms"]) == {"p50", "p99"}
    assert type(report).model_validate(doc) == report  # readable back


def test_report_refuses_mixed_time_units() -> None:
    with pytest.raises(ValueError, match="time units"):
        build_report([LabeledRun("a", "t", _record("wall")), LabeledRun("b", "t", _record("simulated", 5.0))])


def test_empty_run() -> None:
    s = summarize_run(LabeledRun("p", "t", RunRecord([], "wall", 1.0, 0.0, 0)))
    assert s.requests == 0 and s.ttft_ms.p50 is None and s.goodput_rps is None and s.endpoints == {}


def test_table_lists_each_run() -> None:
    report = build_report([LabeledRun("round-robin", "t", _record()), LabeledRun("llm-extproc", "t", _record())])
    console = Console(record=True, width=250)
    console.print(render_report(report))
    text = console.export_text()
    assert "round-robin" in text and "llm-extproc" in text
    assert "250 / 1,840 / 2,434" in text  # TTFT p50/p90/p99
    assert "429 rate_limit_exceeded×1" in text


def test_merge_keeps_every_run_in_order_and_shared_settings() -> None:
    settings = {"speed": 0.27, "seed": 0, "rate_scales": [12.0]}
    a = build_report([LabeledRun("envoy-least-request", "t", _record("simulated", 0.27))], settings=settings)
    b = build_report([LabeledRun("llm-extproc", "t", _record("simulated", 0.27))], settings=dict(settings))
    merged, differing = merge_reports([a, b])
    assert [r.policy for r in merged.runs] == ["envoy-least-request", "llm-extproc"]
    assert merged.runs == [a.runs[0], b.runs[0]] and merged.time_unit == "simulated"
    assert merged.settings == settings and differing == []


def test_merge_names_the_settings_that_differ_and_drops_them() -> None:
    a = build_report([LabeledRun("a", "t", _record())], settings={"speed": 0.27, "seed": 0})
    b = build_report([LabeledRun("b", "t", _record())], settings={"speed": 1.0, "seed": 0})
    c = build_report([LabeledRun("c", "t", _record())])  # no settings (demo --json)
    merged, differing = merge_reports([a, b])
    assert differing == ["speed"] and merged.settings is None
    assert merge_reports([a, c])[1] == ["seed", "speed"]


def test_merge_refuses_reports_that_do_not_compare() -> None:
    wall = build_report([LabeledRun("a", "t", _record())])
    with pytest.raises(ValueError, match="SLOs"):
        merge_reports([wall, build_report([LabeledRun("b", "t", _record())], SLO(ttft_ms=500))])
    with pytest.raises(ValueError, match="time units"):
        merge_reports([wall, build_report([LabeledRun("b", "t", _record("simulated", 2.0))])])
    with pytest.raises(ValueError, match="no report"):
        merge_reports([])


METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 250.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 50.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
"""


def test_prefix_cache_counters_and_hit_rate() -> None:
    assert prefix_cache_counters(METRICS) == (300.0, 1000.0)
    assert prefix_cache_counters("") == (0.0, 0.0)
    # Two engines: (550 − 250) hits over (1600 − 1000) queries.
    assert prefix_cache_hit_rate([(250, 1000), (0, 0)], [(450, 1400), (100, 200)]) == pytest.approx(0.5)
    assert prefix_cache_hit_rate([(5, 10)], [(5, 10)]) is None


def test_request_rows_flatten_every_request_of_every_run() -> None:
    runs = [LabeledRun("a", "fixture", _record()), LabeledRun("b", "fixture", _record("simulated", 2.0))]
    rows = list(request_rows(runs))
    assert [(r["policy"], r["index"]) for r in rows] == [(p, i) for p in "ab" for i in range(5)]
    second = rows[1]
    assert (second["endpoint"], second["status"], second["lag_ms"]) == ("A", 200, 60.0)
    assert (second["ttft_ms"], second["e2e_ms"], second["itl_ms"]) == (300.0, 2300.0, 50.0)
    refused = rows[4]
    assert (refused["status"], refused["error"], refused["ttft_ms"], refused["endpoint"]) == (
        429, "429 rate_limit_exceeded", None, None,
    )
    orjson.dumps(rows)  # every value is JSON-serialisable
