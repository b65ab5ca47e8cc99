"""Tier mode through a real Envoy (envoy/tier.yaml): llm-extproc sets x-llm-tier from the prompt
length, Envoy routes each band to its own cluster, and a failing health check ejects an engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import yaml

from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import ALIAS, MODEL
from tests.e2e.fake_engines import Backend

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

TIERS = ("low-latency", "balanced", "high-throughput")


@pytest.fixture(scope="module")
def tier_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tier")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tier_engines() -> AsyncIterator[dict[str, Backend]]:
    # One engine per tier plus a spare in the balanced tier (for the ejection test).
    engines = {t: Backend(t) for t in TIERS} | {"balanced-2": Backend("balanced-2")}
    for e in engines.values():
        await e.start()
    try:
        yield engines
    finally:
        for e in engines.values():
            await e.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tier_stack(tier_workdir: Path, tier_engines: dict[str, Backend]) -> AsyncIterator[EnvoyProcess]:
    config = {
        "models": [{"name": MODEL, "aliases": [ALIAS], "max_model_len": 40960}],
        "endpoints": [{"address": e.address, "models": [MODEL]} for e in tier_engines.values()],
        "scheduling": {"mode": "tier", "tiers": {"low_latency_below": 512, "high_throughput_above": 2048}},
    }
    path = tier_workdir / "tier.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    server = ExtProcServerProcess(path, workdir=tier_workdir)
    await server.start()
    e = tier_engines
    # Each engine answers its own health check here (a node agent would, on its own port).
    clusters = {
        "llm_tier_low_latency": [("127.0.0.1", e["low-latency"].port, e["low-latency"].port)],
        "llm_tier_balanced": [("127.0.0.1", b.port, b.port) for b in (e["balanced"], e["balanced-2"])],
        "llm_tier_high_throughput": [("127.0.0.1", e["high-throughput"].port, e["high-throughput"].port)],
    }
    cfg = rewrite_config(
        load_envoy_config("tier"),
        RunSettings(extproc=server.grpc_address, endpoints=[("127.0.0.1", x.port) for x in e.values()], clusters=clusters),
    )
    for cluster in cfg["static_resources"]["clusters"]:
        for hc in cluster.get("health_checks", []):
            hc["interval"] = "0.2s"
            hc["no_traffic_interval"] = "0.2s"
    envoy = EnvoyProcess(cfg, workdir=tier_workdir, name="envoy-tier")
    await envoy.start()
    try:
        yield envoy
    finally:
        await envoy.aclose()
        await server.aclose()


async def _send(envoy: EnvoyProcess, words: int, **headers: str) -> httpx.Response:
    body = {"model": ALIAS, "messages": [{"role": "user", "content": " ".join(["token"] * words)}], "max_tokens": 8}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as c:
        return await c.post(f"{envoy.url}/v1/chat/completions", json=body, headers=headers)


@pytest.mark.parametrize(
    ("words", "tier"),
    [(10, "low-latency"), (1000, "balanced"), (5000, "high-throughput")],
    ids=TIERS,
)
async def test_each_length_band_reaches_its_tier_cluster(tier_stack, tier_engines, words, tier):
    for e in tier_engines.values():
        e.clear()
    r = await _send(tier_stack, words)
    assert r.status_code == 200, r.text
    got = [name for name, e in tier_engines.items() if e.received]
    expected = {"balanced", "balanced-2"} if tier == "balanced" else {tier}
    assert len(got) == 1 and got[0] in expected
    (rec,) = tier_engines[got[0]].received
    assert rec.header("x-llm-tier") == tier.encode()
    assert rec.header("x-gateway-destination-endpoint") is None


async def test_a_client_cannot_choose_its_tier(tier_stack, tier_engines):
    for e in tier_engines.values():
        e.clear()
    r = await _send(tier_stack, 10, **{"x-llm-tier": "high-throughput"})
    assert r.status_code == 200
    assert tier_engines["low-latency"].received and not tier_engines["high-throughput"].received


async def test_failing_health_check_ejects_an_engine_from_its_tier(tier_stack, tier_engines):
    sick = tier_engines["balanced"]
    sick.failing_health = True
    try:
        await asyncio.sleep(1.0)  # unhealthy_threshold 2 × 0.2 s interval, with margin
        for e in tier_engines.values():
            e.clear()
        for _ in range(6):
            assert (await _send(tier_stack, 1000)).status_code == 200
        assert not sick.received and len(tier_engines["balanced-2"].received) == 6
    finally:
        sick.failing_health = False
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # restored once its checks pass again
        for e in tier_engines.values():
            e.clear()
        for _ in range(6):
            await _send(tier_stack, 1000)
        if sick.received:
            break
        await asyncio.sleep(0.3)
    assert sick.received
