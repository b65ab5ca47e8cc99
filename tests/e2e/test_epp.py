"""End to end through a real Envoy configured as the Endpoint Picker Protocol's gateways
configure their picker (`extproc.stack.epp_envoy`: FULL_DUPLEX_STREAMED, trailers SEND,
ORIGINAL_DST from the destination header or from the `envoy.lb` metadata), with
`llm-extproc serve` in `protocol.mode: epp` as the picker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
import pytest_asyncio

from extproc.stack.envoy import EnvoyProcess
from extproc.stack.epp_envoy import gateway_config
from extproc.stack.ports import free_port
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import ALIAS, DEAD_MODEL, MODEL, Engines, assert_openai_error, chat, start_envoy, start_server
from tests.e2e.fake_engines import JSON_BODY, SSE_BODY

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def picker(workdir: Path, engines: Engines) -> AsyncIterator[ExtProcServerProcess]:
    config = {
        "models": [{"name": MODEL, "aliases": [ALIAS], "max_model_len": 131072}, {"name": DEAD_MODEL, "path": "builtin:qwen3-8b"}],
        "endpoints": [
            *({"address": e.address, "models": [MODEL]} for e in engines.serving),
            {"address": f"127.0.0.1:{free_port()}", "models": [DEAD_MODEL]},
        ],
        "scheduling": {"health_check": {"interval_s": 0.25, "timeout_s": 2.0, "unhealthy_threshold": 3}},
        "protocol": {"mode": "epp"},
    }
    server = await start_server(workdir, config, "epp-picker")
    try:
        yield server
    finally:
        await server.aclose()


async def _envoy(workdir: Path, picker: ExtProcServerProcess, name: str, **kw) -> EnvoyProcess:
    envoy = EnvoyProcess(gateway_config(picker.grpc_port, **kw), workdir=workdir, name=name)
    await envoy.start()
    return envoy


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def by_header(workdir: Path, picker: ExtProcServerProcess) -> AsyncIterator[EnvoyProcess]:
    envoy = await _envoy(workdir, picker, "epp-header")
    try:
        yield envoy
    finally:
        await envoy.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateways(workdir: Path, picker: ExtProcServerProcess, by_header: EnvoyProcess) -> AsyncIterator[dict[str, EnvoyProcess]]:
    """Both routings: ORIGINAL_DST from the header, and from the envoy.lb metadata alone."""
    envoy = await _envoy(workdir, picker, "epp-metadata", routing="metadata")
    try:
        yield {"header": by_header, "metadata": envoy}
    finally:
        await envoy.aclose()


async def metric(picker: ExtProcServerProcess, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the picker's /metrics samples `name` whose labels include `labels` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(trust_env=False) as c:
        text = (await c.get(f"{picker.admin_url}/metrics")).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items())
    )


def served_by(engines: Engines, response: httpx.Response):
    """The engine that answered, checked against the one that recorded the request."""
    engine = engines.by_name(response.headers["x-backend"])
    assert engine in engines.serving
    return engine


@pytest.mark.parametrize("routing", ["header", "metadata"])
async def test_chat_is_routed_and_answered_byte_for_byte(gateways, engines, picker, routing):
    gateway = gateways[routing]
    engines.clear()
    before = await metric(picker, "llm_extproc_epp_served_total", {"endpoint": "primary"})
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=30) as c:
        for i in range(6):
            body = orjson.dumps(chat(f"hello {i}", max_tokens=8))
            r = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            assert r.content == JSON_BODY
            engine = served_by(engines, r)
            got = engine.received[-1]
            assert orjson.loads(got.body) == {**orjson.loads(body), "model": MODEL}, "the alias reaches the engine as the served name"
    assert not engines.intruder.received
    # The Lua filter reported each served endpoint in envoy.lb; it was the primary every time.
    assert await metric(picker, "llm_extproc_epp_served_total", {"endpoint": "primary"}) == before + 6


async def test_sse_stream_comes_back_byte_for_byte(by_header, engines):
    async with httpx.AsyncClient(base_url=by_header.url, trust_env=False, timeout=30) as c:
        async with c.stream("POST", "/v1/chat/completions", json={**chat("stream please"), "stream": True}) as r:
            assert r.status_code == 200
            got = b"".join([chunk async for chunk in r.aiter_raw()])
    assert got == SSE_BODY


async def test_220kb_prompt_in_many_chunks_reaches_the_engine_whole(by_header, engines, picker):
    engines.clear()
    words = " ".join(f"token{i % 1013}" for i in range(25_000))
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 4})
    assert 200_000 < len(body) < 260_000

    async def pieces():
        for i in range(0, len(body), 8192):  # chunked transfer: Envoy passes it on in several body messages
            yield body[i : i + 8192]

    async with httpx.AsyncClient(base_url=by_header.url, trust_env=False, timeout=60) as c:
        r = await c.post("/v1/chat/completions", content=pieces(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    engine = served_by(engines, r)
    (got,) = engine.received
    assert got.body == body
    assert not engines.intruder.received


async def test_a_client_cannot_choose_the_endpoint(by_header, engines):
    engines.clear()
    async with httpx.AsyncClient(base_url=by_header.url, trust_env=False, timeout=30) as c:
        for _ in range(4):
            r = await c.post("/v1/chat/completions", json=chat(), headers={"x-gateway-destination-endpoint": engines.intruder.address})
            assert r.status_code == 200
    assert not engines.intruder.received


async def test_subset_hint_from_the_gateway_is_obeyed(workdir, picker, engines):
    envoy = await _envoy(workdir, picker, "epp-subset", subset=[engines.b.address])
    try:
        engines.clear()
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
            for i in range(8):
                r = await c.post("/v1/chat/completions", json=chat(f"subset {i}"))
                assert r.status_code == 200
                assert r.headers["x-backend"] == "b"
            r = await c.get("/v1/models")
            assert r.status_code == 200 and r.headers["x-backend"] == "b"
        assert not engines.a.received
        assert [r.path for r in engines.b.received] == ["/v1/chat/completions"] * 8 + ["/v1/models"]
    finally:
        await envoy.aclose()


async def test_requests_without_a_body_and_errors(by_header, picker):
    async with httpx.AsyncClient(base_url=by_header.url, trust_env=False, timeout=30) as c:
        r = await c.get("/v1/models")
        assert r.status_code == 200 and r.headers["x-backend"] in ("a", "b")
        # The dead model's only endpoint never answers its probes: the spec's 503.
        r = await c.post("/v1/chat/completions", json={"model": DEAD_MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert_openai_error(r, 503)
        r = await c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert_openai_error(r, 400)



async def wait_released(picker: ExtProcServerProcess, addresses: list[str], timeout_s: float = 10.0) -> None:
    """Until the picker holds no in-flight request on any of `addresses` (a stream ends a little
    after its response does)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        held = [await metric(picker, "llm_extproc_endpoint_inflight_requests", {"endpoint": a}) for a in addresses]
        if not any(held):
            return
        assert asyncio.get_running_loop().time() < deadline, f"still in flight: {held}"
        await asyncio.sleep(0.05)


async def test_every_reservation_is_released(by_header, picker, engines):
    async with httpx.AsyncClient(base_url=by_header.url, trust_env=False, timeout=30) as c:
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat(f"burst {i}", stream=i % 2 == 0)) for i in range(20)))
    assert all(r.status_code == 200 for r in rs)
    assert {r.headers["x-backend"] for r in rs} == {"a", "b"}, "load-aware spreads a burst"
    await wait_released(picker, [e.address for e in engines.serving])


async def test_a_client_hanging_up_mid_upload_leaves_nothing_open(by_header, picker, engines):
    engines.clear()
    sent = asyncio.Event()

    async def half_then_stall():
        yield orjson.dumps(chat("x" * 50_000))[:30_000]
        sent.set()
        await asyncio.sleep(30)  # never finishes: the client gives up first
        yield b"}"

    async with httpx.AsyncClient(base_url=by_header.url, trust_env=False, timeout=30) as c:
        task = asyncio.create_task(c.post("/v1/chat/completions", content=half_then_stall(), headers={"content-type": "application/json"}))
        await asyncio.wait_for(sent.wait(), 10)
        deadline = asyncio.get_running_loop().time() + 10
        while await metric(picker, "llm_extproc_grpc_streams_active") < 1:  # the picker holds the partial body
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    deadline = asyncio.get_running_loop().time() + 10
    while await metric(picker, "llm_extproc_grpc_streams_active") > 0:
        assert asyncio.get_running_loop().time() < deadline, "the stream of the abandoned upload is still open"
        await asyncio.sleep(0.05)
    await wait_released(picker, [e.address for e in engines.serving])
    assert not any(e.received for e in (engines.a, engines.b, engines.intruder)), "nothing was routed"


async def test_the_picker_behind_our_buffered_envoy_says_what_is_wrong(workdir, picker, engines):
    # A picker in epp mode behind envoy/fail-open.yaml (BUFFERED): a clear 500, not a hang.
    envoy = await start_envoy("fail-open", workdir=workdir, server=picker, engines=engines)
    try:
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=chat())
        error = assert_openai_error(r, 500)
        assert error["code"] == "proxy_mode_mismatch" and "protocol.mode: buffered" in error["message"]
    finally:
        await envoy.aclose()
