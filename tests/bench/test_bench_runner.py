"""Workload building for demo/bench: rescaling, fitting prompts to the context, automatic load and
speed; and the result views (run details, goodput table and plot) on hand-made summaries."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from extproc.bench.results import SLO, BehindSchedule, Report, RunSummary, TailPercentiles, TTFTPercentiles
from extproc.bench.runner import (
    Workload,
    WorkloadOptions,
    auto_rate_scale,
    auto_speed,
    fit_context,
    fleet_prefill_capacity,
    load_workload,
    with_messages,
)
from extproc.bench.traces import TraceRequest
from extproc.bench.views import plot_goodput, render_goodput, render_run_details
from extproc.sim.profiles import PROFILES


def _workload(*arrivals: float, tokens: tuple[int, int] = (900, 100)) -> Workload:
    return Workload("w", [TraceRequest(a, tokens[0], tokens[1]) for a in arrivals])


def test_scaled_divides_arrivals() -> None:
    w = _workload(0.0, 1.0, 3.0).scaled(2.0)
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.5]
    assert w.offered_rps == pytest.approx(3 / 1.5)
    with pytest.raises(ValueError, match="positive"):
        w.scaled(0.0)


@pytest.mark.parametrize(
    ("options", "count"),
    [
        (WorkloadOptions(requests=25), 25),
        # 4 req/s × 2 for 10 s: 81 requests generated, those arriving within 10 s kept
        (WorkloadOptions(duration_s=10.0, rate=4.0, rate_scale=2.0), None),
    ],
    ids=["requests", "duration"],
)
def test_synthetic_workload(options: WorkloadOptions, count: int | None) -> None:
    w = load_workload(options)
    assert w.name == "synthetic" and w.requests[0].arrival_s == 0.0
    if count is not None:
        assert len(w.requests) == count
    else:
        assert all(r.arrival_s <= 10.0 for r in w.requests) and 40 <= len(w.requests) <= 81


def test_trace_workload_is_cut_and_rescaled(traces_dir: Path) -> None:
    full = load_workload(WorkloadOptions(trace=traces_dir / "mooncake.jsonl"))
    fast = load_workload(WorkloadOptions(trace=traces_dir / "mooncake.jsonl", rate_scale=2.0, requests=2))
    assert fast.name == "mooncake.jsonl" and len(fast.requests) == 2
    assert [r.arrival_s for r in fast.requests] == [r.arrival_s / 2 for r in full.requests[:2]]


def test_empty_workload_is_an_error(traces_dir: Path) -> None:
    with pytest.raises(ValueError, match="workload is empty"):
        load_workload(WorkloadOptions(trace=traces_dir / "mooncake.jsonl", start_offset_s=1e9))


def test_fit_context_keeps_leading_blocks() -> None:
    long = TraceRequest(0.0, 5000, 300, prefix_blocks=tuple(range(10)))  # 5,000 + 300 > 4,096
    huge_output = TraceRequest(1.0, 100, 4000)  # output alone over half the context
    fine = TraceRequest(2.0, 3000, 1096, prefix_blocks=(0, 1, 2, 3, 4, 5))  # exactly 4,096
    fitted, cut = fit_context(Workload("w", [long, huge_output, fine]), 4096)
    assert cut == 2
    a, b, c = fitted.requests
    assert (a.input_tokens, a.output_tokens, a.prefix_blocks) == (3796, 300, (0, 1, 2, 3, 4, 5, 6, 7))  # ⌈3796/512⌉ = 8
    assert (b.input_tokens, b.output_tokens) == (2048, 2048)
    assert c == fine


def test_auto_rate_scale_offers_the_asked_share_of_prefill_capacity() -> None:
    profiles = ["h100-qwen3-8b", "a100-qwen3-8b"]
    capacity = fleet_prefill_capacity(profiles)
    assert capacity == pytest.approx(sum(1 / PROFILES[p].coefficients.b for p in profiles))
    w = _workload(0.0, 1.0, 2.0)  # 1.5 req/s of 1,000 tokens each
    scale = auto_rate_scale(w, profiles, 0.5)
    assert scale * 1.5 * 1000 == pytest.approx(0.5 * capacity)
    with pytest.raises(ValueError, match="no arrival rate"):
        auto_rate_scale(_workload(0.0), profiles, 0.5)


@pytest.mark.parametrize(
    ("offered", "expected"), [(None, 1.0), (10.0, 1.0), (25.0, 1.0), (100.0, 0.25)], ids=["none", "low", "at", "high"]
)
def test_auto_speed(offered: float | None, expected: float) -> None:
    assert auto_speed(offered, 25.0) == pytest.approx(expected)


def _summary(policy: str, trace: str, goodput: float, offered: float, behind: float = 0.0) -> RunSummary:
    return RunSummary(
        policy=policy, trace=trace, requests=100, offered_rps=offered, successes=98,
        errors={"429 rate_limit_exceeded": 1, "timeout": 1},
        ttft_ms=TTFTPercentiles(p50=100.0, p90=400.0, p99=900.0), itl_ms=TailPercentiles(p50=12.5, p99=30.0),
        e2e_ms=TailPercentiles(p50=2000.0, p99=9000.0), output_tokens_per_s=1234.0, goodput_rps=goodput,
        prefix_cache_hit_rate=0.25, endpoints={"127.0.0.1:1": 0.75, "127.0.0.1:2": 0.25},
        behind_schedule=BehindSchedule(threshold_ms=50.0, count=int(behind * 100), fraction=behind, max_lag_ms=80.0),
    )  # fmt: skip


def _text(renderable: object) -> str:
    console = Console(width=300, record=True)
    console.print(renderable)
    return console.export_text()


def test_run_details_show_errors_by_reason_and_endpoint_shares() -> None:
    text = _text(render_run_details(_summary("llm-extproc", "synthetic", 3.0, 4.0), time_unit="simulated",
                                    profiles={"127.0.0.1:1": "h100-qwen3-8b"}))  # fmt: skip
    for expected in ("of which 429 (refused)", "429 rate_limit_exceeded", "timeout", "100 ms / 900 ms", "12.5 ms",
                     "share 127.0.0.1:1 (h100-qwen3-8b)", "75.0%", "share 127.0.0.1:2", "25.0%",
                     "goodput (req/s with TTFT ≤ 2000 ms, ITL ≤ 100 ms)"):
        assert expected in text, expected
    assert "simulated" not in text  # speed 1: simulated time is wall time, nothing to say


def test_run_details_list_fleet_endpoints_that_served_nothing() -> None:
    """An endpoint of the fleet that got no request still has its row, at 0.0%."""
    profiles = {"127.0.0.1:3": "a100-qwen3-8b", "127.0.0.1:1": "h100-qwen3-8b", "127.0.0.1:2": "h100-qwen3-8b"}
    lines = _text(render_run_details(_summary("llm-extproc", "synthetic", 3.0, 4.0), time_unit="wall",
                                     profiles=profiles)).splitlines()  # fmt: skip
    shares = [" ".join(line.strip("│ ").split()) for line in lines if "share " in line]
    assert shares == [  # in the fleet's order
        "share 127.0.0.1:3 (a100-qwen3-8b) │ 0.0%",
        "share 127.0.0.1:1 (h100-qwen3-8b) │ 75.0%",
        "share 127.0.0.1:2 (h100-qwen3-8b) │ 25.0%",
    ]


def test_simulated_time_is_named_only_when_the_speed_is_not_1() -> None:
    from extproc.bench.results import SLO, render_report

    fast = _summary("llm-extproc", "synthetic", 3.0, 4.0).model_copy(update={"speed": 10.0})
    assert "simulated time (×10)" in _text(render_run_details(fast, time_unit="simulated"))
    text = _text(render_report(Report(runs=[fast], slo=SLO(ttft_ms=500), time_unit="simulated")))
    assert "simulated time (×10)" in text and "goodput SLO: TTFT ≤ 500 ms" in text
    real = _text(render_report(Report(runs=[_summary("p", "t", 1.0, 1.0)], slo=SLO(), time_unit="simulated")))
    assert "simulated" not in real


def test_goodput_views_one_column_per_load_and_a_line_per_policy(tmp_path: Path) -> None:
    report = Report(
        runs=[
            _summary("envoy-least-request", "t ×1", 4.0, 5.0),
            _summary("llm-extproc", "t ×1", 4.5, 5.0),
            _summary("envoy-least-request", "t ×2", 5.0, 10.0, behind=0.05),
            _summary("llm-extproc", "t ×2", 8.0, 10.0),
        ],
        slo=SLO(),
        time_unit="simulated",
    )
    lines = _text(render_goodput(report)).splitlines()
    header = next(line for line in lines if "policy" in line)
    assert header.index("t ×1") < header.index("t ×2")
    lr = next(line for line in lines if line.lstrip("│ ").startswith("envoy-least-request"))
    assert "4.00 rps / 900 ms" in lr and "5.00 rps / 900 ms behind" in lr  # 5 % late: flagged
    ours = next(line for line in lines if line.lstrip("│ ").startswith("llm-extproc"))
    assert "8.00 rps" in ours and "behind" not in ours
    png = plot_goodput(report, tmp_path / "goodput.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_with_messages_builds_what_the_load_generator_would_send(synth, qwen_counter) -> None:  # type: ignore[no-untyped-def]
    from extproc.bench.loadgen import LoadGenConfig, LoadGenerator

    w = Workload("w", [TraceRequest(0.0, 700, 5, prefix_blocks=(3, 4)), TraceRequest(0.5, 40, 5, session="s1")])
    built = with_messages(w, synth)
    loadgen = LoadGenerator(LoadGenConfig(base_url="http://127.0.0.1:9"), synth)
    for i, (raw, ready) in enumerate(zip(w.requests, built.requests)):
        assert raw.messages is None and ready.messages is not None
        assert loadgen.body(ready, i) == loadgen.body(raw, i)  # same bytes on the wire
        assert qwen_counter.count_chat(ready.messages).count == raw.input_tokens  # exact length kept
