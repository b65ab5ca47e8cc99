"""Simulator fleets: each simulator its own process on a port it picked, stopped by PID; a
simulator that cannot start takes the others down with it and says why."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from extproc.stack.fleet import DEFAULT_FLEET, Fleet, SimProcess
from extproc.stack.procs import ProcessError

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_fleet_serves_on_its_own_ports_and_stops_by_pid(tmp_path: Path) -> None:
    fleet = Fleet(["h100-qwen3-8b", "a100-qwen3-8b"], workdir=tmp_path, speed=5.0, stream_interval=4, seed=7)
    await fleet.start()
    try:
        assert len(set(fleet.addresses)) == 2 and all(a.startswith("127.0.0.1:") for a in fleet.addresses)
        assert fleet.profiles == dict(zip(fleet.addresses, ["h100-qwen3-8b", "a100-qwen3-8b"]))
        assert os.getpid() not in fleet.pids and len(set(fleet.pids)) == 2
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            for url in fleet.urls:
                r = await client.get(f"{url}/health")
                assert r.status_code == 200 and r.headers["x-sim-speed"] == "5.0"
        with pytest.raises(RuntimeError, match="already started"):
            await fleet.start()
    finally:
        await fleet.aclose()
    pids = fleet.pids
    assert pids and not any(_alive(p) for p in pids)
    await fleet.aclose()  # twice is fine


async def test_a_simulator_that_cannot_start_fails_the_fleet_with_its_log(tmp_path: Path) -> None:
    fleet = Fleet(["h100-qwen3-8b", "a100-qwen3-8b"], workdir=tmp_path, load_shape="no-such-shape")
    with pytest.raises(ProcessError, match="exited before listening") as info:
        await fleet.start()
    assert "no-such-shape" in str(info.value)  # the simulator's own message, from its log
    assert not any(_alive(p) for p in fleet.pids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"profile": "tpu-giant"}, "unknown simulator profile 'tpu-giant'"),
        ({"speed": 0.0}, "speed must be > 0"),
        ({"stream_interval": 0}, "stream_interval must be >= 1"),
    ],
    ids=["profile", "speed", "stream-interval"],
)
def test_bad_settings_are_refused_before_spawning(tmp_path: Path, kwargs: dict, message: str) -> None:
    settings = {"profile": DEFAULT_FLEET[0], **kwargs}
    with pytest.raises(ValueError, match=message):
        SimProcess(settings.pop("profile"), name="sim-0", workdir=tmp_path, **settings)
    assert not list(tmp_path.iterdir())  # no log: nothing ran


def test_pd_fleet_roles_reach_the_simulators_and_the_router_config(tmp_path):
    from extproc.bench.stacks import server_config
    from extproc.stack.fleet import PD_FLEET, Fleet
    from extproc.stack.pd import SidecarProcess

    fleet = Fleet([p for p, _ in PD_FLEET], workdir=tmp_path, roles=[r for _, r in PD_FLEET])
    assert [s.argv()[-2:] for s in fleet.sims] == [["--role", "prefill"]] * 2 + [["--role", "decode"]] * 2
    with pytest.raises(ValueError, match="one per simulator"):
        Fleet(["h100-qwen3-8b"] * 2, workdir=tmp_path, roles=["prefill"])
    with pytest.raises(ValueError, match="unknown P/D role"):
        Fleet(["h100-qwen3-8b"], workdir=tmp_path, roles=["prefiller"])
    cfg = server_config(
        {"127.0.0.1:1": "h100-qwen3-8b", "127.0.0.1:2": "h100-qwen3-8b", "127.0.0.1:3": "h100-qwen3-8b"},
        profile="load-aware", roles={"127.0.0.1:1": "prefill", "127.0.0.1:2": "decode", "127.0.0.1:3": "both"},
    )
    assert [e.get("role") for e in cfg["endpoints"]] == ["prefill", "decode", None]
    side = SidecarProcess("http://127.0.0.1:2", ["127.0.0.1:1"], name="sidecar", workdir=tmp_path)
    assert side.argv()[3:] == ["pd-sidecar", "--decode", "http://127.0.0.1:2", "--listen", "127.0.0.1:0", "--allow", "127.0.0.1:1"]
    with pytest.raises(ValueError):
        SidecarProcess("http://127.0.0.1:2", [], name="sidecar", workdir=tmp_path)
