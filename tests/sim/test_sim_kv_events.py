"""The simulator publishes vLLM's KV-cache events for what its prefix cache stores and evicts
(`Engine.take_kv_events`, `extproc.sim.kv_publisher`), over a real ZMQ socket."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
import zmq
import zmq.asyncio

from extproc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, decode_seq
from extproc.sim.blocks import chain_block_hashes, wire_hash
from extproc.sim.engine import Engine, EngineConfig, SimRequest
from extproc.sim.profiles import get_profile
from extproc.sim.workload import synthetic_prompt_ids

CO = get_profile("h100-qwen3-8b").coefficients
BS = 16


def engine(blocks: int = 1000, **kw: int) -> Engine:
    return Engine(EngineConfig(num_gpu_blocks=blocks, block_size=BS, enable_kv_cache_events=True, **kw), CO)


def ids(n: int, seed: int) -> list[int]:
    return synthetic_prompt_ids(n, random.Random(seed))


def steps(eng: Engine) -> list[list]:
    """Run to idle, collecting each step's events (one batch per step, as vLLM publishes)."""
    out: list[list] = []
    eng.run(max_steps=1, on_step=lambda e: out.append(e.take_kv_events()))
    return [b for b in out if b]


def test_prompt_blocks_are_stored_with_tokens_and_parent_per_step() -> None:
    eng = engine(max_num_batched_tokens=64)  # chunked prefill: 4 blocks per step
    prompt = ids(200, 1)  # 12 full blocks + 8 tokens
    eng.add_request(SimRequest(prompt, 40, 0.0))
    batches = steps(eng)
    stored = [e for b in batches for e in b if isinstance(e, BlockStored)]
    hashes = [wire_hash(h) for h in chain_block_hashes(prompt, BS)]
    assert [len(e.block_hashes) for e in stored] == [4, 4, 4]  # one event per prefill step
    assert [h for e in stored for h in e.block_hashes] == hashes
    assert [e.parent_block_hash for e in stored] == [None, hashes[3], hashes[7]]
    for e in stored:
        first = hashes.index(e.block_hashes[0])
        assert list(e.token_ids) == prompt[first * BS : (first + len(e.block_hashes)) * BS]
        assert e.block_size == BS and e.medium == "GPU"
    # Blocks holding output tokens are cached but not announced (no token ids here): 239 tokens
    # computed (the last one is sampled, never computed) fill 14 blocks, 12 of them prompt-only.
    assert eng.pool.num_cached == 14


def test_a_prefix_hit_stores_only_the_new_blocks() -> None:
    eng = engine()
    prompt = ids(100, 2)
    eng.add_request(SimRequest(prompt, 4, 0.0))
    steps(eng)
    longer = prompt[:96] + ids(40, 3)
    eng.add_request(SimRequest(longer, 4, eng.now))
    stored = [e for b in steps(eng) for e in b if isinstance(e, BlockStored)]
    hashes = [wire_hash(h) for h in chain_block_hashes(longer, BS)]
    # 6 blocks hit; the 2 new full ones are computed in one step: one event, chained on block 6.
    assert len(stored) == 1 and stored[0].parent_block_hash == hashes[5]
    assert [h for e in stored for h in e.block_hashes] == hashes[6:]


def test_evictions_remove_exactly_what_was_stored() -> None:
    eng = engine(blocks=20)
    first = ids(160, 4)  # 10 blocks (+1 for output)
    eng.add_request(SimRequest(first, 1, 0.0))
    stored = {h for b in steps(eng) for e in b if isinstance(e, BlockStored) for h in e.block_hashes}
    assert len(stored) == 10
    # Two more prompts of 10 blocks each need the whole pool: every cached block is evicted.
    eng.add_request(SimRequest(ids(160, 5), 1, eng.now))
    eng.add_request(SimRequest(ids(160, 6), 1, eng.now))
    removed = [h for b in steps(eng) for e in b if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored <= set(removed)
    assert len(removed) == len(set(removed))  # each announced block removed once


def test_reset_prefix_cache_publishes_all_blocks_cleared() -> None:
    eng = engine()
    eng.add_request(SimRequest(ids(100, 7), 100, 0.0))
    eng.run(until=0.05, max_steps=1)
    assert not eng.pool.reset_prefix_cache()  # vLLM refuses while blocks are in use
    eng.run(max_steps=1)
    eng.take_kv_events()
    assert eng.pool.reset_prefix_cache()
    assert eng.take_kv_events() == [AllBlocksCleared()]
    assert eng.pool.num_cached == 0


def test_events_off_by_default() -> None:
    eng = Engine(EngineConfig(num_gpu_blocks=100), CO)
    eng.add_request(SimRequest(ids(100, 8), 4, 0.0))
    eng.run()
    assert eng.take_kv_events() == []


async def test_server_publishes_on_zmq(start_sim) -> None:
    sim = await start_sim(kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*", block_size=BS)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sim.kv_events.endpoint)
    prompt = ids(300, 9)
    try:
        await asyncio.sleep(0.3)  # PUB/SUB joins asynchronously
        async with aiohttp.ClientSession() as http:
            body = {"model": sim.model, "prompt": prompt, "max_tokens": 4}
            async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert topic == b"" and decode_seq(seq) == 0
            (event,) = decode_batch(payload).events
            assert isinstance(event, BlockStored) and list(event.token_ids) == prompt[: 18 * BS]

            await http.post(f"{sim.url}/sim/faults", json={"restart": True})  # a new engine process
            async with http.post(f"{sim.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
            _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert decode_seq(seq) == 0  # numbering starts again
            assert isinstance(decode_batch(payload).events[0], BlockStored)  # the cache was empty

            async with http.post(f"{sim.url}/reset_prefix_cache") as resp:
                assert resp.status == 200
            _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert decode_seq(seq) == 1 and decode_batch(payload).events == (AllBlocksCleared(),)
    finally:
        sub.close(linger=0)
        ctx.destroy(linger=0)


@pytest.mark.parametrize("bad", ["tcp://256.0.0.1:1", "nonsense"])
async def test_server_refuses_an_unbindable_endpoint(qwen_counter, bad: str) -> None:
    from extproc.sim.server import SimServer

    sim = SimServer(tokenizer=qwen_counter, kv_events_endpoint=bad)
    with pytest.raises(zmq.ZMQError):
        await sim.start()
    await sim.aclose()


def test_cli_takes_a_port_or_an_endpoint_not_both() -> None:
    from typer.testing import CliRunner

    from extproc.cli import app

    result = CliRunner().invoke(app, ["sim", "--kv-events-port", "5557", "--kv-events-endpoint", "tcp://127.0.0.1:5557"])
    assert result.exit_code == 2 and "not both" in result.output
