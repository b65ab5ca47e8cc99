"""`llm-extproc serve --workers N`: N server processes on one host, each on its own ports.

Worker i listens on `listen.grpc`'s port + i and `listen.admin`'s port + i (same hosts), and
Envoy lists every gRPC port in its `llm_extproc` cluster (`llm-extproc envoy-config --workers N`).
One port shared through SO_REUSEPORT was measured and rejected: Envoy multiplexes every ext_proc
stream onto a few long-lived HTTP/2 connections, and the kernel spreads connections, not streams
(docs/decisions/0211-workers-on-their-own-ports.md).

The supervisor forwards SIGTERM/SIGINT to every worker (each drains its streams), restarts a
worker that exits after it had run `MIN_UPTIME_S`, and stops everything when one fails sooner (a
configuration or port problem that a restart would only repeat).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.config.loader import WORKER_ENV
from extproc.config.schema import Config, parse_host_port

__all__ = ["WorkerAddress", "worker_addresses", "run_workers", "MIN_UPTIME_S"]


MIN_UPTIME_S = 10.0
"""A worker that exits sooner than this after its start stops the whole group (seconds)."""

POLL_S = 0.05
"""How often the supervisor looks at its workers (seconds); it also bounds how late it notices a
SIGTERM (a signal does not cut `time.sleep` short), so keep it well below a second."""


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """Worker `index`'s gRPC and admin `host:port`."""

    index: int
    grpc: str
    admin: str


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_addresses(config: Config, workers: int) -> list[WorkerAddress]:
    """Each worker's listen addresses: the configured ports, + 1 per worker.

    Raises:
        ValueError: `workers` below 1, a port 0 (each worker needs a port known to Envoy), or a
            port past 65535.
    """
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    ghost, gport = parse_host_port(config.listen.grpc)
    ahost, aport = parse_host_port(config.listen.admin)
    if workers > 1 and (gport == 0 or aport == 0):
        raise ValueError("--workers needs fixed listen.grpc and listen.admin ports (worker i listens on port + i), not 0")
    if max(gport, aport) + workers - 1 > 65535:
        raise ValueError(f"{workers} workers from ports {gport}/{aport} run past 65535")
    out = [WorkerAddress(i, _join(ghost, gport + i), _join(ahost, aport + i)) for i in range(workers)]
    grpc_ports = {gport + i for i in range(workers)}
    if workers > 1 and config.admin.enabled and grpc_ports & {aport + i for i in range(workers)}:
        raise ValueError(f"the workers' gRPC ports ({gport}+) and admin ports ({aport}+) overlap; space them at least {workers} apart")
    return out


def _die_with_parent() -> None:
    """In the worker, before exec (Linux): SIGTERM when the supervisor dies, however it dies —
    a SIGKILLed supervisor otherwise left its workers running and holding their ports. Elsewhere
    a no-op (the supervisor's own signal handler still stops them)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class _Worker:
    def __init__(self, addr: WorkerAddress, argv: Sequence[str]) -> None:
        self.addr = addr
        self.argv = list(argv)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def spawn(self) -> None:
        env = dict(os.environ)
        env["LLM_EXTPROC_GRPC_ADDRESS"] = self.addr.grpc
        env["LLM_EXTPROC_ADMIN_ADDRESS"] = self.addr.admin
        env[WORKER_ENV] = str(self.addr.index)
        # inherits stdout/stderr: one log stream
        self.proc = subprocess.Popen(self.argv, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        self.started = time.monotonic()


def run_workers(config: Config, workers: int, child_argv: Sequence[str], *, sync_note: str) -> int:
    """Run `workers` copies of `child_argv` (a `serve` command line without `--workers`) until
    SIGTERM/SIGINT; returns the exit status for the supervisor.

    Args:
        config: the loaded configuration (its listen ports).
        workers: how many processes (≥ 1).
        child_argv: the worker's command line.
        sync_note: printed once at start (whether the workers share state through Redis).

    Raises:
        ValueError: see `worker_addresses`.
    """
    group = [_Worker(a, child_argv) for a in worker_addresses(config, workers)]
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:  # said once for the group: the workers stay quiet
            print("shutting down: waiting for in-flight streams", file=sys.stderr, flush=True)
        stopping = True
        for w in group:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    print(f"llm-extproc: {workers} workers, gRPC on {', '.join(w.addr.grpc for w in group)}; {sync_note}", flush=True)
    status = 0
    try:
        for w in group:
            w.spawn()
        while not stopping:
            time.sleep(POLL_S)
            for w in group:
                code = w.proc.poll() if w.proc is not None else None
                if code is None or stopping:
                    continue
                ran = time.monotonic() - w.started
                if ran < MIN_UPTIME_S:
                    print(f"llm-extproc: worker {w.addr.index} ({w.addr.grpc}) exited with {code} after {ran:.1f} s; stopping all", file=sys.stderr, flush=True)
                    status = 1
                    on_signal(signal.SIGTERM, None)
                    break
                print(f"llm-extproc: worker {w.addr.index} ({w.addr.grpc}) exited with {code}; restarting it", file=sys.stderr, flush=True)
                w.spawn()
        for w in group:
            if w.proc is not None:
                w.proc.wait()  # each worker bounds its own drain (limits.shutdown_grace_s)
    finally:
        for w in group:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        for s, h in previous.items():
            signal.signal(s, h)
    return status
