"""Seeds' intervals and verdicts, steady-state windows, validity, hotspot and two-objective capacity,
on hand-computed inputs (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.bench.capacity import LoadPoint, capacity_at_bound, two_objective_capacity
from extproc.bench.loadgen import RequestResult, RunRecord
from extproc.bench.results import LabeledRun
from extproc.bench.seeds import FIGURES, SeededResult, aggregate, compare_to
from extproc.bench.stats import bootstrap_interval, compare
from extproc.bench.steady import (
    ClientUsage,
    SteadySettings,
    engine_request_counts,
    hotspot,
    hotspot_by_class,
    steady_record,
    steady_run,
)

# ── intervals and verdicts ─────────────────────────────────────────────────────────────────


def test_bootstrap_interval_holds_the_mean_and_is_reproducible() -> None:
    values = [100.0, 120.0, 90.0, 110.0, 105.0]
    iv = bootstrap_interval(values)
    assert iv.mean == pytest.approx(105.0) and iv.n == 5
    assert 90.0 <= iv.low < iv.mean < iv.high <= 120.0
    assert bootstrap_interval(values) == iv  # seeded: a result file regenerates the same page
    one = bootstrap_interval([42.0, None])  # a run without the figure is left out
    assert (one.mean, one.low, one.high, one.n) == (42.0, 42.0, 42.0, 1)
    assert one.fmt() == "42" and iv.fmt().startswith("105 [")


def test_bootstrap_interval_refuses_what_has_no_mean() -> None:
    with pytest.raises(ValueError, match="no values"):
        bootstrap_interval([None, None])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval([1.0, 2.0], confidence=1.0)


def test_a_consistent_per_seed_difference_is_a_verdict_even_when_seeds_vary_widely() -> None:
    """Seed-to-seed spread (300..900 ms) is far larger than the gap (always 50 ms lower): an
    unpaired comparison calls it noise, the paired one (same requests per seed) does not."""
    base = [300.0, 600.0, 900.0]
    mine = [250.0, 550.0, 850.0]
    paired = compare(mine, base, higher_is_better=False)
    assert paired.verdict == "ahead" and paired.paired
    assert paired.difference.mean == pytest.approx(-50.0)
    assert compare(mine, base, higher_is_better=False, paired=False).verdict == "within noise"
    assert compare(base, mine, higher_is_better=False).verdict == "behind"
    assert compare([1.0, 3.0, 2.0], [2.0, 2.0, 2.0], higher_is_better=True).verdict == "within noise"
    assert compare([5.0], [3.0], higher_is_better=True).verdict == "one run"


def test_paired_comparison_needs_the_same_seeds() -> None:
    with pytest.raises(ValueError, match="one value per seed"):
        compare([1.0, 2.0], [1.0], higher_is_better=True)
    # a seed missing on one side drops out of both
    c = compare([1.0, None, 3.0], [0.0, 5.0, 1.0], higher_is_better=True)
    assert c.difference.n == 2 and c.verdict == "ahead"


# ── steady window, validity, hotspot ───────────────────────────────────────────────────────


def _req(i: int, sched: float, *, endpoint: str | None, lag: float = 0.0, ttft: float = 0.1) -> RequestResult:
    return RequestResult(
        index=i, scheduled_s=sched, lag_s=lag, input_tokens=100, max_tokens=11, sent_wall_s=sched + lag,
        done_wall_s=sched + lag + 1.0, status=200, endpoint=endpoint, ttft_s=ttft, e2e_s=1.0, output_tokens=11,
    )  # fmt: skip


def _run(results: list[RequestResult], policy: str = "p") -> LabeledRun:
    return LabeledRun(policy, "w", RunRecord(results, "simulated", 1.0, wall_duration_s=100.0, planned=len(results)))


def test_the_warm_up_is_left_out_of_every_figure() -> None:
    """Ten cold requests with a 5 s TTFT, then ten steady ones at 100 ms: the steady p99 is 100 ms."""
    cold = [_req(i, float(i), endpoint="a", ttft=5.0) for i in range(10)]
    warm = [_req(10 + i, 10.0 + i, endpoint="b") for i in range(10)]
    record = steady_record(_run(cold + warm).record, warmup_s=10.0)
    assert [r.index for r in record.results] == list(range(10, 20))
    assert record.wall_duration_s == pytest.approx(10.0)  # 10.0 first send → 20.0 last end
    with pytest.raises(ValueError, match="warm-up"):
        steady_record(_run(cold).record, warmup_s=60.0)


def _usage(cpu: float = 10.0) -> ClientUsage:
    return ClientUsage(cpu_s=cpu, wall_s=100.0, load_average=1.0)


CLASSES = {"a": "H100", "b": "H100", "c": "A100", "d": "A100"}


def test_steady_run_reports_rates_hotspot_per_class_and_is_valid() -> None:
    # 300 s after a 60 s warm-up, one request a second: a, a, b, c over and over
    ends = ["a", "a", "b", "c"]
    reqs = [_req(i, float(i), endpoint=ends[i % 4]) for i in range(361)]
    run = steady_run(_run(reqs), seed=3, load="1", settings=SteadySettings(), usage=_usage(), classes=CLASSES)
    assert run.valid and run.notes == [] and run.seed == 3
    assert run.steady_span_s == pytest.approx(300.0)
    assert run.summary.requests == 301
    assert run.offered_rps == pytest.approx(301 / 300) and run.achieved_rps == pytest.approx(301 / 300)
    assert run.hotspot == pytest.approx(4 * 151 / 301, rel=0.01)  # a took half of four endpoints' requests
    assert run.hotspot_by_class["H100"] == pytest.approx(2 * 2 / 3, rel=0.01)  # a: 2/3 of the H100s'
    assert run.hotspot_by_class["A100"] == pytest.approx(2.0, rel=0.01)  # c took all, d none
    assert run.class_share["H100"] == pytest.approx(0.75, rel=0.01)
    assert run.endpoint_source == "header"
    assert {f.key for f in FIGURES} >= {"ttft_p99_ms", "tpot_p99_ms", "hotspot", "goodput_rps"}


def test_late_sends_or_a_saturated_client_make_a_run_invalid_and_a_short_one_is_said() -> None:
    late = [_req(i, float(i), endpoint="a", lag=0.2 if i % 10 == 0 else 0.0) for i in range(100)]
    run = steady_run(_run(late), seed=0, load="1", settings=SteadySettings(warmup_s=10), usage=_usage(), classes=CLASSES)
    assert not run.valid and "behind its schedule" in run.invalid_reasons[0]
    assert run.notes == ["steady span 89 s < 300 s"]
    assert run.achieved_rps is not None and run.hotspot == pytest.approx(4.0)
    busy = steady_run(
        _run([_req(i, float(i), endpoint="a") for i in range(20)]), seed=0, load="1",
        settings=SteadySettings(warmup_s=0, min_steady_s=0), usage=_usage(cpu=95.0), classes=CLASSES,
    )  # fmt: skip
    assert not busy.valid and busy.invalid_reasons == ["the client used 95% of a core: its own event loop delayed sends and timestamps"]


def test_hotspot_from_engine_counters_when_answers_name_no_endpoint() -> None:
    reqs = [_req(i, float(i), endpoint=None) for i in range(10)]
    counts = engine_request_counts(
        ["vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 6.0\n",
         "vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 2.0\n"
         "vllm:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 2.0\n", "", ""],
        ["a", "b", "c", "d"],
    )  # fmt: skip
    assert counts == {"a": 6.0, "b": 4.0, "c": 0.0, "d": 0.0}
    run = steady_run(
        _run(reqs), seed=0, load="1", settings=SteadySettings(warmup_s=0, min_steady_s=0), usage=_usage(),
        classes=CLASSES, engine_counts=counts,
    )  # fmt: skip
    assert run.hotspot == pytest.approx(2.4) and run.endpoint_source == "engines"
    assert "whole run" in run.notes[0]
    none = steady_run(_run(reqs), seed=0, load="1", settings=SteadySettings(warmup_s=0, min_steady_s=0), usage=_usage(), classes=CLASSES)
    assert none.hotspot is None and none.hotspot_by_class == {}


def test_hotspot_definition() -> None:
    assert hotspot({"a": 0.25, "b": 0.25, "c": 0.25, "d": 0.25}, 4) == pytest.approx(1.0)
    assert hotspot({"a": 1.0}, 4) == pytest.approx(4.0)
    assert hotspot({"a": 0.5, "unknown": 0.5}, 2) == pytest.approx(2.0)
    assert hotspot({}, 4) is None
    with pytest.raises(ValueError):
        hotspot({"a": 1.0}, 0)
    spots, share = hotspot_by_class({"a": 0.5, "c": 0.5}, CLASSES)
    assert spots == {"H100": 2.0, "A100": 2.0} and share == {"H100": 0.5, "A100": 0.5}


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="warmup_s"):
        SteadySettings(warmup_s=-1)
    with pytest.raises(ValueError, match="max_late_fraction"):
        SteadySettings(max_late_fraction=2)


# ── aggregation over seeds ─────────────────────────────────────────────────────────────────


def _seeded(policy: str, seed: int, ttft: float) -> object:
    reqs = [_req(i, float(i), endpoint="a", ttft=ttft) for i in range(20)]
    return steady_run(
        _run(reqs, policy), seed=seed, load="1", settings=SteadySettings(warmup_s=0, min_steady_s=0),
        usage=_usage(), classes=CLASSES,
    )  # fmt: skip


def test_aggregate_and_compare_over_seeds_leave_invalid_runs_out() -> None:
    runs = [_seeded("base", s, t) for s, t in [(0, 0.3), (1, 0.6), (2, 0.9)]]
    runs += [_seeded("mine", s, t) for s, t in [(0, 0.25), (1, 0.55), (2, 0.85)]]
    bad = _seeded("mine", 3, 9.0).model_copy(update={"valid": False, "invalid_reasons": ["late"]})
    result = SeededResult(
        name="w", workload="w", commit="abc", date="d", command="c", machine="m", baseline="base", seeds=[0, 1, 2, 3],
        settings={}, runs=[*runs, bad],
    )  # fmt: skip
    valid = result.valid_runs()
    assert bad not in valid and len(valid) == 6
    table = aggregate(valid)
    assert table["base"]["ttft_p99_ms"].mean == pytest.approx(600.0) and table["base"]["ttft_p99_ms"].n == 3
    verdicts = compare_to(valid, "base")
    assert verdicts["mine"]["ttft_p99_ms"].verdict == "ahead"
    assert verdicts["mine"]["goodput_rps"].verdict == "within noise"  # every run met the SLO alike
    assert "achieved_rps" not in verdicts["mine"]
    assert compare_to(valid, "nobody") == {}
    assert SeededResult.model_validate_json(result.model_dump_json()) == result  # the result file round-trips


# ── capacity on both objectives ────────────────────────────────────────────────────────────


def test_capacity_interpolates_and_a_policy_cannot_win_by_starving_decode() -> None:
    assert capacity_at_bound([(1.0, 100.0), (2.0, 200.0), (3.0, 400.0)], 300.0) == pytest.approx(2.5)
    assert capacity_at_bound([(1.0, 500.0)], 300.0) is None
    assert capacity_at_bound([(2.0, 100.0), (1.0, 50.0)], 300.0) == 2.0  # holds at the top
    assert capacity_at_bound([(1.0, 100.0), (2.0, None)], 300.0) == 1.0  # nothing succeeded at 2
    # TTFT holds to 3 req/s, but TPOT breaks its bound halfway between 1 and 2
    points = [LoadPoint(1.0, 100.0, 40.0), LoadPoint(2.0, 150.0, 80.0), LoadPoint(3.0, 200.0, 120.0)]
    cap = two_objective_capacity(points, ttft_bound_ms=250.0, tpot_bound_ms=60.0)
    assert cap.ttft_rps == 3.0 and cap.tpot_rps == pytest.approx(1.5) and cap.both_rps == pytest.approx(1.5)
    assert not cap.holds_at_top
    assert two_objective_capacity(points, 250.0, 500.0).holds_at_top
    with pytest.raises(ValueError, match="no load"):
        two_objective_capacity([], 1.0, 1.0)


# ── the page and the regression check (scripts/bench_report.py, scripts/bench_regress.py) ──

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(runs: list, name: str = "w") -> SeededResult:
    return SeededResult(
        name=name, workload="a workload", commit="abc1234", date="2026-12-06 03:00 UTC", command="bench_steady.py --x",
        machine="2 cores", baseline="base", seeds=[0, 1, 2], settings={"rate_scale": 1.0, "speed": 2.0}, runs=runs,
    )  # fmt: skip


def test_the_page_is_generated_from_the_result_files_and_check_catches_drift(tmp_path) -> None:
    runs = [_seeded("base", s, t) for s, t in [(0, 0.3), (1, 0.6), (2, 0.9)]]
    runs += [_seeded("mine", s, t) for s, t in [(0, 0.25), (1, 0.55), (2, 0.85)]]
    runs.append(_seeded("mine", 3, 0.1).model_copy(update={"valid": False, "invalid_reasons": ["2.0% of sends late"]}))
    docs = tmp_path / "benchmarks"
    (docs / "results").mkdir(parents=True)
    (docs / "header.md").write_text("# Benchmarks\n\nhand-written\n")
    (docs / "results" / "w.json").write_text(_result(runs).model_dump_json())
    page = tmp_path / "benchmarks.md"
    report = _script("bench_report")
    text = report.render(docs)
    assert text.startswith("# Benchmarks\n\nhand-written\n")
    assert "**commit** `abc1234`" in text and "**seeds** 0, 1, 2" in text and "`bench_steady.py --x`" in text
    assert "| mine | 3 | 550 [" in text  # TTFT p50: the mean of the three valid seeds (250, 550, 850 ms), interval after
    assert "**ahead** (-50 [-50, -50])" in text  # paired: 50 ms lower at every seed
    assert "**no**: 2.0% of sends late" in text and "6 of 7 runs valid" in text
    argv = [sys.executable, str(ROOT / "scripts" / "bench_report.py"), "--docs", str(docs), "--page", str(page)]
    assert subprocess.run([*argv, "--check"], capture_output=True, check=False).returncode == 1  # no page yet
    subprocess.run(argv, check=True, capture_output=True)
    assert page.read_text() == text
    assert subprocess.run([*argv, "--check"], capture_output=True, check=False).returncode == 0
    (docs / "results" / "w.json").write_text(_result(runs[:3]).model_dump_json())  # a rerun changed the file
    done = subprocess.run([*argv, "--check"], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "run scripts/bench_report.py" in done.stderr


def test_the_capacity_table_bounds_every_policy_by_the_baselines_p99s_at_load_1() -> None:
    report = _script("bench_report")
    one = _result([_seeded(p, s, t) for p, t in [("base", 0.3), ("mine", 0.2)] for s in range(3)])
    doubled = [_seeded(p, s, t) for p, t in [("base", 0.6), ("mine", 0.4)] for s in range(3)]
    two = _result([r.model_copy(update={"offered_rps": 2 * r.offered_rps, "load": "2"}) for r in doubled], name="w-x2")
    two = two.model_copy(update={"settings": {"load": "2"}})
    text = "\n".join(report.capacity_tables([one, two]))
    assert "## Capacity on every objective: w" in text and "p99 TTFT ≤ 300 ms" in text  # base's p99 at load 1
    rate = one.runs[0].offered_rps
    # mine's p99 TTFT goes 200 → 400 ms as the rate doubles: 300 ms is met halfway
    assert f"| mine | {rate:.2f}, {2 * rate:.2f} | {1.5 * rate:.2f} |" in text
    assert report.capacity_tables([one]) == []  # one load: no capacity


def test_the_committed_page_is_what_its_result_files_say() -> None:
    """docs/benchmarks.md cannot drift from docs/benchmarks/results/ (regenerate, never hand-edit)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_report.py"), "--check"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_the_regression_check_flags_a_consistent_change_beyond_noise_and_tolerance() -> None:
    regress = _script("bench_regress")
    ref = _result([_seeded("llm", s, t) for s, t in [(0, 0.3), (1, 0.6), (2, 0.9)]])
    slower = _result([_seeded("llm", s, t * 1.3) for s, t in [(0, 0.3), (1, 0.6), (2, 0.9)]])
    rows = {r["figure"]: r for r in regress.regressions(ref, slower, 0.10)}
    assert rows["ttft_p99_ms"]["flag"] == "worse" and rows["ttft_p99_ms"]["relative"] == pytest.approx(0.3, rel=0.01)
    assert rows["hotspot"]["flag"] is None  # unchanged
    noisy = _result([_seeded("llm", s, t) for s, t in [(0, 0.45), (1, 0.5), (2, 1.0)]])  # +50 %, −17 %, +11 %
    assert regress.regressions(ref, noisy, 0.10)[1]["flag"] is None  # the differences straddle 0: noise
    tiny = _result([_seeded("llm", s, t * 1.05) for s, t in [(0, 0.3), (1, 0.6), (2, 0.9)]])
    assert all(r["flag"] is None for r in regress.regressions(ref, tiny, 0.10))  # consistent but under 10 %
    gone = _result([_seeded("other", 0, 0.3)])
    assert regress.regressions(ref, gone, 0.10)[0]["flag"] == "missing"


def test_a_clients_only_result_file_renders_the_clients_table_alone() -> None:
    report = _script("bench_report")
    result = _result([]).model_copy(update={"external": [
        {"policy": "llm-extproc", "client": "guidellm", "ok": 99, "ttft_p50_ms": 80.0, "ttft_p99_ms": 900.0,
         "tpot_p50_ms": 20.0, "tpot_p99_ms": 41.5, "output_tokens_per_s": 512.0, "rps": 1.5, "notes": "chat"},
    ]})  # fmt: skip
    text = "\n".join(report.steady_tables(result))
    assert "| llm-extproc | guidellm | 99 | 80 / 900 | 20.0 / 41.5 | 512 | 1.50 | chat |" in text
    assert "Runs:" not in text and "bootstrap" not in text


def test_capacity_on_both_objectives_from_result_files_at_several_loads() -> None:
    report = _script("bench_report")
    at_one = _result([_seeded("base", s, 0.5) for s in range(3)] + [_seeded("mine", s, 0.2) for s in range(3)], name="w")
    at_one.settings["load"] = "1"
    heavy = _result([_seeded("base", s, 2.0) for s in range(3)] + [_seeded("mine", s, 0.4) for s in range(3)], name="w-x2")
    heavy.settings["load"] = "2"
    heavy = heavy.model_copy(update={"runs": [r.model_copy(update={"offered_rps": 2.0}) for r in heavy.runs]})
    text = "\n".join(report.capacity_tables([at_one, heavy]))
    assert "## Capacity on every objective: w" in text and "p99 TTFT ≤ 500 ms" in text
    # base holds its own TTFT bound only at load 1 (1.05 req/s)
    assert "| base | 1.05, 2.00 | 1.05 | 2.00 | 1.05 | 1.00 |" in text
    # mine holds the TTFT bound at both loads, but its first tokens come early in the same E2E, so
    # its TPOT (80 ms) is over base's 50 ms even at load 1: no capacity on both, whatever TTFT says
    assert "| mine | 1.05, 2.00 | 2.00 | – | – | – |" in text
    assert report.capacity_tables([at_one]) == []  # one load: no capacity


def test_the_regression_check_without_a_reference_says_how_to_make_one(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_regress.py"), "--reference", str(tmp_path / "none.json")],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "make one with --update" in done.stderr
