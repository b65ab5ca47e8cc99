"""The Endpoint Picker Protocol mode with the simulators: streamed generations through a
gateway-configured Envoy (FULL_DUPLEX_STREAMED both ways), response telemetry fed from the
streamed chunks, and a client that hangs up mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.sim.server import SimServer
from extproc.stack.envoy import EnvoyProcess
from extproc.stack.epp_envoy import gateway_config
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import assert_openai_error, in_process_sims, start_server
from tests.e2e.test_epp import metric, wait_released

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sims(qwen_counter) -> AsyncIterator[list[SimServer]]:
    async with in_process_sims(qwen_counter, 2, speed=20.0) as started:
        yield started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def picker(workdir: Path, sims: list[SimServer]) -> AsyncIterator[ExtProcServerProcess]:
    config = {
        "models": [{"name": MODEL}],
        "endpoints": [{"address": f"127.0.0.1:{s.port}", "models": [MODEL]} for s in sims],
        "protocol": {"mode": "epp"},
        "telemetry": {"sample_rate": 1.0},  # every response observed: the count below is exact
    }
    server = await start_server(workdir, config, "epp-sims-picker")
    try:
        yield server
    finally:
        await server.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(workdir: Path, picker: ExtProcServerProcess) -> AsyncIterator[EnvoyProcess]:
    envoy = EnvoyProcess(gateway_config(picker.grpc_port, routing="metadata"), workdir=workdir, name="epp-sims")
    await envoy.start()
    try:
        yield envoy
    finally:
        await envoy.aclose()


def body(i: int, max_tokens: int = 24) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}], "max_tokens": max_tokens, "stream": True}


async def test_streamed_generations_feed_telemetry(gateway, picker, sims):
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=60) as c:

        async def one(i: int) -> bytes:
            async with c.stream("POST", "/v1/chat/completions", json=body(i)) as r:
                assert r.status_code == 200
                return b"".join([chunk async for chunk in r.aiter_bytes()])

        streams = await asyncio.gather(*(one(i) for i in range(12)))
    for s in streams:
        assert s.rstrip().endswith(b"data: [DONE]")
        assert s.count(b'"content"') >= 1
    await wait_released(picker, [f"127.0.0.1:{s.port}" for s in sims])  # the observers close with their streams
    ttft = await metric(picker, "gen_ai_server_time_to_first_token_seconds_count")
    assert ttft == 12, "every streamed response's first token was seen through FULL_DUPLEX_STREAMED"


async def test_client_hanging_up_mid_stream_releases_everything(gateway, picker, sims):
    async with httpx.AsyncClient(base_url=gateway.url, trust_env=False, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body(99, max_tokens=4000)) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_bytes():
                if b'"content"' in chunk:
                    break  # hang up with most of the answer still to come
    await wait_released(picker, [f"127.0.0.1:{s.port}" for s in sims])


@pytest.mark.parametrize("error_body", [True, False], ids=["engine-json-body", "bare-500"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_engine_errors_reach_the_client_in_the_gateway_shape(gateway, picker, sims, error_body, stream):
    # An engine's own error body is held by the picker and rewritten with its last chunk; a bare
    # 5xx gets its body at the response headers. Both through FULL_DUPLEX_STREAMED.
    request = {**body(7, max_tokens=2), "stream": stream}
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        for s in sims:
            assert (await c.post(f"http://127.0.0.1:{s.port}/sim/faults", json={"error_rate": 1.0, "error_body": error_body})).status_code == 200
        try:
            r = await c.post(f"{gateway.url}/v1/chat/completions", json=request)
        finally:
            for s in sims:
                assert (await c.delete(f"http://127.0.0.1:{s.port}/sim/faults")).status_code == 200
    err = assert_openai_error(r, 500)
    assert err["message"]
    await wait_released(picker, [f"127.0.0.1:{s.port}" for s in sims])
