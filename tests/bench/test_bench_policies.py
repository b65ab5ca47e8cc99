"""The policy catalogue: names, parsing, peer availability, and its copy of the server's profiles."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from extproc.bench.cli import DEFAULT_FLEET_SPEC
from extproc.bench.policies import DEFAULT_PROFILE, EXTPROC_PROFILES, POLICIES, PolicyError, parse_policies
from extproc.cli import app
from extproc.config.schema import BUILTIN_PROFILES, SchedulingConfig
from extproc.stack.fleet import DEFAULT_FLEET


def test_profiles_match_the_server_schema() -> None:
    """The catalogue spells the built-in profiles out (to keep --help fast): it must not drift."""
    # pd-decode and pd-prefill are the two picks of P/D disaggregation, not a policy of their own.
    assert set(EXTPROC_PROFILES) == set(BUILTIN_PROFILES) - {"pd-decode", "pd-prefill"}
    assert DEFAULT_PROFILE == SchedulingConfig().profile
    assert DEFAULT_FLEET_SPEC == ",".join(DEFAULT_FLEET)


def test_every_required_policy_exists_with_its_front() -> None:
    kinds = {name: (p.kind, p.envoy_lb_policy or p.profile or p.peer_policy) for name, p in POLICIES.items()}
    assert kinds == {
        "envoy-round-robin": ("envoy", "ROUND_ROBIN"),
        "envoy-least-request": ("envoy", "LEAST_REQUEST"),
        "llm-extproc": ("extproc", "load-aware"),
        **{f"llm-extproc-{p}": ("extproc", p) for p in EXTPROC_PROFILES},
        "llm-extproc-precise": ("extproc", "load-aware"),
        "llm-extproc-noprefix": ("extproc", "load-aware"),
        "llm-extproc-lora-activity": ("extproc", "lora"),
        "sglang-cache-aware": ("peer", "cache_aware"),
        "sglang-power-of-two": ("peer", "power_of_two"),
        "vllm-router-cache-aware": ("peer", "cache_aware"),
        "vllm-router-kv-aware": ("peer", "kv_aware"),
        "vllm-router-consistent-hash": ("peer", "consistent_hash"),
    }
    assert POLICIES["llm-extproc-noprefix"].server_overrides == {"scheduling": {"prefix": {"enabled": False}}}
    assert {p.peer_package for p in POLICIES.values() if p.kind == "peer"} == {"sglang-router", "vllm-router"}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("llm-extproc", ["llm-extproc"]),
        (" envoy-least-request , llm-extproc-random ", ["envoy-least-request", "llm-extproc-random"]),
        ("llm-extproc,llm-extproc", ["llm-extproc"]),
        (["envoy-round-robin", "all"], list(POLICIES)),
    ],
    ids=["one", "spaces", "duplicate", "all-after-one-keeps-order"],
)
def test_parse_policies(spec: str | list[str], expected: list[str]) -> None:
    assert [p.name for p in parse_policies(spec)] == expected


@pytest.mark.parametrize("spec", ["", " , ", "envoy-maglev"], ids=["empty", "only-commas", "unknown"])
def test_parse_policies_rejects_with_the_known_names(spec: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policies(spec)
    assert "envoy-least-request" in str(info.value) and "vllm-router-kv-aware" in str(info.value)


def test_only_peers_can_be_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name, *a))
    assert "sglang-router is not installed" in (POLICIES["sglang-cache-aware"].unavailable() or "")
    assert POLICIES["envoy-least-request"].unavailable() is None and POLICIES["llm-extproc"].unavailable() is None


def test_bench_help_lists_every_policy() -> None:
    result = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0
    flat = " ".join(result.output.split())
    for name in POLICIES:
        assert name in flat


@pytest.mark.parametrize("timeout", ["inf", "nan"])
def test_bench_refuses_a_request_timeout_that_is_not_finite(timeout: str) -> None:
    """`--request-timeout inf` (and nan) passed the `<= 0` check; every request then failed in
    aiohttp, which cannot round an infinite deadline. Refused before anything starts."""
    result = CliRunner().invoke(app, ["bench", "--policies", "llm-extproc", "--requests", "3", "--request-timeout", timeout])
    assert result.exit_code == 2, result.output
    assert f"--request-timeout must be a finite number > 0, got {float(timeout)}" in result.output


def test_lora_activity_policy_differs_from_the_lora_profile_only_in_its_lora_scorer():
    from extproc.bench.policies import POLICIES

    policy = POLICIES["llm-extproc-lora-activity"]
    scorers = policy.server_overrides["scheduling"]["profiles"]["lora"]["scorers"]
    builtin = [(s.type, s.weight) for s in BUILTIN_PROFILES["lora"].scorers]
    assert [(s["type"], s["weight"]) for s in scorers] == [
        ("lora-activity-scorer" if t == "lora-affinity-scorer" else t, w) for t, w in builtin
    ]


def test_up_hints_at_the_lora_profile_when_the_lora_fleet_runs_adapter_blind() -> None:
    from extproc.bench.cli import _common, _fleet_hint

    hints = {}
    for name in ("llm-extproc", "llm-extproc-lora", "llm-extproc-lora-activity", "envoy-least-request"):
        policies, settings = _common(policy_names=name, fleet="lora", speed=1.0, stream_interval=1, seed=0, port=0)
        hints[name] = _fleet_hint(policies[0], settings)
    assert "--policy llm-extproc-lora" in hints["llm-extproc"]
    assert hints["llm-extproc-lora"] is None and hints["llm-extproc-lora-activity"] is None
    assert hints["envoy-least-request"] is None  # Envoy alone has no profile to choose
    policies, settings = _common(policy_names="llm-extproc", fleet="h100-qwen3-8b", speed=1.0, stream_interval=1, seed=0, port=0)
    assert _fleet_hint(policies[0], settings) is None
