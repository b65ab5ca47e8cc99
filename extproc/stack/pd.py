"""`llm-extproc pd-sidecar` as a stack component: one child process in front of a decode-role
simulator (`up --fleet pd`, the P/D benchmark).

    side = SidecarProcess(decode_url, ["127.0.0.1:41001"], name="sidecar-2", workdir=run)
    await side.start()           # binds port 0 and reports its URL
    ... side.address ...         # what the router lists as the decode endpoint
    await side.aclose()          # SIGTERM by PID, bounded wait, SIGKILL
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.stack.procs import ChildHandle, ManagedProcess, wait_until

__all__ = ["SidecarProcess"]

_READY = re.compile(r"^pd-sidecar listening on http://([0-9.]+):(\d+) ", re.MULTILINE)


class SidecarProcess(ChildHandle):
    """A `llm-extproc pd-sidecar` child on 127.0.0.1, port picked by itself.

    Args:
        decode_url: the decode engine it fronts (`http://host:port`).
        prefillers: the prefill endpoints it may send prefills to (`host:port`, its `--allow`).
        name: label for logs (`sidecar-2`); the log is `<workdir>/<name>.log`.
        workdir: where the log goes.

    Raises:
        ValueError: no prefill endpoint to allow.
    """

    def __init__(self, decode_url: str, prefillers: Sequence[str], *, name: str, workdir: Path) -> None:
        if not prefillers:
            raise ValueError("a P/D sidecar needs at least one prefill endpoint to allow")
        self.decode_url = decode_url
        self.prefillers = list(prefillers)
        self.name = name
        self.workdir = Path(workdir)
        self.port: int | None = None
        self._proc: ManagedProcess | None = None

    @property
    def address(self) -> str:
        """`127.0.0.1:PORT`, the decode endpoint's address in the router's config."""
        if self.port is None:
            raise RuntimeError(f"{self.name} is not started")
        return f"127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        """The child's command line."""
        allow = [a for p in self.prefillers for a in ("--allow", p)]
        return [sys.executable, "-m", "extproc", "pd-sidecar", "--decode", self.decode_url, "--listen", "127.0.0.1:0", *allow]

    async def start(self, timeout_s: float = 60.0) -> None:
        """Spawn it; return once it printed its URL.

        Raises:
            ProcessError: it exited or was not listening within `timeout_s` seconds (with its log).
            RuntimeError: already started.
        """
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self._proc = ManagedProcess(self.argv(), name=self.name, log_path=self.workdir / f"{self.name}.log", env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._proc.spawn()

        async def listening() -> bool:
            match = _READY.search(self._proc.log_tail(4_000)) if self._proc else None
            if match:
                self.port = int(match.group(2))
            return match is not None

        try:
            await wait_until(listening, proc=self._proc, what="listening", timeout_s=timeout_s, interval_s=0.1)
        except BaseException:
            await self.aclose()
            raise
