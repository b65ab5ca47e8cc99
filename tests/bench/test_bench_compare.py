"""`llm-extproc bench` end to end: two policies on the same requests, table, JSON, plots, no leftovers."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from extproc.bench.results import Report
from tests.bench.stack_helpers import FLEET_1, Command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_two_policies_table_json_and_plot(tmp_path: Path) -> None:
    """Six synthetic requests through Envoy alone and through Envoy + llm-extproc: two runs, each
    on a fresh one-simulator fleet, every request served, on the same requests."""
    args = [
        "bench", "--policies", "envoy-least-request,llm-extproc", "--requests", "6", "--rate-scale", "1",
        "--speed", "10", "--fleet", FLEET_1, "--json", "bench.json", "--plot", "bench.png", "--requests-out", "requests.jsonl",
    ]  # fmt: skip
    with Command(args, tmp_path) as cmd:
        rc = cmd.wait(timeout_s=150)
    # a simulator + Envoy, then a simulator + llm-extproc + Envoy: none left
    cmd.assert_clean_exit(rc, 0, children_at_least=5)
    report = Report.model_validate(orjson.loads((tmp_path / "bench.json").read_bytes()))
    assert report.time_unit == "simulated"
    assert [(r.policy, r.trace) for r in report.runs] == [("envoy-least-request", "synthetic"), ("llm-extproc", "synthetic")]
    for run in report.runs:
        assert run.requests == 6 and run.successes == 6, run
        assert sum(run.endpoints.values()) == pytest.approx(1.0)
        assert run.goodput_rps is not None and run.ttft_ms.p99 is not None
    # the same requests at the same times for both policies
    assert report.runs[0].offered_rps == pytest.approx(report.runs[1].offered_rps)
    out = " ".join(cmd.stdout.split())
    assert "envoy-least-request" in out and "llm-extproc" in out and "goodput" in out
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "bench-goodput.png").exists()  # one load: no goodput-vs-load figure
    rows = [orjson.loads(line) for line in (tmp_path / "requests.jsonl").read_bytes().splitlines()]
    assert [(r["policy"], r["index"]) for r in rows] == [(p, i) for p in ("envoy-least-request", "llm-extproc") for i in range(6)]
    assert all(r["status"] == 200 and r["endpoint"] and r["ttft_ms"] > 0 for r in rows), rows


def test_a_peer_that_is_not_installed_is_skipped_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a missing peer asked for: nothing runs, the note says which wheel is missing, exit 1."""
    import importlib.util

    from typer.testing import CliRunner

    from extproc.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm_router" else real(name, *a))
    result = CliRunner().invoke(app, ["bench", "--policies", "vllm-router-kv-aware", "--requests", "3", "--rate-scale", "1"])
    assert result.exit_code == 1, result.output
    out = " ".join(result.output.split())
    assert "vllm-router-kv-aware: skipped, vllm-router is not installed (pip install 'llm-extproc[bench]')" in out
    assert "nothing ran" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("scheduling: [unclosed", "--extproc-config: cannot read"),
        ("- a list", "must hold a YAML mapping"),
        ("scheduling:\n  profiles:\n    load-aware:\n      scorers: [{type: no-such-scorer}]\n", "no-such-scorer"),
        ("scheduling:\n  profile: missing\n", "missing"),
        ("endpoints: [{address: '10.0.0.1:8000', models: [m]}]\n", "sets endpoints, which the stack owns"),
        ("admin: {enabled: false}\n", "sets admin, which the stack owns"),
        # The refusal lists every key an overlay may set (it named four of ten, models not among them).
        ("listen: {grpc: '127.0.0.1:1'}\n", "may set admission, decision_log, discovery, flow_control, limits, models, protocol, ratelimit, replicas, scheduling, telemetry"),
        ("models: [{name: other/model}]\n", "'other/model' is not served by the fleet; its models: Qwen/Qwen3-8B"),
        ("# " + "x" * (1 << 20) + "\n", "is larger than"),
    ],
    ids=["bad-yaml", "not-a-mapping", "unknown-scorer", "unknown-profile", "endpoints", "admin", "listen", "unserved-model", "huge"],
)
def test_bad_extproc_config_exits_2_before_starting_anything(tmp_path: Path, text: str, message: str) -> None:
    from typer.testing import CliRunner

    from extproc.cli import app

    path = tmp_path / "override.yaml"
    path.write_text(text)
    result = CliRunner().invoke(
        app, ["bench", "--policies", "llm-extproc", "--requests", "3", "--rate-scale", "1", "--extproc-config", str(path)]
    )
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


@pytest.mark.parametrize("command", [["up", "--port", "0"], ["demo", "--requests", "3"]], ids=["up", "demo"])
def test_up_and_demo_take_the_same_extproc_config(tmp_path: Path, command: list[str]) -> None:
    """`up` and `demo` read `--extproc-config` with the same checks (a bad one exits 2 before
    anything starts)."""
    from typer.testing import CliRunner

    from extproc.cli import app

    path = tmp_path / "override.yaml"
    path.write_text("scheduling:\n  profiles:\n    load-aware:\n      scorers: [{type: no-such-scorer}]\n")
    result = CliRunner().invoke(app, [*command, "--extproc-config", str(path)])
    assert result.exit_code == 2, result.output
    assert "no-such-scorer" in " ".join(result.output.split())


def test_extproc_config_reaches_the_server(tmp_path: Path) -> None:
    """The override is what the llm-extproc policies run with: a 1 KiB body limit makes the
    server itself refuse the synthetic requests longer than that (most are) with its 413."""
    (tmp_path / "override.yaml").write_text("limits:\n  max_body_bytes: 1024\n")
    args = [
        "bench", "--policies", "llm-extproc", "--requests", "3", "--rate-scale", "1", "--speed", "10",
        "--fleet", FLEET_1, "--json", "bench.json", "--extproc-config", "override.yaml",
    ]  # fmt: skip
    with Command(args, tmp_path) as cmd:
        rc = cmd.wait(timeout_s=120)
    cmd.assert_clean_exit(rc, 0, children_at_least=3)
    report = Report.model_validate(orjson.loads((tmp_path / "bench.json").read_bytes()))
    assert report.settings is not None and report.settings["extproc_config"] == {"limits": {"max_body_bytes": 1024}}
    assert report.settings["speed"] == 10 and report.settings["rate_scales"] == [1.0]
    (run,) = report.runs
    assert "override.yaml laid over llm-extproc's config" in " ".join(cmd.stdout.split())
    assert set(run.errors) == {"413 request_too_large"} and run.errors["413 request_too_large"] >= 2, run.errors
