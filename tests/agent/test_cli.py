"""`llm-extproc agent`: clear errors for unusable options, and a real run as a process."""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from pathlib import Path

import grpc
import pynvml
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from extproc.agent.nvml import MISSING_LIBRARY_MESSAGE
from extproc.agent.service import NODE_LOAD_SERVICE
from extproc.cli import app
from extproc.stack.procs import ManagedProcess, wait_until
from tests.agent.agent_helpers import FakeEngine


def _nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def invoke(*args: str):
    return CliRunner().invoke(app, ["agent", "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1", *args])


def test_nvml_without_the_library_names_it_and_the_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    result = invoke("--gpu-source", "nvml", "--engine-url", "none")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {MISSING_LIBRARY_MESSAGE}"
    assert "Traceback" not in result.output


@pytest.mark.skipif(_nvml_loadable(), reason="this machine has the NVML library")
def test_nvml_without_the_library_as_a_real_process() -> None:
    # No fakes: the real pynvml on a machine without the driver.
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "extproc", "agent", "--gpu-source", "nvml", "--engine-url", "none",
         "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "libnvidia-ml.so.1" in done.stderr and "--gpu-source none" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-source", "cuda"], "unknown --gpu-source 'cuda'"),
        (["--gpu-source", "sim:localhost:8000"], "needs an http(s) URL"),
        (["--period", "0"], "period_s must be > 0"),
        (["--unhealthy-after", "0"], "unhealthy_after must be at least 1"),
        (["--alpha", "-1"], "alpha must be >= 0"),
    ],
    ids=["unknown-source", "sim-without-url", "zero-period", "zero-threshold", "negative-alpha"],
)
def test_bad_options_exit_2_with_a_message(args: list[str], message: str) -> None:
    result = invoke("--engine-url", "none", *args)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_a_port_in_use_exits_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = CliRunner().invoke(
            app, ["agent", "--gpu-source", "none", "--engine-url", "none", "--host", "127.0.0.1",
                  "--grpc-port", "0", "--metrics-port", str(port)],
        )  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and "Traceback" not in result.output


async def test_runs_as_a_process_and_stops_on_sigterm(engine: FakeEngine, tmp_path: Path) -> None:
    proc = ManagedProcess(
        [sys.executable, "-m", "extproc", "agent", "--gpu-source", f"sim:{engine.url}", "--engine-url", engine.url,
         "--grpc-port", "0", "--metrics-port", "0", "--host", "127.0.0.1", "--period", "0.1", "--node", "n7"],
        name="agent", log_path=tmp_path / "agent.log", env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    proc.spawn()
    try:
        ready: dict[str, str] = {}

        async def listening() -> bool:
            for line in proc.log_tail().splitlines():
                if line.startswith("agent listening "):
                    ready.update(kv.split("=", 1) for kv in line.split()[2:])
                    return True
            return False

        await wait_until(listening, proc=proc, what="listening", timeout_s=30)
        assert ready["node"] == "n7" and ready["gpu-source"] == f"sim:{engine.url}"
        grpc_port = ready["grpc"].rsplit(":", 1)[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=NODE_LOAD_SERVICE), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        rc = await proc.astop(timeout_s=10)
    assert rc == 0, proc.log_tail()
    assert "Traceback" not in proc.log_tail()
