"""Running `llm-extproc demo|up|bench` as a subprocess and checking, by PID, that no child survives."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FLEET_1", "FLEET_2", "Command", "children", "survivors"]

FLEET_1 = "h100-qwen3-8b"
"""A one-endpoint fleet: the cheapest stack to start, for lifecycle tests."""
FLEET_2 = "h100-qwen3-8b,a100-qwen3-8b"
"""A two-endpoint fleet (one of each GPU): half the start-up cost of the default four."""


def _stat(pid: int) -> tuple[int, int] | None:
    """`(ppid, start time in clock ticks)` of a live process, None when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def children(pid: int) -> dict[int, int]:
    """Live direct children of `pid`: PID → start time (to tell a reused PID apart)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] == pid:
                out[int(entry)] = stat[1]
    return out


def survivors(seen: dict[int, int]) -> list[int]:
    """PIDs from `seen` still alive as the same process (same start time)."""
    return [pid for pid, start in seen.items() if (stat := _stat(pid)) is not None and stat[1] == start]


class Command:
    """`python -m extproc <args>` with stdout/stderr to files, its children tracked as they appear."""

    def __init__(self, args: Sequence[str], workdir: Path) -> None:
        self.out_path = workdir / "stdout.txt"
        self.err_path = workdir / "stderr.txt"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "extproc", *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env=env, cwd=workdir,
            )  # fmt: skip
        self.seen: dict[int, int] = {}

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def track(self) -> None:
        """Record the command's current children."""
        self.seen.update(children(self.proc.pid))

    def wait_for(self, text: str, timeout_s: float, *, children_at_least: int = 0) -> None:
        """Wait until stdout contains `text` (and that many children were seen), tracking children.

        Raises:
            AssertionError: the command exited first or `timeout_s` passed (with its output).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.track()
            if text in self.stdout and len(self.seen) >= children_at_least:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} within {timeout_s} s (rc {self.proc.poll()}):\n{self.stdout}\n{self.stderr}")

    def wait(self, timeout_s: float) -> int:
        """Wait for exit while tracking children; kill it (and fail) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.track()
            time.sleep(0.1)
        if self.proc.poll() is None:
            self.kill()
            raise AssertionError(f"still running after {timeout_s} s:\n{self.stdout}\n{self.stderr}")
        return self.proc.returncode

    def __enter__(self) -> Command:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # the test failed while it ran: leave nothing behind
            self.kill()

    def assert_clean_exit(self, rc: int, expected: int, *, children_at_least: int) -> None:
        """Exit status `expected`, no traceback, at least that many children seen, none alive."""
        assert rc == expected, self.stdout + self.stderr
        assert "Traceback" not in self.stderr, self.stderr
        assert len(self.seen) >= children_at_least, self.seen
        assert survivors(self.seen) == []

    def kill(self) -> None:
        """Last resort for a failed test: SIGKILL the command and every child it was seen with."""
        for pid in [self.proc.pid, *survivors(self.seen)]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
