"""Multi-tenant bench: the tenants spec, each tenant's workload, retries, per-tenant accounting,
and one short run through the real stack (`bench --tenants`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.bench.loadgen import RequestResult, RetryPolicy, RunRecord, parse_retry_after
from extproc.bench.results import SLO
from extproc.bench.runner import fleet_prefill_capacity
from extproc.bench.tenant_results import summarize_tenant, tenant_report
from extproc.bench.traces import load_trace
from extproc.bench.tenants import TenantSpecError, capacity_rps, parse_tenants, ratelimit_overrides, tenant_workload
from extproc.config.loader import config_from_mapping
from extproc.bench.stacks import merge_config, server_config
from extproc.ratelimit.config import RateLimitConfig
from extproc.ratelimit.tenant import TenantResolver, key_digest
from tests.bench.stack_helpers import FLEET_1, Command

FLEET = ("a100-qwen3-8b",)


def _spec(*tenants: dict, **top) -> dict:  # type: ignore[type-arg]
    return {"tenants": list(tenants), **top}


# ── the spec ────────────────────────────────────────────────────────────────────────────────
def test_parse_reads_every_field_and_defaults() -> None:
    spec = parse_tenants(_spec(
        {"name": "steady", "load": 0.3},
        {"name": "flood", "rate": 40, "arrival": "constant", "retry": "immediate", "api_key": "k-1",
         "limits": {"max_concurrent_requests": 8}},
        {"name": "polite", "rate": 5, "retry": "retry-after", "max_attempts": 3, "retry_wait_s": 0.5},
        duration_s=12, extproc_config={"admission": {"priority": {"shed_standard_at": 2.0}}},
    ))  # fmt: skip
    steady, flood, polite = spec.tenants
    assert spec.duration_s == 12 and spec.extproc_config == {"admission": {"priority": {"shed_standard_at": 2.0}}}
    assert (steady.load, steady.rate, steady.arrival, steady.workload, steady.key) == (0.3, None, "poisson", "synthetic", "bench-steady")
    assert steady.retry == RetryPolicy("never", 1, 1.0)
    assert (flood.rate, flood.arrival, flood.key, flood.retry.mode, flood.retry.max_attempts) == (40, "constant", "k-1", "immediate", 5)
    assert flood.limits == {"max_concurrent_requests": 8}
    assert polite.retry == RetryPolicy("retry-after", 3, 0.5)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "must be a mapping"),
        ({"tenants": []}, "non-empty list"),
        ({"tenants": [{"name": "a", "rate": 1}], "duration": 3}, "unknown key(s) duration"),
        (_spec({"name": "a", "rate": 1, "burst": 2}), "unknown key(s) burst"),
        (_spec({"name": "A b", "rate": 1}), "name must be lower-case"),
        (_spec({"name": "a"}), "exactly one of rate"),
        (_spec({"name": "a", "rate": 1, "load": 1}), "exactly one of rate"),
        (_spec({"name": "a", "rate": 0}), "rate must be > 0"),
        (_spec({"name": "a", "load": float("nan")}), "load must be a number"),
        (_spec({"name": "a", "rate": True}), "rate must be a number"),
        (_spec({"name": "a", "rate": 1, "arrival": "bursty"}), "arrival must be one of"),
        (_spec({"name": "a", "rate": 1, "arrival": "trace"}), "needs a trace file"),
        (_spec({"name": "a", "rate": 1, "retry": "sometimes"}), "retry mode must be"),
        (_spec({"name": "a", "rate": 1, "retry": "immediate", "max_attempts": 0}), "max_attempts must be >= 1"),
        (_spec({"name": "a", "rate": 1, "limits": {"api_key_sha256": ["x"]}}), "no api_key_sha256"),
        (_spec({"name": "a", "rate": 1, "api_key": "two words"}), "without spaces"),
        (_spec({"name": "a", "rate": 1}, {"name": "a", "rate": 2}), "share a name: a"),
        (_spec({"name": "a", "rate": 1, "api_key": "same"}, {"name": "b", "rate": 2, "api_key": "same"}), "tenants a, b share an api_key"),
        (_spec({"name": "a", "rate": 1}, duration_s=-1), "duration_s must be > 0"),
    ],
)
def test_parse_refuses_bad_specs_by_name(raw: object, message: str) -> None:
    with pytest.raises(TenantSpecError) as err:
        parse_tenants(raw)
    assert message in str(err.value)
    assert "same" not in str(err.value)  # a key is never echoed


def test_the_generated_ratelimit_section_names_each_tenant_by_its_key_digest() -> None:
    spec = parse_tenants(_spec({"name": "steady", "rate": 1}, {"name": "flood", "rate": 9, "api_key": "f-key", "limits": {"requests_per_minute": 5}}))
    overrides = ratelimit_overrides(spec)
    cfg = config_from_mapping(merge_config(server_config({"127.0.0.1:8000": FLEET[0]}, profile="load-aware"), overrides))
    assert cfg.ratelimit.tenants["flood"].requests_per_minute == 5
    resolver = TenantResolver(RateLimitConfig.model_validate(overrides["ratelimit"]))
    assert resolver.resolve({"authorization": "Bearer f-key"}).id == "flood"
    assert resolver.resolve({"authorization": "Bearer bench-steady"}).id == "steady"
    assert "f-key" not in json.dumps(overrides) and key_digest("f-key") in json.dumps(overrides)


# ── each tenant's workload ──────────────────────────────────────────────────────────────────
def test_load_is_a_multiple_of_the_fleets_capacity_for_the_tenants_requests() -> None:
    spec = parse_tenants(_spec({"name": "a", "load": 0.5, "arrival": "constant"}))
    workload, rate = tenant_workload(spec.tenants[0], 0, 20.0, FLEET)
    assert rate == pytest.approx(0.5 * capacity_rps(workload.requests, FLEET), rel=0.1)
    mean = sum(r.input_tokens + r.output_tokens for r in workload.requests) / len(workload.requests)
    assert 0.5 * fleet_prefill_capacity(FLEET) / mean == pytest.approx(rate, rel=0.1)
    assert len(workload.requests) == int(rate * 20) + 1
    gaps = {round(b.arrival_s - a.arrival_s, 9) for a, b in zip(workload.requests, workload.requests[1:])}
    assert gaps == {round(1 / rate, 9)}


def test_poisson_arrivals_meet_the_rate_and_seeds_differ() -> None:
    tenant = parse_tenants(_spec({"name": "a", "rate": 20})).tenants[0]
    one, _ = tenant_workload(tenant, 0, 50.0, FLEET, seed=1)
    again, _ = tenant_workload(tenant, 0, 50.0, FLEET, seed=1)
    other, _ = tenant_workload(tenant, 0, 50.0, FLEET, seed=2)
    assert one.requests == again.requests and one.requests != other.requests
    assert len(one.requests) == 1001
    assert one.requests[-1].arrival_s == pytest.approx(50.0, rel=0.1)


def test_tenants_share_no_prefix_blocks_or_sessions() -> None:
    spec = parse_tenants(_spec({"name": "a", "rate": 20, "seed": 0}, {"name": "b", "rate": 20, "seed": 0}))
    a, _ = tenant_workload(spec.tenants[0], 0, 20.0, FLEET)
    b, _ = tenant_workload(spec.tenants[1], 1, 20.0, FLEET)
    assert [r.input_tokens for r in a.requests] == [r.input_tokens for r in b.requests]  # same draw...
    blocks_a = {x for r in a.requests for x in r.prefix_blocks or ()}
    blocks_b = {x for r in b.requests for x in r.prefix_blocks or ()}
    assert blocks_a and blocks_b and not blocks_a & blocks_b  # ...yet nothing shared
    sessions = {r.session for r in a.requests if r.session}
    assert sessions and all(s.startswith("a/") for s in sessions)


def test_a_trace_slice_keeps_its_own_gaps_rescaled(traces_dir: Path) -> None:
    path = traces_dir / "mooncake.jsonl"
    spec = parse_tenants(_spec({"name": "t", "rate": 1.5, "arrival": "trace", "workload": str(path)}, duration_s=2))
    workload, rate = tenant_workload(spec.tenants[0], 0, 2.0, FLEET)
    assert rate == 1.5 and len(workload.requests) == 4
    assert workload.requests[-1].arrival_s == pytest.approx(2.0)  # 3 gaps at a mean of 1 / 1.5 s
    original = [r.arrival_s for r in load_trace(path).requests]
    ratio = (original[-1] - original[0]) / 2.0
    assert [r.arrival_s * ratio for r in workload.requests] == pytest.approx([t - original[0] for t in original])
    too_long = parse_tenants(_spec({"name": "t", "rate": 50.0, "workload": str(path)}, duration_s=60))
    with pytest.raises(TenantSpecError, match="needs 3,001 requests"):
        tenant_workload(too_long.tenants[0], 0, 60.0, FLEET)


# ── retries ─────────────────────────────────────────────────────────────────────────────────
def _result(index: int, *, status: int | None = 200, attempt: int = 0, waited: float = 0.0, ttft: float | None = 0.1,
            e2e: float | None = 1.1, out: int | None = 101, prompt: int | None = 50, lag: float = 0.0,
            retry_after: float | None = None, sent: float = 0.0, done: float = 1.0) -> RequestResult:  # fmt: skip
    ok = status == 200
    return RequestResult(
        index=index, scheduled_s=0.0, lag_s=lag, input_tokens=40, max_tokens=out or 1, status=status,
        error=None if ok else f"{status} rate_limit_exceeded", ttft_s=ttft if ok else None, e2e_s=e2e if ok else None,
        output_tokens=out if ok else None, prompt_tokens=prompt if ok else None, attempt=attempt, waited_s=waited,
        retry_after_s=retry_after, sent_wall_s=sent, done_wall_s=done,
    )  # fmt: skip


def test_retry_policy_waits_as_its_mode_says_and_gives_up() -> None:
    refused = _result(0, status=429, retry_after=2.0)
    assert RetryPolicy().wait_s(refused, 1) is None
    assert RetryPolicy("immediate", 3).wait_s(refused, 1) == 0.0
    assert RetryPolicy("immediate", 3).wait_s(refused, 3) is None
    assert RetryPolicy("retry-after", 3).wait_s(refused, 1) == 2.0
    assert RetryPolicy("retry-after", 3, default_wait_s=0.5).wait_s(_result(0, status=503), 1) == 0.5
    assert RetryPolicy("retry-after", 3, give_up_after_s=1.5).wait_s(refused, 1) is None
    assert RetryPolicy("immediate", 3).wait_s(_result(0, status=500), 1) is None
    assert RetryPolicy("immediate", 3).wait_s(_result(0), 1) is None
    assert [parse_retry_after(v) for v in (None, "3", " 0.5 ", "-1", "inf", "Wed, 21 Oct 2015 07:28:00 GMT", "99999")] == [
        None, 3.0, 0.5, None, None, None, 3600.0,
    ]


# ── per-tenant accounting ───────────────────────────────────────────────────────────────────
def test_a_tenants_attempts_add_up_to_requests_outcomes_and_work() -> None:
    results = [
        _result(0),                                               # ok at once
        _result(1, status=429), _result(1, attempt=1, waited=0.5),  # refused, then ok: TTFT counts the wait
        _result(2, status=429), _result(2, status=503, attempt=1),   # gave up
        _result(3, ttft=3.0, e2e=4.0),                            # ok, misses the TTFT SLO
        _result(4, ttft=0.1, e2e=21.1, lag=0.2),                   # ok, misses TPOT (0.21 s/token), sent late
    ]
    s = summarize_tenant("t", results, offered_rps=2.0, duration_s=10.0, slo=SLO(ttft_ms=2000, itl_ms=100))
    assert (s.requests, s.sent, s.ok, s.refused_429, s.refused_503, s.gave_up) == (5, 7, 4, 2, 1, 1)
    assert s.other_errors == {}
    assert s.goodput_rps == pytest.approx(2 / 10.0)
    assert s.completed_tokens == 4 * (50 + 101)
    assert s.completed_tokens_per_s == pytest.approx(4 * 151 / 10.0)
    assert s.ttft_ms.p50 == pytest.approx(350.0)  # 100, 100, 600 (waited 500 + 100), 3000
    assert s.tpot_ms.p50 == pytest.approx(10.0)
    assert s.behind_schedule_fraction == pytest.approx(1 / 5)  # first attempts only


def test_the_report_spans_every_tenant_on_one_clock() -> None:
    a = RunRecord([_result(0, sent=0.0, done=1.0)], "simulated", 2.0, 1.0, 1)
    b = RunRecord([_result(0, sent=0.5, done=3.0), _result(1, status=429, sent=0.6, done=0.7)], "simulated", 2.0, 2.5, 2)
    report = tenant_report([("a", 1.0, a), ("b", 3.0, b)], SLO())
    assert report.duration_s == pytest.approx(6.0)  # 0 → 3 wall seconds at ×2
    assert [t.tenant for t in report.tenants] == ["a", "b"]
    assert report.tenants[1].refused_429 == 1 and report.tenants[1].offered_rps == 3.0
    # the last first send was at 0.6 s: a's request (ended at 1.0) came after it, as did b's
    assert [t.completed_tokens_while_sending for t in report.tenants] == [0, 0]
    early = RunRecord([_result(0, sent=0.0, done=0.5), _result(1, sent=0.7, done=2.0)], "simulated", 2.0, 2.0, 2)
    shares = tenant_report([("a", 1.0, early), ("b", 3.0, b)], SLO())
    assert [t.completed_tokens_while_sending for t in shares.tenants] == [151, 0]
    assert [t.completed_tokens for t in shares.tenants] == [302, 151]
    with pytest.raises(ValueError, match="different clocks"):
        tenant_report([("a", 1.0, a), ("b", 1.0, RunRecord([], "simulated", 1.0, 0.0, 0))], SLO())


# ── through the stack ───────────────────────────────────────────────────────────────────────
@pytest.mark.e2e
@pytest.mark.slow
def test_bench_tenants_through_the_stack_reports_each_tenant(tmp_path: Path) -> None:
    """A steady tenant, and a flooder capped at 6 requests a minute that resends refusals at once:
    the rate limiter tells them apart by API key, the flooder's refusals are counted per attempt."""
    (tmp_path / "tenants.yaml").write_text(
        "duration_s: 3\n"
        "tenants:\n"
        "  - {name: steady, rate: 3, arrival: constant}\n"
        "  - {name: flood, rate: 8, arrival: constant, retry: immediate, max_attempts: 3,"
        " limits: {requests_per_minute: 6}}\n"
    )
    args = ["bench", "--tenants", "tenants.yaml", "--fleet", FLEET_1, "--speed", "10", "--json", "out.json"]
    with Command(args, tmp_path) as cmd:
        assert cmd.wait(timeout_s=90) == 0, cmd.stdout + cmd.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    steady, flood = report["tenants"]
    assert (steady["tenant"], steady["requests"], steady["ok"], steady["sent"]) == ("steady", 10, 10, 10)
    assert steady["refused_429"] == 0 and steady["ttft_ms"]["p50"] > 0 and steady["completed_tokens"] > 0
    assert flood["requests"] == 25 and flood["ok"] == 6
    assert flood["refused_429"] == flood["sent"] - 6 and flood["sent"] == 6 + 19 * 3  # 19 refused, sent 3 times each
    assert flood["gave_up"] == 19
    assert report["speed"] == 10 and report["time_unit"] == "simulated"
    assert "bench-flood" not in (tmp_path / "out.json").read_text()
