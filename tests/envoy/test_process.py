"""`EnvoyProcess` starts a real Envoy on kernel-picked ports and stops it by PID."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.ports import free_port
from extproc.stack.procs import ProcessError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_start_reports_ports_and_aclose_stops_the_pid(tmp_path: Path) -> None:
    dead = ("127.0.0.1", free_port())  # nothing listens: Envoy still starts (clusters are static)
    cfg = rewrite_config(load_envoy_config("fail-closed"), RunSettings(extproc=dead))
    envoy = EnvoyProcess(cfg, workdir=tmp_path)
    await envoy.start()
    try:
        assert envoy.listener_port and envoy.admin_port and envoy.listener_port != envoy.admin_port
        pid = envoy.pid
        assert pid is not None and _pid_alive(pid)
        async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
            ready = await client.get(f"{envoy.admin_url}/ready")
            assert (ready.status_code, ready.text.strip()) == (200, "LIVE")
            # Fail-closed with llm-extproc down: our JSON 503 comes from this listener.
            r = await client.get(f"{envoy.url}/v1/models")
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "routing_unavailable"
        assert (tmp_path / "envoy.yaml").is_file() and (tmp_path / "envoy.log").is_file()
        # The shipped configs limit client connections (overload manager): Envoy warned at every
        # start that nothing did.
        assert "no configured limit to the number of allowed active downstream connections" not in (tmp_path / "envoy.log").read_text()
    finally:
        await envoy.aclose()
    assert not envoy.process.running
    assert not _pid_alive(pid)


async def test_a_config_envoy_rejects_fails_start_with_its_log(tmp_path: Path) -> None:
    cfg = rewrite_config(load_envoy_config("fail-open"), RunSettings())
    cfg["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    envoy = EnvoyProcess(cfg, workdir=tmp_path)
    with pytest.raises(ProcessError, match="NO_SUCH_POLICY"):
        await envoy.start()
    assert not envoy.process.running


async def test_own_temp_dir_is_removed_on_close() -> None:
    envoy = EnvoyProcess(rewrite_config(load_envoy_config("fail-closed"), RunSettings()))
    await envoy.start()
    workdir = envoy.process.log_path.parent
    assert workdir.is_dir()
    await envoy.aclose()
    assert not workdir.exists()
