"""Run a throwaway `redis-server` (Debian's `redis-server` package) for tests and benchmarks.

    redis = RedisProcess(workdir=Path("/tmp/run"))
    await redis.start()          # a free port on 127.0.0.1, data dir under workdir, no persistence
    ... redis.url ...            # redis://127.0.0.1:PORT/0
    await redis.stop()           # SIGTERM by PID; start() again brings it back on the same port
"""

from __future__ import annotations

import shutil
from pathlib import Path

import redis.asyncio as aioredis

from extproc.stack.ports import free_port
from extproc.stack.procs import ChildHandle, ManagedProcess, wait_until

__all__ = ["RedisProcess", "redis_server_binary"]


def redis_server_binary() -> str | None:
    """Path of `redis-server` on PATH (or Debian's /usr/bin), or None when it is not installed."""
    return shutil.which("redis-server") or (str(Path("/usr/bin/redis-server")) if Path("/usr/bin/redis-server").exists() else None)


class RedisProcess(ChildHandle):
    """One `redis-server` on 127.0.0.1, persistence off, its files in `workdir`.

    Args:
        workdir: data directory and log (`redis.log`).
        port: fixed port; 0 picks a free one at the first `start()` (kept for restarts).
    """

    def __init__(self, *, workdir: Path, port: int = 0, name: str = "redis") -> None:
        self.workdir = Path(workdir)
        self.port = port
        self.name = name
        self._proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self, timeout_s: float = 15.0) -> None:
        """Start; return once it answers PING.

        Raises:
            ProcessError: not installed, exited, or not answering within `timeout_s` seconds.
            RuntimeError: already running.
        """
        if self._proc is not None and self._proc.running:
            raise RuntimeError(f"{self.name} already running")
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install -y redis-server)")
        self.port = self.port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes"]
        self._proc = ManagedProcess(argv, name=self.name, log_path=self.workdir / f"{self.name}.log")
        self._proc.spawn()
        client = aioredis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:

            async def ready() -> bool:
                return bool(await client.ping())

            await wait_until(ready, proc=self._proc, what="answering PING", timeout_s=timeout_s)
        except BaseException:
            await self.stop()
            raise
        finally:
            await client.aclose()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM by PID, bounded wait, then SIGKILL. Safe to call twice."""
        if self._proc is not None:
            await self._proc.astop(timeout_s)
