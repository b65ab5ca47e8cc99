"""ManagedProcess: own session, stop by PID with a bounded wait, errors carry the log tail."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from extproc.stack.ports import free_port, free_ports
from extproc.stack.procs import ManagedProcess, ProcessError, wait_until

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
# Ignores SIGTERM, so only the SIGKILL escalation can stop it.
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)",
]


async def _printed_up(proc: ManagedProcess) -> None:
    async def up() -> bool:
        return "up" in proc.log_tail()

    await wait_until(up, proc=proc, what="printed up", timeout_s=20)


async def test_child_runs_in_its_own_session_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc = ManagedProcess(SLEEPER, name="sleeper", log_path=tmp_path / "sleeper.log")
    pid = proc.spawn()
    try:
        await _printed_up(proc)
        assert os.getsid(pid) == pid != os.getsid(0)
    finally:
        rc = await proc.astop(timeout_s=10)
    assert rc == -signal.SIGTERM
    assert not proc.running
    assert proc.stop() == rc  # idempotent


async def test_sigterm_ignored_escalates_to_sigkill_after_the_wait(tmp_path: Path) -> None:
    proc = ManagedProcess(STUBBORN, name="stubborn", log_path=tmp_path / "stubborn.log")
    proc.spawn()
    await _printed_up(proc)
    t0 = time.monotonic()
    assert await proc.astop(timeout_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10


async def test_wait_until_reports_early_exit_with_the_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('bad config: key x', flush=True); sys.exit(3)"]
    proc = ManagedProcess(argv, name="crasher", log_path=tmp_path / "crasher.log")
    proc.spawn()

    async def never() -> bool:
        return False

    with pytest.raises(ProcessError, match=r"(?s)crasher: exited before ready \(exited with 3\).*bad config: key x"):
        await wait_until(never, proc=proc, what="ready", timeout_s=30)
    proc.stop()


async def test_wait_until_times_out(tmp_path: Path) -> None:
    proc = ManagedProcess(SLEEPER, name="sleeper", log_path=tmp_path / "s.log")
    proc.spawn()

    async def never() -> bool:
        return False

    try:
        with pytest.raises(ProcessError, match="not ready after 0.2 s"):
            await wait_until(never, proc=proc, what="ready", timeout_s=0.2)
    finally:
        proc.stop()


def test_spawn_errors(tmp_path: Path) -> None:
    missing = ManagedProcess([str(tmp_path / "no-such-binary")], name="ghost", log_path=tmp_path / "g.log")
    with pytest.raises(ProcessError, match="ghost: cannot start"):
        missing.spawn()
    assert missing.stop() is None
    proc = ManagedProcess(SLEEPER, name="twice", log_path=tmp_path / "t.log")
    proc.spawn()
    try:
        with pytest.raises(ProcessError, match="already spawned"):
            proc.spawn()
    finally:
        proc.stop()


def test_free_ports_are_distinct_and_bindable() -> None:
    import socket

    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in [*ports, free_port()]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    with pytest.raises(ValueError):
        free_ports(0)
