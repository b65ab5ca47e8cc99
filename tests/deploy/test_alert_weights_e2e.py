"""End to end with real servers: Debian's Prometheus scrapes a running llm-extproc (Envoy in
front of two simulators), a simulator fault (inter-chunk jitter) pushes that endpoint's P95 TTFT
over the shipped rule's threshold, Prometheus fires `LLMEndpointTTFTP95High`, Debian's
Alertmanager posts it to the admin webhook with the bearer token, llm-extproc lowers the
endpoint's weight, traffic moves to the other endpoint, and once Alertmanager is gone (no more
renewals) the override runs out by itself.

The shipped rules and Alertmanager config are used as they are except for their clocks (the
rule's rate window and `for`, the override's length, Alertmanager's grouping waits), so the test
takes well under a minute of wall time. Skipped where `prometheus` / `prometheus-alertmanager`
are not installed (`.ci/run` installs them)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path

import httpx
import pytest
import yaml

from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.fleet import SimProcess
from extproc.stack.ports import free_ports
from extproc.stack.procs import ManagedProcess, wait_until
from extproc.stack.server import ExtProcServerProcess
from tests.deploy.conftest import DEPLOY

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

TOKEN = "e2e-admin-token"
RULE = "LLMEndpointTTFTP95High"
OVERRIDE_S = 8


def _binary(*names: str) -> str:
    for n in names:
        if path := shutil.which(n):
            return path
    pytest.skip(f"{' / '.join(names)} not installed (apt-get install prometheus prometheus-alertmanager)")


def _rules(tmp: Path) -> Path:
    """The shipped rules with short clocks for the TTFT rule: 15 s rate window, `for: 2s`."""
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == RULE]
    assert rule["labels"]["weight_action"] == "lower" and "[2m]" in rule["expr"]
    rule["expr"] = rule["expr"].replace("[2m]", "[15s]")
    rule["for"] = "2s"
    rule["annotations"]["weight_duration_s"] = str(OVERRIDE_S)
    path = tmp / "alerts.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def _alertmanager_config(tmp: Path, admin_url: str) -> Path:
    """The shipped Alertmanager config pointed at this run's llm-extproc and token file."""
    am = yaml.safe_load((DEPLOY / "prometheus/alertmanager.yml").read_text())
    (hook,) = [h for r in am["receivers"] for h in r.get("webhook_configs", [])]
    hook["url"] = f"{admin_url}/api/v1/alerts"
    (tmp / "token").write_text(TOKEN + "\n")
    hook["http_config"]["authorization"]["credentials_file"] = str(tmp / "token")
    am["route"].update(group_wait="0s", group_interval="1s")
    path = tmp / "alertmanager.yml"
    path.write_text(yaml.safe_dump(am, sort_keys=False))
    return path


async def _weights(admin_url: str) -> dict[str, dict]:
    async with httpx.AsyncClient(timeout=5) as c:
        rows = (await c.get(f"{admin_url}/api/v1/weights")).json()["endpoints"]
    return {r["address"]: r for r in rows}


async def _chat(client: httpx.AsyncClient, url: str) -> str | None:
    body = {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                pass
            return r.headers.get("x-llm-endpoint") if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def test_a_firing_alert_lowers_the_endpoint_and_the_override_expires(tmp_path: Path):
    prometheus_bin = _binary("prometheus")
    alertmanager_bin = _binary("prometheus-alertmanager", "alertmanager")
    procs: list[ManagedProcess] = []
    # Every port fixed up front, so Prometheus, Alertmanager, the simulators and llm-extproc
    # start side by side (Prometheus scrapes the server once it is up).
    grpc_port, admin_port, am_port, prom_port, *sim_ports = free_ports(6)
    sims = [SimProcess("h100-qwen3-8b", name=f"sim-{i}", workdir=tmp_path, seed=i, port=sim_ports[i]) for i in range(2)]
    server = envoy = None
    stop = asyncio.Event()
    routed: list[tuple[float, str | None]] = []

    async def traffic() -> None:
        async with httpx.AsyncClient(timeout=60) as client:

            async def worker() -> None:
                while not stop.is_set():
                    routed.append((time.monotonic(), await _chat(client, envoy.url)))

            await asyncio.gather(*(worker() for _ in range(4)))

    try:
        slow, fast = (f"127.0.0.1:{port}" for port in sim_ports)
        config = {
            "models": [{"name": "Qwen/Qwen3-8B"}],
            "endpoints": [{"address": a, "models": ["Qwen/Qwen3-8B"]} for a in (slow, fast)],
            "telemetry": {"sample_rate": 1.0},
        }
        (tmp_path / "llm-extproc.yaml").write_text(yaml.safe_dump(config))
        server = ExtProcServerProcess(
            tmp_path / "llm-extproc.yaml", workdir=tmp_path, grpc_port=grpc_port, admin_port=admin_port, env={"LLM_EXTPROC_ADMIN_TOKEN": TOKEN}
        )
        admin = server.admin_url

        am = ManagedProcess(
            [alertmanager_bin, f"--config.file={_alertmanager_config(tmp_path, admin)}", f"--storage.path={tmp_path / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            name="alertmanager", log_path=tmp_path / "alertmanager.log",
        )  # fmt: skip
        prom_cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(_rules(tmp_path))],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "llm-extproc", "static_configs": [{"targets": [admin.removeprefix("http://")]}]}],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        prom = ManagedProcess(
            [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'prom-data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--rules.alert.resend-delay=1s"],
            name="prometheus", log_path=tmp_path / "prometheus.log",
        )  # fmt: skip
        for p in (am, prom):
            p.spawn()
            procs.append(p)
        await asyncio.gather(server.start(), *(s.start() for s in sims))
        assert [s.address for s in sims] == [slow, fast]
        envoy = EnvoyProcess(
            rewrite_config(load_envoy_config("fail-open"), RunSettings(extproc=server.grpc_address, endpoints=[("127.0.0.1", s.port) for s in sims])),
            workdir=tmp_path,
        )
        await envoy.start()
        prom_url = f"http://127.0.0.1:{prom_port}"

        async def query(expr: str) -> list[dict]:
            async with httpx.AsyncClient(timeout=5) as c:
                return (await c.get(f"{prom_url}/api/v1/query", params={"query": expr})).json()["data"]["result"]

        async def scraped() -> bool:
            return [r["value"][1] for r in await query('up{job="llm-extproc"}')] == ["1"]

        await wait_until(scraped, proc=prom, what="Prometheus scraping llm-extproc", timeout_s=30, interval_s=0.5)

        # Healthy fleet: both endpoints take traffic.
        load = asyncio.create_task(traffic())

        async def both_served() -> bool:
            before = [e for _, e in routed]
            return before.count(slow) >= 2 and before.count(fast) >= 2

        await wait_until(both_served, proc=prom, what=f"both endpoints serving: {[e for _, e in routed]}", timeout_s=15, interval_s=0.1)

        # The fault: up to 6 s before every streamed chunk on one engine → its P95 TTFT > 2 s.
        async with httpx.AsyncClient() as c:
            (await c.post(f"{sims[0].url}/sim/faults", json={"jitter_ms": 6000})).raise_for_status()

        async def lowered() -> bool:
            ov = (await _weights(admin))[slow]["override"]
            return ov["source"] == "alertmanager" and ov["reason"] == RULE and ov["factor"] == 0.25

        await wait_until(lowered, proc=prom, what=f"{RULE} to lower {slow} through Alertmanager", timeout_s=90, interval_s=0.5)
        firing = await query(f'ALERTS{{alertname="{RULE}", alertstate="firing"}}')
        assert [a["metric"]["endpoint"] for a in firing] == [slow]
        t_lowered = time.monotonic()
        async with httpx.AsyncClient() as c:
            (await c.delete(f"{sims[0].url}/sim/faults")).raise_for_status()  # the engine recovers; the override stays
            metrics = (await c.get(f"{admin}/metrics")).text
        assert f'llm_extproc_endpoint_weight_override_factor{{endpoint="{slow}"}} 0.25' in metrics

        # Traffic moves away while the override holds.
        await asyncio.sleep(3)
        during = [e for t, e in routed if t > t_lowered + 0.5 and e is not None]
        assert during and during.count(slow) <= len(during) // 5, during

        # No more renewals: the override lapses by itself within its duration.
        am.stop()
        await wait_until(lambda: _expired(admin, slow), proc=prom, what="the override to expire", timeout_s=OVERRIDE_S + 5, interval_s=0.5)
        async with httpx.AsyncClient() as c:
            metrics = (await c.get(f"{admin}/metrics")).text
        assert f'llm_extproc_endpoint_weight_override_factor{{endpoint="{slow}"}} 1.0' in metrics
        stop.set()
        await load
    finally:
        stop.set()
        for p in procs:
            p.stop()
        for h in (envoy, server, *sims):
            if h is not None:
                with contextlib.suppress(Exception):
                    await h.aclose()


async def _expired(admin: str, address: str) -> bool:
    ov = (await _weights(admin))[address]["override"]
    return ov["factor"] == 1.0 and ov["source"] is None
