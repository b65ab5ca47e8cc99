"""Child processes of the local stack: started in their own session, stopped by PID.

Each child gets a new session (so a Ctrl-C or SIGHUP aimed at the parent's terminal does not
reach it, and a wrapper's children share one process group we can find again), writes stdout and
stderr to one log file, and is stopped explicitly: SIGTERM to its PID, a bounded wait, then
SIGKILL to its process group. Nothing here waits without a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["ManagedProcess", "ProcessError", "ChildHandle", "wait_until"]

_KILL_WAIT_S = 5.0


class ProcessError(RuntimeError):
    """A child process could not be started, exited early, or did not become ready in time.

    The message ends with the tail of the child's log.
    """


class ManagedProcess:
    """One child process, its log file, and its lifecycle.

    Args:
        argv: the command line (argv[0] is looked up on PATH if it has no slash).
        name: short label used in error messages.
        log_path: file that receives the child's stdout and stderr (truncated at spawn).
        env: full environment for the child (default: this process's environment).
        cwd: working directory (default: this process's).

    The constructor only records these; `spawn()` starts the process.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child's PID once spawned."""
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status once the child has exited (negative: killed by that signal), else None."""
        return self._popen.poll() if self._popen is not None else None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def spawn(self) -> int:
        """Start the child in a new session; return its PID.

        Raises:
            ProcessError: already spawned, or the executable could not be started.
        """
        if self._popen is not None:
            raise ProcessError(f"{self.name}: already spawned (pid {self._popen.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            try:
                self._popen = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ProcessError(f"{self.name}: cannot start {self.argv[0]}: {exc.strerror}") from None
        return self._popen.pid

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stop the child: SIGTERM to its PID, wait up to `timeout_s` seconds, then SIGKILL.

        After the child is gone, whatever is left of its process group (children a wrapper
        started) is killed too. Safe to call twice, or on a child that already exited.

        Returns:
            The exit status (None if never spawned).
        """
        p = self._popen
        if p is None:
            return None
        pgid = p.pid  # start_new_session: the child leads its own process group
        if p.poll() is None:
            _signal_pid(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                try:
                    p.wait(timeout=_KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    raise ProcessError(f"{self.name}: pid {p.pid} survived SIGKILL{self._tail_suffix()}") from None
        _signal_group(pgid, signal.SIGKILL)
        return p.returncode

    async def astop(self, timeout_s: float = 10.0) -> int | None:
        """`stop()` without blocking the event loop."""
        return await asyncio.to_thread(self.stop, timeout_s)

    def log_tail(self, max_chars: int = 4000) -> str:
        """The last `max_chars` characters of the child's log ('' if there is none)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_chars * 4))
                data = f.read()
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace")[-max_chars:]

    def _tail_suffix(self) -> str:
        tail = self.log_tail()
        return f"\n--- last lines of {self.log_path} ---\n{tail}" if tail else ""

    def failure(self, message: str) -> ProcessError:
        """A ProcessError for this child: `message`, its exit status if any, and its log tail."""
        rc = self.returncode
        status = f" (exited with {rc})" if rc is not None else ""
        return ProcessError(f"{self.name}: {message}{status}{self._tail_suffix()}")


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def wait_until(
    check: Callable[[], Awaitable[bool]],
    *,
    proc: ManagedProcess,
    what: str,
    timeout_s: float,
    interval_s: float = 0.05,
) -> None:
    """Poll `check()` until it returns True.

    Exceptions from `check` count as "not yet" (the child may not be listening yet).

    Raises:
        ProcessError: `proc` exited first, or `timeout_s` seconds passed (with its log tail).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if not proc.running:
            raise proc.failure(f"exited before {what}")
        try:
            if await check():
                return
        except Exception:  # noqa: BLE001 - not ready yet; the deadline bounds the loop
            pass
        if time.monotonic() >= deadline:
            raise proc.failure(f"not {what} after {timeout_s:g} s")
        await asyncio.sleep(interval_s)


class ChildHandle:
    """What every stack component wrapping one `ManagedProcess` shares: `name`, `pid` and
    `process`. Subclasses set `self._proc` when started; `not_started_error` is the exception
    type `process` raises before that (EnvoyProcess raises its EnvoyError)."""

    not_started_error: type[Exception] = RuntimeError
    name: str
    _proc: ManagedProcess | None

    @property
    def pid(self) -> int | None:
        """The child's PID once started, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def process(self) -> ManagedProcess:
        """The running child.

        Raises:
            `not_started_error`: not started yet.
        """
        if self._proc is None:
            raise self.not_started_error(f"{self.name} is not started")
        return self._proc

    @property
    def exited(self) -> bool:
        """Started once and no longer running (it died, or was stopped)."""
        return self._proc is not None and self._proc.pid is not None and not self._proc.running

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """SIGTERM by PID, wait up to `timeout_s` seconds, then SIGKILL. Safe to call twice."""
        if self._proc is not None:
            await self._proc.astop(timeout_s)
