"""`llm-extproc sim` as a subprocess: ready line, serving, clean exit on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from typing import Any

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
    assert result.exit_code == 2 and "--profile names an unknown profile 'tpu-giant'" in result.output


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
        (["sim", "--tokenizer", "/nonexistent/tok"], "--tokenizer: tokenizer '/nonexistent/tok': no tokenizer.json"),
        (["serve", "--log-level", "bogus"], "--log-level must be one of debug, info, warning, error, critical"),
        (["agent", "--log-level", "loud", "--gpu-source", "none"], "--log-level must be one of"),
    ],
    ids=["sim-port-out-of-range", "sim-zero-kv-blocks", "sim-nan-speed", "sim-missing-tokenizer", "serve-bad-log-level", "agent-bad-log-level"],
)
def test_bad_options_exit_2_with_a_message_not_a_traceback(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        # accepted: a pool sized for twice the GPU's memory
        ("--gpu-memory-utilization", "2", "must be a fraction in (0, 1], got 2.0"),
        ("--gpu-memory-utilization", "0", "must be a fraction in (0, 1], got 0.0"),  # was the profile's error, no option named
        ("--gpu-memory-utilization", "nan", "must be a fraction in (0, 1], got nan"),  # was 'cannot convert float NaN to integer'
        ("--speed", "1e308", "≤ 1e+06, got 1e+308"),  # the simulated clock overflowed; requests after it hung
        ("--num-gpu-blocks", "99999999999999", "must be ≤ 4194304"),  # exhausted memory at start
        ("--block-size", "99999999999", "must be at most the KV pool's"),  # was 'num_gpu_blocks must be positive, got 0'
        ("--model", "", "must be a model name"),  # was the profile's model
        ("--host", "", "must be an address to listen on"),
        ("--kv-events-replay-endpoint", "tcp://127.0.0.1:1", "needs --kv-events-endpoint or --kv-events-port"),
        # pydantic's four-line dump with a URL, naming error_rate, not the option:
        ("--fault-error-rate", "2", "must be less than or equal to 1, got 2.0"),
        ("--fault-error-rate", "nan", "must be a finite number, got nan"),  # was 'less than or equal to 1'
        ("--fault-die-after-chunks", "-1", "must be greater than or equal to 0, got -1"),
        ("--fault-jitter-ms", "inf", "must be a finite number, got inf"),  # accepted: every stream hung
        ("--fault-jitter-ms", "1e308", "must be less than or equal to 60000"),  # accepted: every stream hung
    ],
)
def test_a_bad_sim_option_is_one_line_naming_the_option(option: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def started(coro: Any) -> None:  # an accepted value would serve until killed: fail instead
        coro.close()
        raise AssertionError(f"sim started with {option} {value!r}")

    monkeypatch.setattr(asyncio, "run", started)
    result = CliRunner().invoke(app, ["sim", option, value])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option} ") and message in lines[0], result.output


def test_num_gpu_blocks_and_gpu_memory_utilization_are_not_given_together() -> None:
    """With --num-gpu-blocks the fraction sized nothing and was silently ignored."""
    from extproc.sim.server import SimOptionError, SimServer

    result = CliRunner().invoke(app, ["sim", "--gpu-memory-utilization", "0.5", "--num-gpu-blocks", "1000"])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "error: --gpu-memory-utilization sizes the KV pool, which --num-gpu-blocks (1000) already sets: give one, not both"
    with pytest.raises(SimOptionError, match="which num_gpu_blocks"):
        SimServer(num_gpu_blocks=1000, gpu_memory_utilization=0.5)
    assert SimServer(num_gpu_blocks=1000).config.num_gpu_blocks == 1000


def test_the_sim_server_and_fault_updates_refuse_the_same_values_without_the_cli() -> None:
    from extproc.sim.faults import parse_fault_update
    from extproc.sim.server import SimOptionError, SimServer

    with pytest.raises(SimOptionError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]") as info:
        SimServer(gpu_memory_utilization=1.5)
    assert info.value.option == "gpu_memory_utilization"
    with pytest.raises(ValueError, match="jitter_ms: Input should be less than or equal to 60000"):
        parse_fault_update({"jitter_ms": 1e308})  # POST /sim/faults
