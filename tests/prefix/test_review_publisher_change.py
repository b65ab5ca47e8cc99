"""Adversarial review: an endpoint's KV-event publisher replaced by a reload
(`PreciseSource.add` with another socket). The old subscriber is stopped in the background
(`remove` → a `_close` task), while the address is registered again at once: a batch the old
subscriber already received is applied to the NEW publisher's mirror."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from extproc.config.schema import PrefixConfig
from extproc.prefix.kv_events import encode_batch, encode_seq
from extproc.prefix.precise import PreciseSource
from extproc.prefix.tracker import PrefixTracker
from tests.prefix.test_precise import EP, OURS, PROMPT, BS, batch, stored


async def test_a_batch_of_the_replaced_publisher_does_not_reach_the_new_mirror() -> None:
    tracker = PrefixTracker(PrefixConfig())
    source = PreciseSource(tracker, [(EP, "tcp://127.0.0.1:1", None)], registry=CollectorRegistry())
    await source.start()
    try:
        old = source.subscribers[0]
        # A message of the old publisher received just before the reload (its task's wake-up
        # already queued on the loop when the reload callback runs).
        frames = [b"kv", encode_seq(41), encode_batch(batch(stored([901, 902], None, PROMPT[: 2 * BS])))]
        late = asyncio.create_task(old.handle(frames))
        source.add(EP, "tcp://127.0.0.1:2", None)  # the reload: another publisher for EP
        await late
        await asyncio.sleep(0.05)
        assert source.indexer.last_seq(EP) is None, "the new publisher's mirror took the old publisher's sequence number"
        assert tracker.index.match(OURS).get(EP, 0) == 0, "the old publisher's blocks were indexed for the new one"
    finally:
        await source.aclose()
