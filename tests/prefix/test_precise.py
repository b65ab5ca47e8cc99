"""The precise prefix source: KV events mirrored into the prefix index (`extproc.prefix.precise`),
with a real ZMQ PUB socket and vLLM's replay protocol (served by the simulator's publisher)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from extproc.config.schema import PrefixConfig
from extproc.prefix.hashing import chain_block_hashes
from extproc.prefix.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    REPLAY_END_SEQ,
    KVEventBatch,
    encode_batch,
    encode_seq,
)
from extproc.prefix.precise import KVEventSubscriber, PreciseIndexer, PreciseSource
from extproc.prefix.tracker import PrefixTracker
from extproc.sim.kv_publisher import KVEventPublisher

BS = 16
EP = "10.0.0.1:8000"
PROMPT = list(range(1000, 1000 + 4 * BS))  # four full blocks
OURS = chain_block_hashes(PROMPT, BS)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(ttl: float = 2.0) -> tuple[PrefixTracker, PreciseIndexer, Clock]:
    clock = Clock()
    tracker = PrefixTracker(PrefixConfig(), clock=clock)
    idx = PreciseIndexer(tracker, speculative_ttl_s=ttl, clock=clock)
    idx.register(EP)
    return tracker, idx, clock


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium="GPU", **kw)  # type: ignore[arg-type]


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, tuple(events), 0)  # type: ignore[arg-type]


def matched(tracker: PrefixTracker) -> int:
    return tracker.index.match(OURS).get(EP, 0)


def test_stored_chain_is_indexed_under_our_hashes() -> None:
    tracker, idx, _ = make()
    # The engine stores the prompt in two steps (chunked prefill): 2 blocks, then 2 chained on
    # the second one. Engine hashes are arbitrary (they depend on the engine's seed).
    idx.apply(EP, batch(stored([901, 902], None, PROMPT[: 2 * BS])))
    assert matched(tracker) == 2
    idx.apply(EP, batch(stored([903, 904], 902, PROMPT[2 * BS :])))
    assert matched(tracker) == 4
    assert tracker.precise == {EP}


def test_store_with_an_unknown_parent_is_skipped() -> None:
    tracker, idx, _ = make()
    idx.apply(EP, batch(stored([903, 904], 555, PROMPT[2 * BS :])))
    assert len(tracker.index) == 0
    assert idx.metrics.events.labels(EP, "stored", "skipped")._value.get() == 1


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"lora_id": 1}, id="lora-id-without-name"),
        pytest.param({"extra_keys": (None, ("mm-hash", 0), None, None)}, id="multimodal"),
        pytest.param({"group_idx": 1}, id="second-group"),
        pytest.param({"medium": "CPU"}, id="offloaded"),
    ],
)
def test_blocks_our_hashes_cannot_name_are_not_indexed(extra: dict) -> None:
    tracker, idx, _ = make()
    fields = {"medium": "GPU", **extra}
    idx.apply(EP, batch(BlockStored((901, 902, 903, 904), None, tuple(PROMPT), BS, **fields)))
    assert len(tracker.index) == 0


def test_removed_blocks_leave_only_when_no_copy_is_left() -> None:
    tracker, idx, _ = make()
    idx.apply(EP, batch(stored([901, 902, 903, 904], None, PROMPT)))
    # vLLM does not deduplicate: a second request computed block 4 again and stored a copy.
    idx.apply(EP, batch(stored([904], 903, PROMPT[3 * BS :])))
    idx.apply(EP, batch(BlockRemoved((904,), "GPU")))
    assert matched(tracker) == 4
    idx.apply(EP, batch(BlockRemoved((904, 903), "GPU")))
    assert matched(tracker) == 2
    idx.apply(EP, batch(BlockRemoved((12345,), "GPU")))  # never seen: ignored
    assert matched(tracker) == 2


def test_all_blocks_cleared_resets_the_endpoint() -> None:
    tracker, idx, _ = make()
    idx.apply(EP, batch(stored([901, 902, 903, 904], None, PROMPT)))
    tracker.index.add("10.0.0.2:8000", OURS)  # another endpoint keeps its entries
    idx.apply(EP, batch(AllBlocksCleared()))
    assert tracker.index.match(OURS) == {"10.0.0.2:8000": 4}
    assert tracker.metrics.index_resets.labels(EP, "cleared")._value.get() == 1
    assert idx.mirror_size(EP) == 0


def test_speculative_blocks_expire_unless_confirmed() -> None:
    tracker, idx, clock = make(ttl=2.0)
    tracker.on_precise_pick(EP, OURS)
    assert matched(tracker) == 4  # counts at once: the next identical prompt follows it
    clock.t += 1.0
    # The engine stores the first two blocks only (the rest was still computing).
    idx.apply(EP, batch(stored([901, 902], None, PROMPT[: 2 * BS])))
    clock.t += 1.5
    assert idx.expire() == 2
    assert matched(tracker) == 2
    assert idx.metrics.speculative.labels(EP, "confirmed")._value.get() == 2
    assert idx.metrics.speculative.labels(EP, "expired")._value.get() == 2


def test_a_later_pick_extends_speculation() -> None:
    tracker, idx, clock = make(ttl=2.0)
    tracker.on_precise_pick(EP, OURS)
    clock.t += 1.5
    tracker.on_precise_pick(EP, OURS)
    clock.t += 1.0
    assert idx.expire() == 0 and matched(tracker) == 4
    clock.t += 1.5
    assert idx.expire() == 4 and matched(tracker) == 0


def test_a_restart_seen_by_the_tracker_forgets_the_mirror() -> None:
    tracker, idx, clock = make(ttl=2.0)
    idx.apply(EP, batch(stored([901, 902, 903, 904], None, PROMPT)))
    tracker.reset(EP, "restart")  # e.g. its prefix-cache counters went back
    assert idx.mirror_size(EP) == 0
    # The same prompt picked again: speculative again (nothing is believed held), so it expires.
    tracker.on_precise_pick(EP, OURS)
    clock.t += 3.0
    idx.expire()
    assert matched(tracker) == 0


def test_translation_table_is_bounded() -> None:
    tracker, idx, _ = make()
    tracker.index.set_capacity(EP, 8)  # the engine's num_gpu_blocks
    for i in range(40):
        tokens = [50_000 + i] * BS
        idx.apply(EP, batch(stored([10_000 + i], None, tokens)))
    assert idx.mirror_size(EP) <= 16
    assert tracker.index.blocks(EP) <= 8


# -- the subscriber, over real sockets -----------------------------------------------------
def frames(seq: int, *events: object) -> list[bytes]:
    return [b"", encode_seq(seq), encode_batch(batch(*events))]


async def wait_for(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def published_source(tracker: PrefixTracker) -> AsyncIterator[tuple[zmq.Socket, PreciseSource]]:
    """A bound PUB socket standing in for EP's engine and a started source subscribed to it."""
    ctx = zmq.asyncio.Context()
    pub = zmq.Socket(ctx, zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    source = PreciseSource(tracker, [(EP, endpoint, None)], registry=CollectorRegistry())
    await source.start()
    try:
        yield pub, source
    finally:
        await source.aclose()
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def test_subscriber_applies_pub_messages_and_handles_gaps_and_restarts() -> None:
    tracker = PrefixTracker(PrefixConfig())
    async with published_source(tracker) as (pub, source):
        # PUB/SUB joins asynchronously: resend the first batch until it lands (idempotent).
        for _ in range(100):
            pub.send_multipart([b"kv", encode_seq(0), encode_batch(batch(stored([901, 902], None, PROMPT[: 2 * BS])))])
            await asyncio.sleep(0.02)
            if matched(tracker) == 2:
                break
        assert matched(tracker) == 2
        idx = source.indexer
        pub.send_multipart(frames(1, stored([903, 904], 902, PROMPT[2 * BS :])))
        await wait_for(lambda: matched(tracker) == 4)
        # Garbage never stops the stream.
        pub.send_multipart([b"", encode_seq(2), b"\xc1"])
        pub.send_multipart([b"only-two", b"frames"])
        await wait_for(lambda: idx.metrics.errors.labels(EP, "decode")._value.get() == 1)
        # Seq 3 after 1: batch 2 was lost and there is no replay, so the index is dropped.
        pub.send_multipart(frames(3, stored([901], None, PROMPT[:BS])))
        await wait_for(lambda: idx.metrics.gaps.labels(EP, "reset")._value.get() == 1)
        assert matched(tracker) == 1
        # The sequence goes back: a new engine process; its old blocks are gone.
        pub.send_multipart(frames(0, stored([777], None, [5] * BS)))
        await wait_for(lambda: tracker.metrics.index_resets.labels(EP, "restart")._value.get() == 1)
        assert matched(tracker) == 0
        assert idx.metrics.errors.labels(EP, "frames")._value.get() == 1


async def test_gap_is_filled_from_the_replay_socket() -> None:
    tracker = PrefixTracker(PrefixConfig())
    idx = PreciseIndexer(tracker)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    publisher.start()
    ctx = zmq.asyncio.Context()
    try:
        events = [
            [stored([901], None, PROMPT[:BS])],
            [stored([902], 901, PROMPT[BS : 2 * BS])],
            [stored([903], 902, PROMPT[2 * BS : 3 * BS])],
            [stored([904], 903, PROMPT[3 * BS :])],
        ]
        for evs in events:
            publisher.publish(evs)
        sub = KVEventSubscriber(EP, publisher.endpoint, publisher.replay_endpoint, idx, ctx)
        idx.register(EP)
        # The subscriber saw batch 0, missed 1 and 2, and now gets 3: it asks the replay socket.
        await sub.handle(frames(0, *events[0]))
        await sub.handle(frames(3, *events[3]))
        assert matched(tracker) == 4
        assert idx.metrics.gaps.labels(EP, "replayed")._value.get() == 1
        assert idx.last_seq(EP) == 3
        # Joining late: the history before the first batch seen comes from the replay too.
        tracker2 = PrefixTracker(PrefixConfig())
        idx2 = PreciseIndexer(tracker2)
        idx2.register(EP)
        late = KVEventSubscriber(EP, publisher.endpoint, publisher.replay_endpoint, idx2, ctx)
        await late.handle(frames(3, *events[3]))
        assert tracker2.index.match(OURS) == {EP: 4}
        # A gap the publisher no longer buffers: dropped, not half-filled.
        publisher.restart()
        publisher.publish(events[0])
        await sub.handle(frames(9, *events[0]))
        assert idx.metrics.gaps.labels(EP, "reset")._value.get() == 1
    finally:
        await publisher.aclose()
        ctx.destroy(linger=0)


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        pytest.param({"kv_events": "127.0.0.1:5557"}, "tcp://host:port", id="no-scheme"),
        pytest.param({"kv_events": "tcp://*:5557"}, "host we can connect to", id="bind-wildcard"),
        pytest.param({"kv_events": "tcp://127.0.0.1:0"}, "host we can connect to", id="port-0"),
        pytest.param({"kv_events_replay": "tcp://127.0.0.1:5558"}, "needs kv_events", id="replay-alone"),
    ],
)
def test_endpoint_kv_events_config_errors(fields: dict, match: str) -> None:
    from pydantic import ValidationError

    from extproc.config.schema import EndpointConfig

    with pytest.raises(ValidationError, match=match):
        EndpointConfig(address="127.0.0.1:8000", models=["m"], **fields)
    ok = EndpointConfig(address="127.0.0.1:8000", models=["m"], kv_events="tcp://10.0.0.5:5557", kv_events_replay="tcp://10.0.0.5:5558")
    assert ok.kv_events == "tcp://10.0.0.5:5557"


async def test_joining_an_engine_long_up_does_not_materialise_its_whole_history() -> None:
    # An engine up for days publishes seq ~ 10^7..10^9 (one per step); a garbage publisher any
    # 63-bit value. The replay check built list(range(0, seq)): gigabytes and seconds on the
    # event loop (here 2^40: MemoryError). Now: O(batches replayed).
    _, idx, _ = make()
    first = [stored([901], None, PROMPT[:BS])]
    async with publishing(first) as (publisher, ctx):
        sub = KVEventSubscriber(EP, publisher.endpoint, publisher.replay_endpoint, idx, ctx)
        await asyncio.wait_for(sub.handle(frames(1 << 40, *first)), 5)  # joining late
        assert idx.last_seq(EP) == 1 << 40
        await asyncio.wait_for(sub.handle(frames((1 << 41) + 5, *first)), 5)  # a gap no replay fills
        assert idx.metrics.gaps.labels(EP, "reset")._value.get() == 1
        assert idx.last_seq(EP) == (1 << 41) + 5


@contextlib.asynccontextmanager
async def publishing(*batches: list) -> AsyncIterator[tuple[KVEventPublisher, zmq.asyncio.Context]]:
    """A started publisher (with its replay socket) that has published `batches`, and a context."""
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    publisher.start()
    ctx = zmq.asyncio.Context()
    try:
        for evs in batches:
            publisher.publish(evs)
        yield publisher, ctx
    finally:
        await publisher.aclose()
        ctx.destroy(linger=0)


async def test_a_removed_endpoints_subscriber_stops_and_its_events_index_nothing() -> None:
    tracker = PrefixTracker(PrefixConfig())
    async with published_source(tracker) as (pub, source):
        for _ in range(100):
            pub.send_multipart(frames(0, stored([901, 902], None, PROMPT[: 2 * BS])))
            await asyncio.sleep(0.02)
            if matched(tracker) == 2:
                break
        assert matched(tracker) == 2
        closing = source.remove(EP)
        tracker.drop_endpoint(EP)
        assert closing is not None
        await closing
        assert source.subscribers == [] and EP not in tracker.precise and matched(tracker) == 0
        pub.send_multipart(frames(1, stored([903, 904], 902, PROMPT[2 * BS :])))
        pub.send_multipart(frames(0, stored([901, 902], None, PROMPT[: 2 * BS])))
        await asyncio.sleep(0.2)
        assert matched(tracker) == 0 and len(tracker.index) == 0
        assert source.remove(EP) is None  # twice: nothing left to stop


async def test_a_large_batch_is_decoded_off_the_loop_and_applied_in_slices() -> None:
    # An 11 MB batch held the event loop ~3 s (decode and apply in one go): every decision waited.
    # Now a payload over OFF_LOOP_DECODE_BYTES decodes in a thread and the events apply a slice
    # per loop turn, so another task gets turns while the batch is being taken in.
    from extproc.prefix import precise

    tracker, idx, _ = make()
    chains = 2000  # distinct one-block prompts, each a root store: 2,000 events (~300 kB)
    events = [stored([5000 + i], None, [i] * BS) for i in range(chains)]
    payload = encode_batch(batch(*events))
    assert len(payload) > precise.OFF_LOOP_DECODE_BYTES  # the thread path is the one tested
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    ctx = zmq.asyncio.Context()
    task = asyncio.create_task(ticker())
    try:
        await KVEventSubscriber(EP, "tcp://127.0.0.1:1", None, idx, ctx).handle([b"kv", encode_seq(0), payload])
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.destroy(linger=0)
    assert turns >= chains // precise.APPLY_SLICE_EVENTS  # the loop ran between slices
    for i in (0, chains - 1):
        assert tracker.index.match(chain_block_hashes([i] * BS, BS)).get(EP) == 1
    assert idx.metrics.batches.labels(EP)._value.get() == 1  # one batch, however many slices


def _bound_on_ipv6_loopback(kind: int) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket, str]:
    """A new context and a socket of `kind` with `zmq.IPV6` bound on `tcp://[::1]:*`, and the
    endpoint it got; the test is skipped where the machine has no IPv6 loopback."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind("tcp://[::1]:*")
    except zmq.ZMQError:
        ctx.destroy(linger=0)
        pytest.skip("no IPv6 loopback here")
    return ctx, sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


async def test_an_ipv6_publisher_is_heard() -> None:
    """A discovered IPv6 endpoint's KV-event socket is rendered as `tcp://[addr]:port`
    (docs/discovery.md): ZMQ leaves IPv6 off unless `zmq.IPV6` is set, and the connect is then
    accepted while nothing ever arrives."""
    ctx, pub, endpoint = _bound_on_ipv6_loopback(zmq.PUB)
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


async def test_a_batch_of_the_replaced_publisher_does_not_reach_the_new_mirror() -> None:
    """An endpoint's KV-event publisher replaced by a reload (`PreciseSource.add` with another
    socket): a batch the old subscriber already received must not be applied to the NEW
    publisher's mirror (the old one's sockets close in the background)."""
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


async def test_a_gap_is_replayed_from_an_ipv6_replay_socket() -> None:
    """The replay DEALER needs `zmq.IPV6` as the SUB does: a replay socket rendered as
    `tcp://[addr]:port` would otherwise time out and every gap reset the mirror."""
    ctx, router, replay = _bound_on_ipv6_loopback(zmq.ROUTER)
    events = [[stored([901], None, PROMPT[:BS])], [stored([902], 901, PROMPT[BS : 2 * BS])], [stored([903], 902, PROMPT[2 * BS : 3 * BS])]]

    async def serve_one_replay() -> None:
        ident, _, start = await router.recv_multipart()
        assert start == encode_seq(1)
        await router.send_multipart([ident, b"", encode_seq(1), encode_batch(batch(*events[1]))])
        await router.send_multipart([ident, b"", encode_seq(REPLAY_END_SEQ), b""])

    tracker = PrefixTracker(PrefixConfig())
    idx = PreciseIndexer(tracker)
    idx.register(EP)
    sub = KVEventSubscriber(EP, "tcp://127.0.0.1:1", replay, idx, ctx)
    server = asyncio.create_task(serve_one_replay())
    try:
        await sub.handle(frames(0, *events[0]))
        await sub.handle(frames(2, *events[2]))  # batch 1 missed: asked of the replay socket
        await asyncio.wait_for(server, 1.0)
        assert idx.metrics.gaps.labels(EP, "replayed")._value.get() == 1
        assert matched(tracker) == 3
    finally:
        server.cancel()
        router.close(linger=0)
        ctx.destroy(linger=0)


async def test_the_simulator_publishes_on_ipv6() -> None:
    """The simulator's publisher binds `tcp://[::1]:*` like a vLLM pod with an IPv6 address, and
    its replay socket too (`zmq.IPV6` on both: without it the bind fails)."""
    publisher = KVEventPublisher("tcp://[::1]:*", "tcp://[::1]:*")
    try:
        publisher.start()
    except zmq.ZMQError as e:
        if "Address family not supported" in str(e) or "Cannot assign requested address" in str(e):
            pytest.skip(f"no IPv6 loopback on this machine: {e}")
        raise
    try:
        assert publisher.endpoint.startswith("tcp://[::1]:") and publisher.replay_endpoint.startswith("tcp://[::1]:")
    finally:
        await publisher.aclose()
