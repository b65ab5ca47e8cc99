"""Run `llm-extproc serve` as a child process of the stack owner.

    server = ExtProcServerProcess(Path("config.yaml"), workdir=Path("/tmp/run"))
    await server.start()         # waits for admin /healthz == 200
    ... server.grpc_address ...  # ("127.0.0.1", port) for Envoy's ext_proc cluster
    await server.aclose()        # SIGTERM by PID; the server drains in-flight streams

Addresses come in through the server's environment overrides (`LLM_EXTPROC_GRPC_ADDRESS`,
`LLM_EXTPROC_ADMIN_ADDRESS`), so one config file serves any number of concurrent runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import httpx

from extproc.stack.ports import free_ports
from extproc.stack.procs import ChildHandle, ManagedProcess, wait_until

__all__ = ["ExtProcServerProcess"]


class ExtProcServerProcess(ChildHandle):
    """`llm-extproc serve --config PATH` on 127.0.0.1 ports picked at start.

    Args:
        config_path: the server's YAML config.
        workdir: where the log goes (`<name>.log`).
        grpc_port / admin_port: fixed ports; 0 picks free ones at `start()`.
        log_level: the server's `--log-level`.
        env: extra environment variables for the child.
        cwd: the child's working directory (default: this process's); with `PYTHONPATH` in
            `env`, runs another source tree's `extproc` (benchmarks compare against a baseline).

    Nothing happens until `start()`.
    """

    def __init__(
        self,
        config_path: Path,
        *,
        workdir: Path,
        grpc_port: int = 0,
        admin_port: int = 0,
        log_level: str = "info",
        env: Mapping[str, str] | None = None,
        name: str = "llm-extproc",
        cwd: Path | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        self._cwd = cwd
        self.workdir = Path(workdir)
        self.grpc_port = grpc_port
        self.admin_port = admin_port
        self.name = name
        self._log_level = log_level
        self._env = dict(env or {})
        self._proc: ManagedProcess | None = None

    @property
    def grpc_address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.grpc_port)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


    async def start(self, timeout_s: float = 60.0) -> None:
        """Start the server; return once its admin `/healthz` answers 200 with this child's pid
        (a replacement may share the ports with the process it replaces).

        Raises:
            ProcessError: it exited or was not healthy within `timeout_s` seconds (with its log).
            RuntimeError: already started.
        """
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        if not self.grpc_port or not self.admin_port:
            picked = free_ports(2)
            self.grpc_port = self.grpc_port or picked[0]
            self.admin_port = self.admin_port or picked[1]
        env = dict(os.environ)
        env.update(self._env)
        env["LLM_EXTPROC_GRPC_ADDRESS"] = f"127.0.0.1:{self.grpc_port}"
        env["LLM_EXTPROC_ADMIN_ADDRESS"] = f"127.0.0.1:{self.admin_port}"
        argv = [sys.executable, "-m", "extproc", "serve", "--config", str(self.config_path), "--log-level", self._log_level]
        self._proc = ManagedProcess(argv, name=self.name, log_path=self.workdir / f"{self.name}.log", env=env, cwd=self._cwd)
        self._proc.spawn()
        try:
            # A fresh connection per probe: a kept-alive one may belong to the old process.
            no_keepalive = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=2.0, trust_env=False, limits=no_keepalive) as client:

                async def healthy() -> bool:
                    # This child, not an old process still sharing the port (SO_REUSEPORT) while
                    # it drains: /healthz names its pid.
                    r = await client.get(f"{self.admin_url}/healthz")
                    return r.status_code == 200 and r.json().get("pid") == self._proc.pid

                await wait_until(healthy, proc=self._proc, what="healthy", timeout_s=timeout_s)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self, timeout_s: float = 35.0) -> None:
        """SIGTERM by PID and wait up to `timeout_s` seconds (the server drains in-flight
        streams for up to `limits.shutdown_grace_s`), then SIGKILL."""
        if self._proc is not None:
            await self._proc.astop(timeout_s)
