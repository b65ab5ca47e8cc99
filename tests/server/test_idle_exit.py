"""SIGTERM to an idle `serve` (one process or `--workers 2`) and an idle `sim`: real processes
exit promptly, say "shutting down" once, and `--workers` with the in-memory rate limiter warns
that limits are per worker. (Draining a busy server is tests/e2e/test_restart.py's.)"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from extproc.stack.ports import free_port_run

IDLE_EXIT_S = 0.3
"""An idle process must be gone this soon after SIGTERM (seconds; 0.05–0.08 s measured, 0.5–1.5 s
before the final collection was skipped)."""

IDLE_GROUP_EXIT_S = 1.0
"""The same for `--workers 2`: three processes wind down on the same cores (0.17–0.5 s measured
on a loaded 2-core machine, 3.4 s reported before; the bound leaves CI room)."""

IDLE_AGENT_EXIT_S = 0.15
"""The node agent loads no tokenizer: 0.03–0.04 s measured, 0.22 s before its final collection
was skipped."""

MODEL = "Qwen/Qwen3-8B"


def _start(argv: list[str], ready: str, readies: int, env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """Start `argv` and return once `ready` appeared on its stdout `readies` times (every process
    prints its ready line once it listens). Raises AssertionError (the process killed) if it
    exits first or is not ready within 90 s: a silent, hung child must not block the test."""
    out = log.open("w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=out, text=True, env=env)
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read(stdout) -> None:  # type: ignore[no-untyped-def]
        for line in stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
    seen = 0
    deadline = time.monotonic() + 90
    try:
        while seen < readies:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"exited before ready: {log.read_text()}")
            seen += ready in line
    except queue.Empty:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"not ready after 90 s: {log.read_text()}") from None
    return proc


def _exit_time(proc: subprocess.Popen[str]) -> float:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return time.monotonic() - t0


def _best_exit_time(start, bound: float = IDLE_EXIT_S) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """The faster of two tries (a shared 2-core machine can stall any one), and the first log."""
    best, text = float("inf"), ""
    for attempt in range(2):
        proc, log = start(attempt)
        best = min(best, _exit_time(proc))
        text = text or log.read_text()
        if best < bound:
            break
    return best, text


def _serve(tmp_path: Path, workers: int, config: dict) -> tuple[float, str]:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))

    def start(attempt: int):  # type: ignore[no-untyped-def]
        grpc, admin = free_port_run(workers), free_port_run(workers)
        env = {**os.environ, "LLM_EXTPROC_GRPC_ADDRESS": f"127.0.0.1:{grpc}", "LLM_EXTPROC_ADMIN_ADDRESS": f"127.0.0.1:{admin}"}
        log = tmp_path / f"serve-{attempt}.log"
        argv = [sys.executable, "-m", "extproc", "serve", "--config", str(path), "--workers", str(workers)]
        return _start(argv, "llm-extproc serving ext_proc", workers, env, log), log

    return _best_exit_time(start, IDLE_EXIT_S if workers == 1 else IDLE_GROUP_EXIT_S)


BASE = {"models": [{"name": MODEL}], "endpoints": [{"address": "127.0.0.1:9", "models": [MODEL]}]}


def test_idle_serve_exits_promptly_and_says_so_once(tmp_path: Path):
    took, log = _serve(tmp_path, 1, BASE)
    assert took < IDLE_EXIT_S, f"{took:.2f} s\n{log}"
    assert log.count("shutting down: waiting for in-flight streams") == 1, log


def test_idle_workers_exit_promptly_and_warn_they_share_no_state(tmp_path: Path):
    config = {**BASE, "ratelimit": {"enabled": True, "backend": "memory", "default": {"requests_per_minute": 60}}}
    took, log = _serve(tmp_path, 2, config)
    assert took < IDLE_GROUP_EXIT_S, f"{took:.2f} s\n{log}"
    assert log.count("shutting down: waiting for in-flight streams") == 1, log
    warning = [line for line in log.splitlines() if "rate limits are per replica" in line]
    assert len(warning) == 1 and "WARNING" in warning[0], log  # the supervisor's, not each worker's
    assert "x 2" in warning[0] and "ratelimit.backend: redis" in warning[0]
    warning = [line for line in log.splitlines() if "with replicas.sync off" in line]
    assert len(warning) == 1 and "WARNING" in warning[0] and "one of 2 replicas (--workers 2)" in warning[0], log


@pytest.mark.parametrize("extra", [[], ["--kv-events-port", "0"]], ids=["plain", "kv-events"])
def test_idle_sim_exits_promptly(tmp_path: Path, extra: list[str]):
    def start(attempt: int):  # type: ignore[no-untyped-def]
        log = tmp_path / f"sim-{attempt}.log"
        argv = [sys.executable, "-m", "extproc", "sim", "--port", "0", *extra]
        return _start(argv, "sim listening on", 1, dict(os.environ), log), log

    took, log = _best_exit_time(start)
    assert took < IDLE_EXIT_S, f"{took:.2f} s\n{log}"


def test_idle_agent_exits_promptly(tmp_path: Path):
    def start(attempt: int):  # type: ignore[no-untyped-def]
        log = tmp_path / f"agent-{attempt}.log"
        argv = [sys.executable, "-m", "extproc", "agent", "--gpu-source", "none", "--engine-url", "none",
                "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0"]  # fmt: skip
        return _start(argv, "agent listening", 1, {**os.environ, "PYTHONUNBUFFERED": "1"}, log), log

    took, log = _best_exit_time(start, IDLE_AGENT_EXIT_S)
    assert took < IDLE_AGENT_EXIT_S, f"{took:.2f} s\n{log}"
