"""`llm-extproc pd-sidecar` against simulators in prefill and decode roles: the two-step NIXL
protocol, the port-exact allow-list, bounded prefill retries, no silent local recompute."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.pd.sidecar import PDSidecar, discovered_prefillers, static_prefillers
from extproc.server.responses import PREFILLER_HEADER
from extproc.stack.ports import free_port
from tests.sim.test_sim_pd import PROMPT, metric, state
from tests.sim.test_sim_http import sse_json


@pytest.fixture
async def sidecars():
    made: list[PDSidecar] = []

    async def start(decode_url: str, allows, **kw) -> PDSidecar:
        s = PDSidecar(decode_url, allows, **kw)
        await s.start()
        made.append(s)
        return s

    yield start
    for s in made:
        await s.aclose()


async def send(http, sidecar: PDSidecar, body: dict, prefiller: str | None = None):
    headers = {"content-type": "application/json"}
    if prefiller is not None:
        headers[PREFILLER_HEADER] = prefiller
    async with http.post(f"http://127.0.0.1:{sidecar.port}/v1/chat/completions", data=orjson.dumps(body), headers=headers) as resp:
        return resp.status, await resp.read()


async def requests_seen(http, sim) -> float:
    return await metric(http, sim, "vllm:request_success_total")


async def test_two_step_protocol_rewrites_cached_tokens_and_streams_untouched(start_sim, http, sidecars):
    p = await start_sim(role="prefill")
    d = await start_sim(role="decode")
    side = await sidecars(d.url, static_prefillers([f"127.0.0.1:{p.port}"]))
    status, raw = await send(http, side, {"messages": PROMPT, "max_tokens": 4, "ignore_eos": True}, f"127.0.0.1:{p.port}")
    assert status == 200, raw
    answer = orjson.loads(raw)
    # The decode engine counted the pulled prompt as cached; the client sees the prefill side's count.
    assert answer["usage"]["completion_tokens"] == 4 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await state(http, p))["kv_holds"] == 0 and await requests_seen(http, p) == 1
    assert await metric(http, d, "vllm:nixl_bytes_transferred_count") == 1
    # A second identical prompt: the prefill engine's prefix cache now holds it, and says so.
    status, raw = await send(http, side, {"messages": PROMPT, "max_tokens": 2}, f"127.0.0.1:{p.port}")
    assert orjson.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 1000
    # Streaming: the decode engine's SSE comes through as it sent it.
    body = {"messages": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    status, raw = await send(http, side, body, f"127.0.0.1:{p.port}")
    events = sse_json(raw)
    assert status == 200 and events[-1]["usage"]["completion_tokens"] == 3
    assert side.counts["disaggregated"] == 3
    # No header: plain pass-through to the decode engine, which prefills itself.
    status, raw = await send(http, side, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200 and side.counts["passthrough"] == 1 and await requests_seen(http, p) == 3


async def test_only_listed_prefill_host_port_pairs_are_reached(start_sim, http, sidecars):
    p = await start_sim(role="prefill")
    d = await start_sim(role="decode")
    store = Datastore([
        EndpointConfig(address=f"127.0.0.1:{p.port}", models=["m"], role="prefill"),
        EndpointConfig(address=f"127.0.0.1:{d.port}", models=["m"], role="decode"),
    ])  # fmt: skip
    side = await sidecars(d.url, discovered_prefillers(store))
    body = {"messages": PROMPT, "max_tokens": 2}
    # Same IP, another port (llm-d-router #979); a decode-only endpoint; metadata; garbage.
    for forged in (f"127.0.0.1:{p.port + 1}", f"127.0.0.1:{d.port}", "169.254.169.254:80", "not-a-host-port"):
        status, raw = await send(http, side, body, forged)
        assert status == 403 and b"prefiller_not_allowed" in raw and b'"PermissionDeniedError"' in raw, forged
    assert side.counts["forbidden"] == 4 and await requests_seen(http, p) == 0 and await requests_seen(http, d) == 0
    # The listed pair works; once discovery drains it, it is refused again.
    assert (await send(http, side, body, f"127.0.0.1:{p.port}"))[0] == 200
    store.drain_endpoint(f"127.0.0.1:{p.port}")
    assert (await send(http, side, body, f"127.0.0.1:{p.port}"))[0] == 403


async def test_a_failed_prefill_is_retried_a_bounded_number_of_times_and_never_recomputed_silently(start_sim, http, sidecars):
    d = await start_sim(role="decode")
    dead = f"127.0.0.1:{free_port()}"  # allowed, but nothing listens there
    side = await sidecars(d.url, static_prefillers([dead]), prefill_retries=2, retry_backoff_s=0.01)
    status, raw = await send(http, side, {"messages": PROMPT, "max_tokens": 2}, dead)
    assert status == 502 and b"prefill_failed" in raw and b'"BadGatewayError"' in raw
    assert side.counts["prefill_retries"] == 2 and await requests_seen(http, d) == 0
    # Configured to, it decodes locally instead (counted).
    fallback = await sidecars(d.url, static_prefillers([dead]), prefill_retries=0, local_fallback=True)
    status, raw = await send(http, fallback, {"messages": PROMPT, "max_tokens": 2}, dead)
    assert status == 200 and fallback.counts["local_fallback"] == 1 and await requests_seen(http, d) == 1


def test_static_allow_list_needs_ports():
    assert static_prefillers(["[2001:DB8::1]:8000"])("[2001:db8::1]:8000")
    assert not static_prefillers(["10.0.0.1:8000"])("10.0.0.1:8001")
    with pytest.raises(ValueError):
        static_prefillers(["10.0.0.1"])


@pytest.fixture
async def fake_engine():
    """A stand-in engine on `host` (127.0.0.1 or ::1): answers every POST with the `answer`
    bytes given, after `delay_s` seconds, and records the bodies it got."""
    from aiohttp import web

    runners: list[web.AppRunner] = []

    async def start(answer: bytes, host: str = "127.0.0.1", delay_s: float = 0.0):
        seen: list[bytes] = []

        async def handle(request: web.Request) -> web.Response:
            seen.append(await request.read())
            await asyncio.sleep(delay_s)
            return web.Response(body=answer, content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        runners.append(runner)
        return site._server.sockets[0].getsockname()[1], seen  # type: ignore[union-attr]

    yield start
    for r in runners:
        await r.cleanup()


DECODED = orjson.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": [1]}})


@pytest.mark.parametrize("usage", ["text", [1], {"prompt_tokens_details": "x"}, {"prompt_tokens_details": {"cached_tokens": True}}])
async def test_a_prefill_answer_with_odd_usage_still_decodes(http, sidecars, fake_engine, usage):
    pport, _ = await fake_engine(orjson.dumps({"kv_transfer_params": {"remote_block_ids": [1]}, "usage": usage}))
    dport, decoded = await fake_engine(DECODED)
    side = await sidecars(f"http://127.0.0.1:{dport}", static_prefillers([f"127.0.0.1:{pport}"]))
    status, raw = await send(http, side, {"messages": PROMPT, "max_tokens": 2}, f"127.0.0.1:{pport}")
    assert status == 200, raw
    assert orjson.loads(raw)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert orjson.loads(decoded[0])["kv_transfer_params"] == {"remote_block_ids": [1]}


async def test_a_huge_prefill_answer_fails_the_prefill_without_being_read_whole(http, sidecars, fake_engine):
    pport, _ = await fake_engine(orjson.dumps({"kv_transfer_params": {"pad": "x" * 300_000}}))
    dport, decoded = await fake_engine(DECODED)
    side = await sidecars(f"http://127.0.0.1:{dport}", static_prefillers([f"127.0.0.1:{pport}"]), max_prefill_answer_bytes=100_000)
    status, raw = await send(http, side, {"messages": PROMPT, "max_tokens": 2}, f"127.0.0.1:{pport}")
    assert status == 502 and b"over 100000 bytes" in raw and not decoded


async def test_an_unbracketed_ipv6_prefiller_reaches_the_allowed_address(http, sidecars, fake_engine):
    pport, prefilled = await fake_engine(orjson.dumps({"kv_transfer_params": {}}), host="::1")
    dport, _ = await fake_engine(DECODED)
    side = await sidecars(f"http://127.0.0.1:{dport}", static_prefillers([f"[::1]:{pport}"]))
    status, raw = await send(http, side, {"messages": PROMPT, "max_tokens": 2}, f"::1:{pport}")
    assert status == 200, raw
    assert len(prefilled) == 1


async def test_a_prefill_that_hangs_is_not_retried(http, sidecars, fake_engine):
    """A retry would double the load of an engine already too slow, and the client's wait."""
    pport, prefilled = await fake_engine(orjson.dumps({"kv_transfer_params": {}}), delay_s=5.0)
    dport, decoded = await fake_engine(DECODED)
    side = await sidecars(f"http://127.0.0.1:{dport}", static_prefillers([f"127.0.0.1:{pport}"]), prefill_retries=2, prefill_timeout_s=0.2)
    status, raw = await send(http, side, {"messages": PROMPT, "max_tokens": 2}, f"127.0.0.1:{pport}")
    assert status == 502 and b"no answer within 0.2 s" in raw
    assert len(prefilled) == 1 and side.counts["prefill_retries"] == 0 and not decoded


async def test_a_port_in_use_leaves_nothing_open(sidecars):
    first = await sidecars("http://127.0.0.1:1", static_prefillers(["127.0.0.1:2"]))
    second = PDSidecar("http://127.0.0.1:1", static_prefillers(["127.0.0.1:2"]), port=first.port)
    with pytest.raises(OSError):
        await second.start()
    assert second._runner is None and second._http is None  # no runner, no client session to close
