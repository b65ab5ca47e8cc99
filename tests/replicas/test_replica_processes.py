"""Two `llm-extproc serve` processes sharing one real redis-server (replicas.sync: redis), driven
over ext_proc as Envoy would, with the decisions held open so their in-flight accounting shows:

- a burst of 40 requests split across the replicas spreads over the endpoints as one process
  spreads it, and each replica counts all 40;
- the second of two identical long prompts, sent to the other replica 50 ms later, lands on the
  first's endpoint (the prefix index is shared);
- a replica killed with SIGKILL leaves nothing behind on the other (its entries expire);
- with Redis gone both keep deciding on their own state, and sharing resumes when it returns.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from extproc.replicas.probe import HeldDecision, chat_body, decide
from extproc.stack.redis import RedisProcess, redis_server_binary
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"
ENDPOINTS = [f"127.0.0.1:{18101 + i}" for i in range(4)]  # never contacted: decisions only
WORDS = "prefill decode block cache tensor kernel batch token queue replica router shard".split()


def long_prompt(seed: int, words: int = 2000) -> str:
    """A distinct prompt of ~1.7 tokens per word: long enough (~3.4k tokens) that one process
    sends its repeat to the endpoint already holding it rather than to an idle one."""
    return f"Document {seed}: " + " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(words))


def config(redis_url: str) -> dict:
    return {
        "models": [{"name": MODEL, "max_model_len": 32768}],
        "endpoints": [{"address": a, "models": [MODEL]} for a in ENDPOINTS],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}},
        "ratelimit": {"redis": {"url": redis_url, "timeout_ms": 200}},
        "replicas": {"sync": "redis", "heartbeat_s": 0.2, "owner_timeout_s": 1.0},
    }


class Replica:
    def __init__(self, server: ExtProcServerProcess, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.channel = channel

    async def decide(self, content: str) -> HeldDecision:
        return await decide(self.channel, chat_body(MODEL, content, max_tokens=64))

    async def view(self) -> dict:
        async with httpx.AsyncClient(trust_env=False, timeout=5) as c:
            return (await c.get(f"{self.server.admin_url}/api/v1/endpoints")).json()

    async def inflight(self) -> dict[str, int]:
        return {e["address"]: e["inflight"] for e in (await self.view())["endpoints"]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("replicas")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def redis(workdir: Path) -> AsyncIterator[RedisProcess]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisProcess(workdir=workdir / "redis")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replicas(workdir: Path, redis: RedisProcess) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    try:
        servers = await asyncio.gather(*(start_server(workdir, config(redis.url), f"replica-{n}") for n in "ab"), return_exceptions=True)
        started = [Replica(s, grpc.aio.insecure_channel(f"127.0.0.1:{s.grpc_port}")) for s in servers if isinstance(s, ExtProcServerProcess)]
        for s in servers:
            if isinstance(s, BaseException):
                raise s
        await until_all_connected(started)
        yield started
    finally:
        for r in started:
            await r.channel.close()
        await asyncio.gather(*(r.server.aclose() for r in started))


async def until(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, f"{what}: not met within {timeout_s} s"
        await asyncio.sleep(0.02)


async def until_all_connected(group: list[Replica]) -> None:
    async def connected() -> bool:
        views = [await r.view() for r in group]
        return all(v["replica_sync"]["connected"] and len(v["replica_sync"]["peers"]) >= len(group) - 1 for v in views)

    await until(connected, what="every replica subscribed and hearing the others")


async def until_idle(group: list[Replica]) -> None:
    async def idle() -> bool:
        return all([sum((await r.inflight()).values()) == 0 for r in group])

    await until(idle, what="nothing in flight on any replica")


async def burst(targets: list[Replica], n: int) -> list[HeldDecision]:
    return list(await asyncio.gather(*(targets[i % len(targets)].decide(f"Say hello {i}.") for i in range(n))))


async def test_a_burst_split_across_replicas_spreads_like_one_process(replicas):
    a, b = replicas
    one = await burst([a], 40)
    single = sorted(Counter(h.endpoint for h in one).values())
    for h in one:
        await h.end()
    await until_idle(replicas)

    split = await burst([a, b], 40)
    assert all(h.endpoint in ENDPOINTS for h in split)
    spread = sorted(Counter(h.endpoint for h in split).values())
    assert single == [10, 10, 10, 10]
    assert len(spread) == 4 and spread[-1] - spread[0] <= 2, spread

    async def both_count_all() -> bool:
        return all([sum((await r.inflight()).values()) == 40 for r in replicas])

    await until(both_count_all, what="each replica counting all 40 requests")
    assert await a.inflight() == await b.inflight() == dict(Counter(h.endpoint for h in split))
    for h in split:
        await h.end()
    await until_idle(replicas)


async def test_an_identical_long_prompt_follows_the_first_across_replicas(replicas):
    a, b = replicas
    for seed in range(5):  # by chance all five would follow with probability 4**-5
        prompt = long_prompt(seed)
        first = await a.decide(prompt)
        await asyncio.sleep(0.05)
        second = await b.decide(prompt)
        assert second.endpoint == first.endpoint, f"prompt {seed}: {first.endpoint} then {second.endpoint}"
        await first.end()
        await second.end()
    await until_idle(replicas)


async def test_a_killed_replica_leaves_nothing_behind(workdir, redis, replicas):
    a, _ = replicas
    server = await start_server(workdir, config(redis.url), "replica-c")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    try:
        c = Replica(server, channel)
        await until_all_connected([a, c])
        held = [await c.decide(f"Count to {i}.") for i in range(6)]
        assert all(h.endpoint in ENDPOINTS for h in held)

        async def a_counts_them() -> bool:
            return sum((await a.inflight()).values()) == 6

        await until(a_counts_them, what="replica a counting c's 6 requests")
        os.kill(server.pid, signal.SIGKILL)  # no goodbye: only expiry can free them
    finally:
        await channel.close()
        await server.aclose()
    await until(lambda: _zero(a), timeout_s=5.0, what="c's requests expired on a")
    assert (await a.view())["replica_sync"]["peers"].keys() == {(await replicas[1].view())["replica_sync"]["replica_id"]}


async def _zero(r: Replica) -> bool:
    return sum((await r.inflight()).values()) == 0


async def test_without_redis_each_decides_alone_and_recovers(redis, replicas):
    a, b = replicas
    held = await a.decide("Before the outage.")
    await until(lambda: _count(b, 1), what="b counting a's request")
    await redis.stop()
    try:
        during = [await (a if i % 2 else b).decide(f"During the outage {i}.") for i in range(8)]
        assert all(h.endpoint in ENDPOINTS for h in during)  # decisions go on without Redis
        # b no longer hears a: after owner_timeout_s it counts only its own 4 requests.
        await until(lambda: _count(b, 4), timeout_s=5.0, what="b counting only its own requests")
        assert (await b.view())["replica_sync"]["connected"] is False
    finally:
        await redis.start()
    for h in [held, *during]:
        await h.end()
    await until_all_connected(replicas)
    await until_idle(replicas)
    prompt = long_prompt(99)
    first = await b.decide(prompt)
    await asyncio.sleep(0.05)
    second = await a.decide(prompt)
    assert second.endpoint == first.endpoint
    await until(lambda: _count(a, 2), what="a counting b's request again")
    await first.end()
    await second.end()
    await until_idle(replicas)


async def _count(r: Replica, n: int) -> bool:
    return sum((await r.inflight()).values()) == n
