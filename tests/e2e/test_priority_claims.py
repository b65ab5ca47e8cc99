"""Priority claims through Envoy (issue 18.5): at saturation a client's own `critical` —
however spelled — is shed like standard traffic; only the trusted header admits it."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.stack.envoy import EnvoyProcess
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import MODEL, Engines, assert_openai_error, chat, start_envoy, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

TRUSTED = "x-trusted-priority"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(workdir: Path, engines: Engines) -> AsyncIterator[tuple[EnvoyProcess, ExtProcServerProcess]]:
    config = {
        "models": [{"name": MODEL, "aliases": ["qwen3-8b"]}],
        "endpoints": [{"address": e.address, "models": [MODEL]} for e in engines.serving],
        # 4 waiting requests per engine = saturation 1.0: standard shed, critical not.
        "admission": {"priority": {"queue_saturation_depth": 4, "trusted_header": TRUSTED}},
        "scheduling": {"metrics": {"interval_s": 0.05}},
    }
    server = await start_server(workdir, config, "priority-server")
    envoy = await start_envoy("fail-closed", workdir=workdir, server=server, engines=engines)
    try:
        yield envoy, server
    finally:
        await envoy.aclose()
        await server.aclose()


async def test_a_client_cannot_claim_critical_at_saturation(gateway, engines):
    envoy, server = gateway
    for e in engines.serving:
        e.waiting = 5
    try:
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
            for _ in range(100):  # until a scrape has seen the queues
                r = await c.post("/v1/chat/completions", json=chat(max_tokens=4))
                if r.status_code == 429:
                    break
                await asyncio.sleep(0.05)
            assert assert_openai_error(r, 429)["code"] == "shed_standard"
            # (`critical\t` is checked over gRPC: HTTP clients refuse to send blanks around a value.)
            for claim in ("critical", "CRITICAL", "CrItIcAl", "Critical"):
                r = await c.post("/v1/chat/completions", json=chat(max_tokens=4), headers={"x-llm-priority": claim})
                assert assert_openai_error(r, 429)["code"] == "shed_standard", claim
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=4), headers={TRUSTED: "critical"})
            assert r.status_code == 200, r.text
            metrics = (await c.get(f"{server.admin_url}/metrics")).text
        found = re.search(r'^llm_extproc_priority_claims_bounded_total\{action="downgraded",claimed="critical"\} (\S+)$', metrics, re.M)
        assert found and float(found.group(1)) == 4.0
    finally:
        for e in engines.serving:
            e.waiting = 0


async def test_a_downgraded_claim_is_told_on_the_response(gateway):
    """A client that claims `critical` without the right runs as standard: the response says so
    (`x-llm-priority-applied: standard`); a claim within the bound, or the trusted header's,
    gets no such header."""
    envoy, _ = gateway
    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
        for _ in range(100):  # until a scrape has seen the queues of the test before drain
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=4), headers={"x-llm-priority": "critical"})
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
        assert r.status_code == 200, r.text
        assert r.headers["x-llm-priority-applied"] == "standard"
        for headers in ({"x-llm-priority": "sheddable"}, {TRUSTED: "critical"}, {}):
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=4), headers=headers)
            assert r.status_code == 200 and "x-llm-priority-applied" not in r.headers, headers
