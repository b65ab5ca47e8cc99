"""Replica sync's silent-connection detection, repeated. Every reconnect
must leave nothing behind (client sockets, tasks)."""

from __future__ import annotations

import asyncio
import contextlib
import os

from tests.replicas.test_sync import make_sync, until


def client_sockets_to(port: int) -> int:
    """This process's open TCP sockets whose peer is 127.0.0.1:`port` (established or closing)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    n = 0
    with open("/proc/self/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            rem_port = int(cols[2].split(":")[1], 16)
            state = cols[3]
            if rem_port == port and cols[9] in inodes and state != "0A":
                n += 1
    return n


def ours() -> int:
    """Tasks not belonging to the test's proxy (whose dead connections stay open by design)."""
    return sum(1 for t in asyncio.all_tasks() if "Blackhole" not in t.get_coro().__qualname__ and "_pipe" not in t.get_coro().__qualname__)


async def test_repeated_silent_reconnects_leave_no_sockets_or_tasks(redis_proxy):
    a, _, _ = make_sync(url=f"redis://127.0.0.1:{redis_proxy.port}/0", heartbeat_s=0.1, owner_timeout_s=0.3)
    await a.start()
    try:
        await until(lambda: a.connected)
        await asyncio.sleep(0.3)
        base_sockets, base_tasks = client_sockets_to(redis_proxy.port), ours()
        # A leak of one socket or task per reconnect shows after the first; one in every other
        # reconnect, after the fourth.
        cycles = 4
        for i in range(cycles):
            redis_proxy.blackhole()
            await until(lambda: a.silent_reconnects == i + 1, timeout_s=5.0)
            await until(lambda: a.connected, timeout_s=5.0)

        def settled() -> bool:  # the publisher's own timeouts and reconnects wind down
            return client_sockets_to(redis_proxy.port) <= base_sockets and ours() <= base_tasks + 1

        with contextlib.suppress(AssertionError):
            await until(settled, timeout_s=3.0)
        sockets, tasks = client_sockets_to(redis_proxy.port), ours()
        assert sockets <= base_sockets, f"client sockets to Redis: {base_sockets} before, {sockets} after {cycles} silent reconnects"
        assert tasks <= base_tasks + 1, f"tasks: {base_tasks} before, {tasks} after"
    finally:
        await a.aclose()


async def test_no_silent_reconnect_while_redis_answers_slowly(redis_server):
    """Redis alive but each reply late (a loaded server, a slow link): the subscription is
    kept as long as replies come within owner_timeout_s."""
    host, port = redis_server.url.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    delay = 0.12

    async def pipe(src, dst):
        try:
            while data := await src.read(65536):
                await asyncio.sleep(delay)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    async def handle(reader, writer):
        up_r, up_w = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    slow_port = server.sockets[0].getsockname()[1]
    # A round trip of 0.24 s, over timeout_ms (0.2 s): the publisher times out, so the
    # subscriber hears only its PINGs' replies, which come well within owner_timeout_s.
    a, _, _ = make_sync(url=f"redis://127.0.0.1:{slow_port}/0", heartbeat_s=0.5, owner_timeout_s=1.5)
    await a.start()
    try:
        await until(lambda: a.connected, timeout_s=10.0)
        await asyncio.sleep(6.0)
        assert a.silent_reconnects == 0
    finally:
        await a.aclose()
        server.close()


async def test_connected_is_not_reported_for_a_subscription_redis_never_confirmed(redis_proxy):
    """A path that accepts TCP connections but forwards nothing (an L4 balancer in front of a
    dead Redis, a black-holed NAT): the replica must never report itself subscribed. (Held up:
    redis-py's connection handshake waits for a reply, bounded by `timeout_ms` × 4.)"""
    redis_proxy.blackhole(new_too=True)
    a, _, _ = make_sync(url=f"redis://127.0.0.1:{redis_proxy.port}/0", heartbeat_s=0.2, owner_timeout_s=1.0)
    await a.start()
    try:
        samples = []
        for _ in range(60):  # 3 s
            await asyncio.sleep(0.05)
            samples.append(a.connected)
        assert not any(samples), f"reported connected in {sum(samples)} of {len(samples)} samples; silent reconnects {a.silent_reconnects}"
    finally:
        await a.aclose()
