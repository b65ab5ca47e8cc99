"""Prefix- and session-affinity decisions against real simulated engines (in-process
`SimServer`s scraped by a real `ExtProcApp`, decisions over a real gRPC ext_proc stream)."""

from __future__ import annotations

import asyncio
import collections

import httpx
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from .test_with_simulator import MODEL, stack  # noqa: F401 - the fixture
from .test_with_simulator import until

FOUR = ({"speed": 20},) * 4


async def choose(stub, text: str, *, max_tokens: int = 16, session: str | None = None, hold: bool = False):
    """One decision for a chat with `text` as its user message: the chosen endpoint (and the
    open call when `hold`, so the request stays in flight)."""
    hdrs = {":method": b"POST", ":path": b"/v1/chat/completions"}
    if session:
        hdrs["x-session-id"] = session.encode()
    call = stub.Process()
    await call.write(
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in hdrs.items()]))
        )
    )
    await call.read()
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    reply = await call.read()
    chosen = {h.header.key: h.header.raw_value.decode() for h in reply.request_body.response.header_mutation.set_headers}["x-gateway-destination-endpoint"]
    if hold:
        return chosen, call
    call.cancel()
    return chosen


def long_text(tokens: int, tag: str = "doc") -> str:
    return f"{tag} " + " ".join(f"w{i % 97}" for i in range(tokens))


async def test_second_identical_long_prompt_follows_the_first(stack):  # noqa: F811
    app, sims, stub = await stack(*FOUR)
    for trial in range(5):
        text = long_text(4000, f"t{trial}")
        first, call = await choose(stub, text, hold=True)
        await asyncio.sleep(0.005)
        second, call2 = await choose(stub, text, hold=True)
        assert second == first
        call.cancel()
        call2.cancel()


async def test_identical_short_prompts_spread(stack):  # noqa: F811
    app, sims, stub = await stack(*FOUR)
    prompt = long_text(30, "short")  # several full blocks, under min_match_tokens (128 tokens)
    counts = collections.Counter([await choose(stub, prompt) for _ in range(200)])
    assert len(counts) == 4 and min(counts.values()) >= 20, counts
    # the prompt's blocks are indexed, but a match under min_match_tokens carried no affinity
    assert all(app.prefix.describe(ep)["predicted_hit_tokens"] == 0 for ep in app.store.all())


async def test_burst_of_identical_long_prompts_spreads_once_the_warm_queue_costs_more(stack):  # noqa: F811
    app, sims, stub = await stack(*FOUR)
    text = long_text(3000, "burst")
    held = await asyncio.gather(*(choose(stub, text, max_tokens=256, hold=True) for _ in range(50)))
    counts = collections.Counter(addr for addr, _ in held)
    assert len(counts) >= 3 and max(counts.values()) <= 25, counts
    for _, call in held:
        call.cancel()


async def test_long_streams_spread_over_identical_engines(stack):  # noqa: F811
    app, sims, stub = await stack(*FOUR)
    held = []
    for i in range(20):
        held.append(await choose(stub, f"tell me a long story number {i}", max_tokens=3000, hold=True))
        await asyncio.sleep(0.05)
    counts = collections.Counter(addr for addr, _ in held)
    assert max(counts.values()) <= 7, counts
    for _, call in held:
        call.cancel()


async def test_a_restarted_engine_loses_its_affinity(stack):  # noqa: F811
    app, sims, stub = await stack(*FOUR)
    text = long_text(2000, "restart")
    first = await choose(stub, text)
    assert await choose(stub, text) == first
    sim = next(s for s in sims if f"127.0.0.1:{s.port}" == first)
    ep = app.store.get(first)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        # the engine serves the prompt (its prefix-cache counters move), then restarts
        r = await c.post(f"{sim.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2})
        assert r.status_code == 200
        await until(lambda: ep.engine is not None and ep.engine.prefix_queries > 0)
        assert app.prefix.index.blocks(first) > 0
        r = await c.post(f"{sim.url}/sim/faults", json={"restart": True})
        assert r.status_code == 200
    await until(lambda: app.prefix.index.blocks(first) == 0)
    assert app.prefix.describe(ep)["resets"] == 1


async def test_session_header_keeps_a_conversation_on_one_endpoint_while_load_allows(stack):  # noqa: F811
    app, sims, stub = await stack(*FOUR)
    turns = [await choose(stub, f"short turn {i}", session="conv-1") for i in range(10)]
    assert len(set(turns)) == 1
    bound = turns[0]
    # load the bound endpoint far beyond the others: the session yields
    ep = app.store.get(bound)
    r = app.store.reserve(ep, prompt_tokens=200_000, context_tokens=200_000)
    try:
        moved = await choose(stub, "short turn 11", session="conv-1")
        assert moved != bound
        assert await choose(stub, "short turn 12", session="conv-1") == moved  # then it stays there
    finally:
        r.release()


async def test_a_hot_prefix_is_warmed_onto_a_cold_endpoint(stack):  # noqa: F811
    """Opt-in warm-up: once a shared prefix is hot and only one endpoint holds it, one cold
    endpoint gets a max_tokens=1 request with the prefix, and then holds it (in its real
    prefix cache and in the index)."""
    app, sims, stub = await stack(
        *FOUR,
        scheduling={
            "metrics": {"interval_s": 0.05, "timeout_s": 0.2, "stale_after_s": 0.5},
            "health_check": {"interval_s": 0.2},
            "prefix": {"hot": {"min_count": 3}, "warmup": {"enabled": True, "max_per_s": 5, "replicas": 2}},
        },
    )
    system = long_text(1500, "system")
    holders = {await choose(stub, system + f" question {i}") for i in range(6)}
    assert len(holders) >= 1
    metric = app.metrics.registry.get_sample_value
    await until(lambda: (metric("llm_extproc_prefix_warmups_total", {"outcome": "ok"}) or 0) >= 1)
    # (decisions alone send nothing to the engines: only the warm-up reached one)
    warmed = [f"127.0.0.1:{s.port}" for s in sims if s.engine.pool.num_cached >= 90]
    assert len(warmed) == 1 and warmed[0] not in holders  # it really prefilled the prefix on a cold engine
    held = [f"127.0.0.1:{s.port}" for s in sims if app.prefix.index.blocks(f"127.0.0.1:{s.port}") >= 90]
    assert warmed[0] in held and len(held) >= 2
    # The warm-up counted in flight on its endpoint (no decision went there), and let go after.
    assert app.store.get(warmed[0]).routed_total == 1
    await until(lambda: app.store.open_reservations == 0)


async def test_decisions_explain_matched_blocks_and_the_admin_api_shows_the_index(stack):  # noqa: F811
    from extproc.types import RequestKind

    app, sims, stub = await stack(*FOUR[:2])
    text = long_text(1000, "explain")
    first = await choose(stub, text)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8})
    routed = await app.pipeline.route(RequestKind.CHAT, body)
    line = routed.explain()
    assert routed.endpoint.address == first
    blocks = app.prefix.index.blocks(first)
    assert f"{first} matched={blocks}blk/{blocks * 16}tok" in line and "ttft=" in line, line
    async with httpx.AsyncClient(trust_env=False) as c:
        shown = (await c.get(f"http://127.0.0.1:{app.admin_port}/api/v1/endpoints")).json()
    assert shown["prefix_index"]["entries"] == blocks and shown["prefix_index"]["bytes"] > 0
    by_addr = {e["address"]: e for e in shown["endpoints"]}
    assert by_addr[first]["prefix"]["blocks"] == blocks and by_addr[first]["prefix"]["source"] == "approximate"
    assert by_addr[first]["prefix"]["predicted_hit_rate"] == 0.0  # the first of that prompt hit nothing
    assert by_addr[first]["prefill_samples"] == 0 and set(by_addr[first]["prefill_fit"]) == {"t0_s", "s_per_token"}
