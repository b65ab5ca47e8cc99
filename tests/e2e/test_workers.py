"""`llm-extproc serve --workers 2` behind a real Envoy whose ext_proc cluster lists both workers
(`RunSettings.extproc_replicas`, as `envoy-config --workers 2` writes it), the workers sharing
their picks through a real redis-server:

- both workers decide (Envoy spreads the ext_proc streams over the two ports) and every request
  reaches an engine and comes back whole;
- each worker hears the other on the replica channel;
- SIGTERM to the supervisor stops both workers (their ports are free again).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.ports import free_port_run
from extproc.stack.procs import ManagedProcess, wait_until
from extproc.stack.redis import RedisProcess, redis_server_binary
from tests.e2e.e2e_helpers import MODEL, Engines, chat

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed (apt-get install -y redis-server)"),
]


def _routed(metrics_text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith('llm_extproc_requests_total{outcome="routed"'))


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_two_workers_behind_envoy_share_the_work_and_their_picks(workdir: Path, engines: Engines) -> None:
    redis = RedisProcess(workdir=workdir / "redis-workers")
    await redis.start()
    grpc_base, admin_base = free_port_run(2), free_port_run(2)
    config = {
        "models": [{"name": MODEL, "aliases": ["qwen3-8b"]}],
        "endpoints": [{"address": e.address, "models": [MODEL]} for e in engines.serving],
        "ratelimit": {"redis": {"url": redis.url}},
        "replicas": {"sync": "redis", "heartbeat_s": 0.2, "owner_timeout_s": 1.0},
    }
    path = workdir / "workers.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {**os.environ, "LLM_EXTPROC_GRPC_ADDRESS": f"127.0.0.1:{grpc_base}", "LLM_EXTPROC_ADMIN_ADDRESS": f"127.0.0.1:{admin_base}"}
    argv = [sys.executable, "-m", "extproc", "serve", "--config", str(path), "--workers", "2"]
    proc = ManagedProcess(argv, name="llm-extproc-workers", log_path=workdir / "llm-extproc-workers.log", env=env)
    envoy: EnvoyProcess | None = None
    admins = [f"http://127.0.0.1:{admin_base + i}" for i in range(2)]
    try:
        proc.spawn()
        async with httpx.AsyncClient(trust_env=False, timeout=5) as admin:

            async def both_synced() -> bool:
                views = [(await admin.get(f"{a}/api/v1/endpoints")).json()["replica_sync"] for a in admins]
                return all(v["connected"] and len(v["peers"]) == 1 for v in views)

            await wait_until(both_synced, proc=proc, what="both workers up and hearing each other", timeout_s=60)
            settings = RunSettings(
                extproc=("127.0.0.1", grpc_base),
                extproc_replicas=[("127.0.0.1", grpc_base + 1)],
                endpoints=[("127.0.0.1", e.port) for e in engines.serving],
            )
            envoy = EnvoyProcess(rewrite_config(load_envoy_config("fail-closed"), settings), workdir=workdir, name="envoy-workers")
            await envoy.start()
            engines.clear()
            async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as client:
                replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(f"hi {i}", max_tokens=8)) for i in range(40)))
            assert [r.status_code for r in replies] == [200] * 40
            assert len(engines.a.received) + len(engines.b.received) == 40 and engines.a.received and engines.b.received
            routed = [_routed((await admin.get(f"{a}/metrics")).text) for a in admins]
            assert sum(routed) == 40 and all(n > 0 for n in routed), routed
        await envoy.aclose()
        envoy = None
        proc.stop(timeout_s=20)
        assert proc.returncode == 0, proc.log_tail()
        assert all(_port_free(p) for p in (grpc_base, grpc_base + 1, admin_base, admin_base + 1))
        assert "2 workers" in proc.log_tail() and "share picks through Redis" in proc.log_tail()
    finally:
        if envoy is not None:
            await envoy.aclose()
        await proc.astop()
        await redis.stop()
