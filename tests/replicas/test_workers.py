"""`serve --workers N`: each worker's ports, and the refusals that would otherwise surface as a
worker failing to bind."""

from __future__ import annotations

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


def test_one_worker_may_keep_port_zero():
    assert worker_addresses(cfg("127.0.0.1:0", "127.0.0.1:0"), 1)[0].grpc == "127.0.0.1:0"


def test_workers_stop_when_the_supervisor_is_killed(tmp_path):
    # A SIGKILLed supervisor (OOM killer, `kill -9`) left its workers running and holding their
    # ports, so the next `serve --workers` could not bind. The workers now get SIGTERM with it.
    import os
    import signal
    import socket
    import sys
    import time

    import yaml

    from extproc.stack.ports import free_port_run
    from extproc.stack.procs import ManagedProcess

    def listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    grpc_base, admin_base = free_port_run(2), free_port_run(2)
    path = tmp_path / "workers.yaml"
    model = "Qwen/Qwen3-8B"
    path.write_text(yaml.safe_dump({"models": [{"name": model}], "endpoints": [{"address": "127.0.0.1:9", "models": [model]}]}))
    env = {**os.environ, "LLM_EXTPROC_GRPC_ADDRESS": f"127.0.0.1:{grpc_base}", "LLM_EXTPROC_ADMIN_ADDRESS": f"127.0.0.1:{admin_base}"}
    proc = ManagedProcess([sys.executable, "-m", "extproc", "serve", "--config", str(path), "--workers", "2"],
                          name="supervisor", log_path=tmp_path / "supervisor.log", env=env)  # fmt: skip
    pgid = proc.spawn()  # its own session: the workers share its process group
    try:
        deadline = time.monotonic() + 90
        while not all(listening(grpc_base + i) for i in range(2)):
            assert time.monotonic() < deadline and proc.running, proc.log_tail()
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(listening(grpc_base + i) for i in range(2)):
            assert time.monotonic() < deadline, "a worker outlived its killed supervisor"
            time.sleep(0.2)
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever is left, if the test failed
        except ProcessLookupError:
            pass
        proc.stop(timeout_s=5)
