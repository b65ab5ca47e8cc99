"""`serve --workers N`: each worker's ports, and the refusals that would otherwise surface as a
worker failing to bind."""

from __future__ import annotations

import contextlib

import pytest

from extproc.config.loader import config_from_mapping
from extproc.replicas.workers import worker_addresses


def cfg(grpc: str, admin: str):
    return config_from_mapping({"listen": {"grpc": grpc, "admin": admin}, "models": [{"name": "m", "path": "builtin:qwen3-8b"}], "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}]})


def test_worker_i_listens_on_the_configured_ports_plus_i():
    got = worker_addresses(cfg("0.0.0.0:9002", "[::1]:9090"), 3)
    assert [(w.grpc, w.admin) for w in got] == [("0.0.0.0:9002", "[::1]:9090"), ("0.0.0.0:9003", "[::1]:9091"), ("0.0.0.0:9004", "[::1]:9092")]


@pytest.mark.parametrize(
    ("grpc", "admin", "workers", "message"),
    [
        ("127.0.0.1:0", "127.0.0.1:9090", 2, "fixed listen.grpc"),
        ("127.0.0.1:9002", "127.0.0.1:9003", 2, "overlap"),
        ("127.0.0.1:65535", "127.0.0.1:9090", 2, "65535"),
        ("127.0.0.1:9002", "127.0.0.1:9090", 0, "at least 1"),
    ],
)
def test_impossible_port_layouts_are_refused_with_the_reason(grpc, admin, workers, message):
    with pytest.raises(ValueError, match=message):
        worker_addresses(cfg(grpc, admin), workers)


MODEL = "Qwen/Qwen3-8B"


def test_one_worker_may_keep_port_zero():
    assert worker_addresses(cfg("127.0.0.1:0", "127.0.0.1:0"), 1)[0].grpc == "127.0.0.1:0"


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _write(path, addresses: list[str], *, watch: bool = True) -> None:
    import yaml

    config = {"models": [{"name": MODEL}], "endpoints": [{"address": a, "models": [MODEL]} for a in addresses]}
    if not watch:
        config["discovery"] = {"sources": [{"type": "static", "watch": False}]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config), encoding="utf-8")
    tmp.replace(path)


@contextlib.contextmanager
def _supervisor(tmp_path, path, workers: int = 2):
    """`serve --workers N` on free port runs, started and listening; yields (process, gRPC base,
    admin base). Every process in its group is SIGKILLed at the end, whatever happened."""
    import os
    import signal
    import sys
    import time

    from extproc.stack.ports import free_port_run
    from extproc.stack.procs import ManagedProcess

    grpc_base, admin_base = free_port_run(workers), free_port_run(workers)
    env = {**os.environ, "LLM_EXTPROC_GRPC_ADDRESS": f"127.0.0.1:{grpc_base}", "LLM_EXTPROC_ADMIN_ADDRESS": f"127.0.0.1:{admin_base}"}
    proc = ManagedProcess([sys.executable, "-m", "extproc", "serve", "--config", str(path), "--workers", str(workers)],
                          name="supervisor", log_path=tmp_path / "supervisor.log", env=env)  # fmt: skip
    pgid = proc.spawn()  # its own session: the workers share its process group
    try:
        deadline = time.monotonic() + 90
        while not all(_listening(grpc_base + i) and _listening(admin_base + i) for i in range(workers)):
            assert time.monotonic() < deadline and proc.running, proc.log_tail()
            time.sleep(0.2)
        yield proc, grpc_base, admin_base
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever is left, if the test failed
        except ProcessLookupError:
            pass
        proc.stop(timeout_s=5)


def test_workers_stop_when_the_supervisor_is_killed(tmp_path):
    # A SIGKILLed supervisor (OOM killer, `kill -9`) left its workers running and holding their
    # ports, so the next `serve --workers` could not bind. The workers now get SIGTERM with it.
    import os
    import signal
    import time

    path = tmp_path / "workers.yaml"
    _write(path, ["127.0.0.1:9"])
    with _supervisor(tmp_path, path) as (proc, grpc_base, _):
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_listening(grpc_base + i) for i in range(2)):
            assert time.monotonic() < deadline, "a worker outlived its killed supervisor"
            time.sleep(0.2)


def test_sighup_to_the_supervisor_reloads_every_worker(tmp_path):
    """HUP's default action killed the supervisor and every worker with it (Envoy, failing open,
    then bypassed routing and limits). Now it reaches every worker, each reloads the endpoints
    file as one server does, and everything keeps running."""
    import os
    import signal
    import time

    import httpx

    path = tmp_path / "workers.yaml"
    _write(path, ["127.0.0.1:9"], watch=False)
    with _supervisor(tmp_path, path) as (proc, grpc_base, admin_base):
        _write(path, ["127.0.0.1:9", "127.0.0.1:11"], watch=False)
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        for i in range(2):
            while True:
                assert proc.running, "the supervisor died of SIGHUP: " + proc.log_tail()
                body = httpx.get(f"http://127.0.0.1:{admin_base + i}/api/v1/endpoints", timeout=5, trust_env=False).json()
                if {e["address"] for e in body["endpoints"]} == {"127.0.0.1:9", "127.0.0.1:11"}:
                    break
                assert time.monotonic() < deadline, f"worker {i} did not reload: {body}"
                time.sleep(0.1)
        assert proc.running and all(_listening(grpc_base + i) for i in range(2))
