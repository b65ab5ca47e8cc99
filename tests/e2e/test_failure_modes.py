"""When llm-extproc is slow or gone: envoy/fail-open.yaml falls back to least-request over the
same engines, envoy/fail-closed.yaml answers with our JSON error. Client-supplied routing headers
reach nothing either way.

Tests run in file order: those needing the server come first; `server_stopped` then stops it
for the rest of the module.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.stack.envoy import EnvoyProcess
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import Engines, assert_openai_error, chat, start_envoy

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def envoys(
    workdir: Path, extproc_server: ExtProcServerProcess, engines: Engines
) -> AsyncIterator[dict[str, EnvoyProcess]]:
    """fail-open and fail-closed Envoys in front of the same server, plus an "impatient" pair
    whose ext_proc message_timeout (1 ms) no real decision on a long prompt can meet."""
    started: dict[str, EnvoyProcess] = {}
    try:
        for name in ("fail-open", "fail-closed"):
            common = {"workdir": workdir, "server": extproc_server, "engines": engines}
            started[name] = await start_envoy(name, **common)
            started[f"{name}-impatient"] = await start_envoy(name, message_timeout="0.001s", **common)
        yield started
    finally:
        for envoy in started.values():
            await envoy.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def client(engines: Engines) -> AsyncIterator[httpx.AsyncClient]:
    engines.clear()
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        yield c


def _forged(engines: Engines) -> dict[str, str]:
    """Routing headers a client forges: the intruder as destination, a made-up token count."""
    return {"x-gateway-destination-endpoint": engines.intruder.address, "x-llm-prompt-tokens": "1"}


def _long_prompt() -> str:
    # ~10k tokens of fresh text: tokenizing it alone takes far longer than 1 ms.
    return " ".join(str(random.random()) for _ in range(5000))


@pytest.mark.parametrize("name", ["fail-open", "fail-closed"])
async def test_both_route_through_the_server_while_it_is_up(
    name: str, envoys: dict[str, EnvoyProcess], engines: Engines, client: httpx.AsyncClient
) -> None:
    r = await client.post(f"{envoys[name].url}/v1/chat/completions", json=chat(), headers=_forged(engines))
    assert r.status_code == 200, r.text
    engine = engines.by_name(r.headers["x-backend"])
    assert engine in engines.serving
    (rec,) = engine.received
    assert rec.header("x-gateway-destination-endpoint") == engine.address.encode()
    assert engines.intruder.received == []


async def test_slow_decision_fails_open_to_the_fallback(
    envoys: dict[str, EnvoyProcess], engines: Engines, client: httpx.AsyncClient
) -> None:
    url = f"{envoys['fail-open-impatient'].url}/v1/chat/completions"
    r = await client.post(url, json=chat(_long_prompt()), headers=_forged(engines))
    assert r.status_code == 200, r.text
    (rec,) = engines.by_name(r.headers["x-backend"]).received
    # No decision arrived in time: the fallback cluster carried it, no routing header upstream.
    assert rec.header("x-gateway-destination-endpoint") is None
    assert rec.header("x-llm-prompt-tokens") is None
    assert engines.intruder.received == []


async def test_slow_decision_fails_closed_with_a_json_504(
    envoys: dict[str, EnvoyProcess], engines: Engines, client: httpx.AsyncClient
) -> None:
    url = f"{envoys['fail-closed-impatient'].url}/v1/chat/completions"
    error = assert_openai_error(await client.post(url, json=chat(_long_prompt()), headers=_forged(engines)), 504)
    assert error["code"] == "routing_timeout"
    assert not any(e.received for e in (engines.a, engines.b, engines.intruder))


@pytest_asyncio.fixture(loop_scope="module")
async def server_stopped(extproc_server: ExtProcServerProcess) -> None:
    await extproc_server.aclose()
    assert not extproc_server.process.running


@pytest.mark.usefixtures("server_stopped")
async def test_server_down_fail_open_takes_the_fallback(
    envoys: dict[str, EnvoyProcess], engines: Engines, client: httpx.AsyncClient
) -> None:
    base = envoys["fail-open"].url
    for i in range(8):
        r = await client.post(f"{base}/v1/chat/completions", json=chat(f"down {i}"), headers=_forged(engines))
        assert r.status_code == 200, r.text
        assert r.headers["x-backend"] in ("a", "b")
    r = await client.get(f"{base}/v1/models", headers=_forged(engines))
    assert r.status_code == 200
    assert engines.intruder.received == []
    received = [rec for e in engines.serving for rec in e.received]
    assert len(received) == 9
    for rec in received:  # the forged headers were stripped, and nobody set new ones
        assert rec.header("x-gateway-destination-endpoint") is None
        assert rec.header("x-llm-prompt-tokens") is None


@pytest.mark.usefixtures("server_stopped")
@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/chat/completions"), ("GET", "/v1/models")], ids=["chat", "models"])
async def test_server_down_fail_closed_answers_json_503(
    method: str, path: str, envoys: dict[str, EnvoyProcess], engines: Engines, client: httpx.AsyncClient
) -> None:
    body = chat() if method == "POST" else None
    r = await client.request(method, f"{envoys['fail-closed'].url}{path}", json=body, headers=_forged(engines))
    error = assert_openai_error(r, 503)
    assert error["code"] == "routing_unavailable"
    assert error["type"] == "service_unavailable"
    assert not any(e.received for e in (engines.a, engines.b, engines.intruder))
