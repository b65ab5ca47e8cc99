"""`llm-extproc sim` as a subprocess: ready line, serving, clean exit on SIGTERM/SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from typer.testing import CliRunner

from extproc.cli import app
from extproc.sim.profiles import PROFILES

READY = re.compile(r"^sim listening on (http://127\.0\.0\.1:(\d+)) profile=(\S+) model=(\S+)$")


def test_help_lists_the_profiles() -> None:
    result = CliRunner().invoke(app, ["sim", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0
    flat = " ".join(result.output.split())
    for name in ("h100-qwen3-8b", "a100-llama-3.1-8b", "h100-llama-3.1-70b-tp4", "h100-qwen3-32b-tp2"):
        assert name in flat and name in PROFILES


def test_unknown_profile_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["sim", "--profile", "tpu-giant"])
    assert result.exit_code == 2 and "unknown profile 'tpu-giant'" in result.output


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_subprocess_prints_ready_line_serves_and_exits_cleanly(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc", "sim", "--port", "0", "--speed", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        match = READY.match(line)
        assert match, line
        url, _, profile, model = match.groups()
        assert profile == "h100-qwen3-8b" and model == "Qwen/Qwen3-8B"
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            assert resp.status == 200 and resp.headers["x-sim-speed"] == "50.0"
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sim", "--port", "99999"], "65535"),
        (["sim", "--num-gpu-blocks", "0"], "greater than or equal to 1"),  # was taken as "the default"
        (["sim", "--speed", "nan"], "finite number > 0"),  # started, then hung every request
        (["serve", "--log-level", "bogus"], "--log-level must be one of debug, info, warning, error, critical"),
        (["agent", "--log-level", "loud", "--gpu-source", "none"], "--log-level must be one of"),
    ],
    ids=["sim-port-out-of-range", "sim-zero-kv-blocks", "sim-nan-speed", "serve-bad-log-level", "agent-bad-log-level"],
)
def test_bad_options_exit_2_with_a_message_not_a_traceback(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
