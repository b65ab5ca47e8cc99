"""`llm-extproc demo` end to end: the real stack in subprocesses, its JSON summary, Ctrl-C, busy ports.

Timings are not asserted (the machine is shared); what is: the summary's shape and counts, the
endpoints named, and that every child the command started is gone after it exits, by PID.
"""

from __future__ import annotations

import re
import signal
import socket
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from extproc.bench.results import Report
from extproc.cli import app
from extproc.stack.fleet import DEFAULT_FLEET
from tests.bench.stack_helpers import FLEET_1, Command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_smoke_writes_the_json_summary_and_leaves_no_process(tmp_path: Path) -> None:
    """Eight synthetic requests at 20× speed through the default fleet: all served, each
    by one of the four simulators, and the report says so in the shared shape."""
    args = ["demo", "--requests", "8", "--speed", "20", "--json", "out/demo.json", "--plot", "out/demo.png"]
    with Command(args, tmp_path) as cmd:
        rc = cmd.wait(timeout_s=150)
    # four simulators, llm-extproc and Envoy were started, and none is left
    cmd.assert_clean_exit(rc, 0, children_at_least=6)
    report = Report.model_validate(orjson.loads((tmp_path / "out/demo.json").read_bytes()))
    assert report.time_unit == "simulated"
    (run,) = report.runs
    assert run.policy == "llm-extproc" and run.trace == "synthetic"
    assert run.requests == 8 and run.successes == 8 and run.errors == {}
    assert run.ttft_ms.p50 is not None and run.e2e_ms.p99 is not None
    assert run.ttft_ms.p50 <= run.ttft_ms.p99 <= run.e2e_ms.p99  # type: ignore[operator]
    assert sum(run.endpoints.values()) == pytest.approx(1.0)
    assert 1 <= len(run.endpoints) <= len(DEFAULT_FLEET)
    for address in run.endpoints:  # the table labels each endpoint's share with its profile
        assert re.search(rf"share {re.escape(address)} \((h100|a100)-qwen3-8b\)", cmd.stdout), address
    assert (tmp_path / "out/demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("wait_for", "sig"),
    [("replaying", signal.SIGINT), ("starting", signal.SIGTERM)],
    ids=["sigint-while-replaying", "sigterm-while-starting"],
)
def test_signal_stops_every_child(tmp_path: Path, wait_for: str, sig: signal.Signals) -> None:
    """A signal mid-replay keeps what was measured (exit 130, partial JSON); one during start-up
    stops the children already running. Either way no child survives."""
    args = ["demo", "--fleet", FLEET_1, "--requests", "2000", "--rate", "20", "--speed", "2", "--json", "demo.json"]
    # while starting: once the simulator exists; while replaying: once all three children do
    started = 1 if wait_for == "starting" else 3
    with Command(args, tmp_path) as cmd:
        cmd.wait_for(wait_for, timeout_s=90, children_at_least=started)
        cmd.proc.send_signal(sig)
        rc = cmd.wait(timeout_s=60)
    cmd.assert_clean_exit(rc, 130, children_at_least=started)
    assert "every process started was stopped" in cmd.stdout
    if wait_for == "replaying":
        (run,) = Report.model_validate(orjson.loads((tmp_path / "demo.json").read_bytes())).runs
        assert 0 < run.requests < 2000
        # No --plot, no PNG: the working directory got an llm-extproc-demo.png from every demo.
        assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".png") == []
    else:
        assert not (tmp_path / "demo.json").exists()


def test_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = CliRunner().invoke(app, ["demo", "--port", str(port), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert f"port {port} on 127.0.0.1 is already in use" in " ".join(result.output.split())
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "nginx"], "unknown policy 'nginx'"),
        (["--fleet", "h100-qwen3-8b,tpu-giant"], "unknown simulator profile"),
        (["--fleet", "h100-qwen3-8b,h100-llama-3.1-8b"], "every endpoint must serve the same model"),
        (["--trace", "no/such/trace.csv"], "cannot read"),
        (["--rate-scale", "0"], "rate-scale must be a positive number"),
    ],
    ids=["unknown-policy", "unknown-profile", "mixed-models", "missing-trace", "zero-rate-scale"],
)
def test_bad_options_exit_2_before_starting_anything(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["demo", *args, "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
