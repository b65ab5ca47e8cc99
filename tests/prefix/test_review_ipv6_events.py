"""Adversarial review: a discovered IPv6 endpoint's KV-event socket is rendered as
`tcp://[addr]:port` (docs/discovery.md); the subscriber must actually hear it. ZMQ sockets
leave IPv6 off unless `zmq.IPV6` is set: the connect is accepted and nothing ever arrives."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from extproc.config.schema import PrefixConfig
from extproc.prefix.kv_events import encode_batch, encode_seq
from extproc.prefix.precise import PreciseSource
from extproc.prefix.tracker import PrefixTracker
from tests.prefix.test_precise import BS, EP, PROMPT, batch, stored


async def test_an_ipv6_publisher_is_heard() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.IPV6, 1)
    try:
        pub.bind("tcp://[::1]:*")
    except zmq.ZMQError:
        pytest.skip("no IPv6 loopback here")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    tracker = PrefixTracker(PrefixConfig())
    source = PreciseSource(tracker, [(EP, endpoint, None)], registry=CollectorRegistry())
    await source.start()
    try:
        frames = [b"kv", encode_seq(0), encode_batch(batch(stored([901, 902], None, PROMPT[: 2 * BS])))]
        for _ in range(30):  # PUB/SUB joins late: publish until heard (3 s)
            await pub.send_multipart(frames)
            await asyncio.sleep(0.1)
            if source.indexer.last_seq(EP) is not None:
                break
        assert source.indexer.last_seq(EP) == 0, f"nothing heard from {endpoint}"
    finally:
        await source.aclose()
        pub.close(linger=0)
        ctx.destroy(linger=0)
