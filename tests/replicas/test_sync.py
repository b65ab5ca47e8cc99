"""Replica sync, in process: the apply logic on crafted batches (expiry, reconciliation, bad
input), then two `ReplicaSync`s on a real redis-server (propagation, Redis lost and back)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import redis.asyncio as aioredis

from extproc.config.schema import EndpointConfig, PrefixConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.prefill_fit import PREFILL_ATTENTION_RATIO, PrefillCounts
from extproc.prefix.hashing import chain_block_hashes
from extproc.prefix.tracker import PrefixTracker
from extproc.ratelimit.config import RedisConfig
from extproc.replicas.config import ReplicasConfig
from extproc.replicas.sync import MAX_COUNT, MAX_PEERS, ReplicaSync, redis_location

MODEL = "m"
ADDRS = ["10.0.0.1:8000", "10.0.0.2:8000"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store() -> Datastore:
    return Datastore([EndpointConfig(address=a, models=[MODEL]) for a in ADDRS])


def make_sync(
    clock=time.monotonic, url: str = "redis://127.0.0.1:1/0", ratio: float = PREFILL_ATTENTION_RATIO, **cfg
) -> tuple[ReplicaSync, Datastore, PrefixTracker]:
    store = make_store()
    tracker = PrefixTracker(PrefixConfig(), clock=clock)
    config = ReplicasConfig(sync="redis", **cfg)
    sync = ReplicaSync(config, RedisConfig(url=url, timeout_ms=200), store, tracker, clock=clock, attention_ratio=ratio)
    return sync, store, tracker


def batch(origin: str, *events) -> bytes:
    return msgpack.packb([origin, time.time(), list(events)])


def test_a_remote_pick_counts_until_its_release_and_first_token_moves_it_to_decode():
    sync, store, _ = make_sync()
    ep = store.get(ADDRS[1])
    assert sync.apply(batch("peer", ["p", 1, ADDRS[1], 4, 300, 500, 2.0])) == 1
    assert (ep.inflight, ep.prefill_inflight, ep.prefill_tokens, ep.reserved_blocks, ep.context_tokens) == (1, 1, 300, 4, 500)
    sync.apply(batch("peer", ["f", 1]))
    assert (ep.prefill_inflight, ep.decode_inflight, ep.prefill_tokens) == (0, 1, 0)
    assert ep.prefill_fit.samples == 0  # the owner observed that first token, not this replica
    sync.apply(batch("peer", ["r", 1]))
    assert (ep.inflight, ep.decode_inflight, ep.reserved_blocks, ep.context_tokens) == (0, 0, 0, 0)
    assert store.open_reservations == 0
    assert sync.apply(batch("peer", ["r", 1])) == 0  # a repeated release changes nothing


def test_a_remote_pick_of_a_long_prompt_counts_its_whole_prefill_work():
    """Prefill work counts attention, quadratic in the prompt: a 1M-token prompt is 21M of work,
    above the 16.7M bound on token counts, and the other replicas dropped the pick as malformed."""
    from extproc.datastore.prefill_fit import prefill_work

    sync, store, _ = make_sync()
    work = prefill_work(1_000_000)
    assert sync.apply(batch("peer", ["p", 1, ADDRS[1], 4, work, 1_000_000, 2.0])) == 1
    assert store.get(ADDRS[1]).prefill_tokens == work
    assert sync.apply(batch("peer", ["p", 2, ADDRS[1], 4, 1 << 41, 10, 2.0])) == 0  # still bounded


def test_own_batches_and_applied_picks_are_not_shared_again():
    sync, store, _ = make_sync()
    assert sync.apply(batch(sync.id, ["p", 1, ADDRS[0], 0, 10, 10, 2.0])) == 0
    assert store.get(ADDRS[0]).inflight == 0
    sync.apply(batch("peer", ["p", 1, ADDRS[0], 0, 10, 10, 2.0]))
    assert sync._queue == []  # a remote reservation is not published as this replica's


def test_local_reservations_are_queued_as_pick_first_token_release():
    sync, store, _ = make_sync()
    r = store.reserve(store.get(ADDRS[0]), 3, prompt_tokens=100, settle_after_s=2.0, context_tokens=150)
    r.mark_first_token()
    r.release()
    r.release()
    kinds = [e[0] for e in sync._queue]
    assert kinds == ["p", "f", "r"]
    assert sync._queue[0][2:] == [ADDRS[0], 3, 100, 150, 2.0]


def test_a_batch_reserving_more_than_the_channel_bound_still_reaches_the_others():
    """A batched completion reserves every sequence's blocks (1,024 prompts × n=128 may), far
    past MAX_COUNT: the other replicas dropped such a pick as malformed and routed on to the
    endpoint as if it were idle. Sent at the bound (more than any engine holds), it counts."""
    sync, store, _ = make_sync()
    store.reserve(store.get(ADDRS[0]), 1 << 26, prompt_tokens=100, settle_after_s=2.0, context_tokens=1 << 31)
    other, other_store, _ = make_sync()
    assert other.apply(batch("peer", *sync._queue)) == 1
    ep = other_store.get(ADDRS[0])
    assert (ep.inflight, ep.reserved_blocks, ep.context_tokens) == (1, MAX_COUNT, MAX_COUNT)


def test_a_replica_not_heard_from_has_its_reservations_released():
    clock = Clock()
    sync, store, _ = make_sync(clock, heartbeat_s=0.5, owner_timeout_s=3.0)
    sync.apply(batch("dead", *(["p", i, ADDRS[i % 2], 1, 10, 10, 2.0] for i in range(10))))
    sync.apply(batch("alive", ["p", 1, ADDRS[0], 1, 10, 10, 2.0]))
    assert sum(ep.inflight for ep in store.all()) == 11
    clock.now += 2.0
    sync.apply(batch("alive", ["h", [1]]))
    assert sync.expire() == 0
    clock.now += 1.5  # "dead": 3.5 s of silence; "alive": 1.5 s
    assert sync.expire() == 10
    assert sum(ep.inflight for ep in store.all()) == 1
    assert sum(ep.reserved_blocks for ep in store.all()) == 1
    assert sync.summary()["remote_inflight"] == 1


def test_a_heartbeat_releases_what_its_owner_no_longer_holds():
    sync, store, _ = make_sync()
    sync.apply(batch("peer", *(["p", i, ADDRS[0], 0, 10, 10, 2.0] for i in (1, 2, 3))))
    sync.apply(batch("peer", ["h", [2]]))  # the releases of 1 and 3 were lost in transit
    assert store.get(ADDRS[0]).inflight == 1
    sync.apply(batch("peer", ["h", None]))  # too many to list: no reconciliation this round
    assert store.get(ADDRS[0]).inflight == 1
    sync.apply(batch("peer", ["b"]))  # leaving: everything goes
    assert store.get(ADDRS[0]).inflight == 0 and store.open_reservations == 0


def test_prefix_blocks_and_sessions_of_a_remote_pick_are_learned():
    sync, store, tracker = make_sync()
    hashes = chain_block_hashes(list(range(64)), 16)
    sync.apply(batch("peer", ["x", ADDRS[1], hashes, b"s1"]))
    assert tracker.index.match(hashes) == {ADDRS[1]: 4}
    assert tracker.session_endpoint(b"s1") == ADDRS[1]
    sync.apply(batch("peer", ["x", "10.9.9.9:1", hashes, None]))  # not an endpoint here: ignored
    assert tracker.index.blocks("10.9.9.9:1") == 0


def reserve_counted(sync: ReplicaSync, store: Datastore, address: str, counts: PrefillCounts):
    """A local pick as the pipeline makes it: its work at `sync`'s ratio, its counts kept."""
    work = counts.work(sync.attention_ratio)
    return store.reserve(store.get(address), 1, prompt_tokens=work, context_tokens=counts.prompt_tokens, prefill_counts=counts)


@pytest.mark.parametrize(
    "counts",
    [PrefillCounts(8000, 8000), PrefillCounts(8000, 1600), PrefillCounts(3000, 3000, (1000, 1000, 1000))],
    ids=["cold", "cached-prefix", "batched"],
)
def test_a_remote_pick_is_counted_at_the_receivers_attention_ratio(counts):
    """Mid-way through a rolling change of `attention_ratio`, a pick's work was counted in the
    sender's units: tokens alone (ratio 0) beside work at 1e-4 in one endpoint's backlog."""
    sender, sender_store, _ = make_sync(ratio=0.0)
    receiver, receiver_store, _ = make_sync(ratio=1e-4)
    reserve_counted(sender, sender_store, ADDRS[1], counts)
    assert [e[0] for e in sender._queue] == ["p", "w"]
    assert sender._queue[0][4] == counts.work(0.0)  # what an older receiver applies
    assert receiver.apply(batch("peer", *sender._queue)) == 1
    assert receiver_store.get(ADDRS[1]).prefill_tokens == counts.work(1e-4) > counts.work(0.0)
    # ... and back: the pick of the replica at 1e-4 counts at 0 on the one at 0
    reserve_counted(receiver, receiver_store, ADDRS[0], counts)
    assert sender.apply(batch("other", *receiver._queue)) == 1
    assert sender_store.get(ADDRS[0]).prefill_tokens == counts.work(0.0)


def test_a_remote_pick_without_counts_keeps_the_senders_work():
    """An older replica sends no "w": its work is applied as sent; and its receiver, which does
    not know "w", rejects that event alone and still applies the pick."""
    receiver, store, _ = make_sync(ratio=1e-4)
    assert receiver.apply(batch("old", ["p", 1, ADDRS[0], 1, 8000, 8000, 2.0])) == 1
    assert store.get(ADDRS[0]).prefill_tokens == 8000
    # counts for another id change nothing
    assert receiver.apply(batch("old", ["p", 2, ADDRS[1], 1, 500, 500, 2.0], ["w", 3, 8000, 8000, []])) == 1
    assert store.get(ADDRS[1]).prefill_tokens == 500


@pytest.mark.parametrize(
    "counts",
    [
        ["w", 2, 100, 200, []],  # more uncached than the prompt
        ["w", 2, float("inf"), 10, []],
        ["w", 2, 1 << 25, 10, []],
        ["w", 2, 100, -1, []],
        ["w", 2, 100, 100, [float("nan")]],
        ["w", 2, 100, 100, [1 << 24, 1 << 24]],  # lengths summing past MAX_COUNT
        ["w", 2, 100, 100, None],
        ["w", 2, 100, 100, [1] * ((1 << 16) + 1)],
        ["w", 2, 100, 100],
    ],
)
def test_malformed_prefill_counts_are_rejected_alone(counts):
    receiver, store, _ = make_sync(ratio=1e-4)
    assert receiver.apply(batch("peer", ["p", 2, ADDRS[1], 1, 100, 100, 2.0], counts)) == 1
    assert rejected(receiver, "event") == 1
    assert store.get(ADDRS[1]).prefill_tokens == 100  # the sender's work, as from an older replica


def test_bad_input_is_ignored_not_raised(caplog):
    sync, store, _ = make_sync()
    assert sync.apply(b"\xc1not msgpack") == 0
    assert sync.apply(msgpack.packb([1, 2])) == 0
    # One bad event does not stop the good ones after it.
    assert sync.apply(batch("peer", ["p", 1], ["zz"], ["p", 2, ADDRS[0], 0, 1, 1, 2.0])) == 1
    assert store.get(ADDRS[0]).inflight == 1
    assert sync.apply(batch("peer", ["p", 3, "nowhere:1", 0, 1, 1, 2.0])) == 0
    assert "malformed" in caplog.text


def rejected(sync: ReplicaSync, what: str) -> float:
    return sync.metrics.rejected.labels(what)._value.get()


@pytest.mark.parametrize(
    "message",
    [
        ["evil", 0, None],  # events not an array: iterating it raised TypeError out of apply()
        ["evil", 0, 5],
        ["evil", 0],
        [["not", "a", "str"], 0, []],
        "evil",
        None,
    ],
)
def test_a_message_of_the_wrong_shape_is_rejected_and_counted_not_raised(message):
    sync, store, _ = make_sync()
    assert sync.apply(msgpack.packb(message)) == 0
    assert rejected(sync, "message") == 1
    assert sync.summary()["peers"] == {}


@pytest.mark.parametrize(
    "event",
    [
        ["p", 1, ADDRS[0], float("inf"), 10, 10, 2.0],  # int(inf) raised OverflowError, uncaught
        ["p", 1, ADDRS[0], float("-inf"), 10, 10, 2.0],
        ["p", 1, ADDRS[0], 4, float("inf"), 10, 2.0],
        ["p", 1, ADDRS[0], 4, 10, float("inf"), 2.0],
        ["p", 1, ADDRS[0], 4, float("nan"), 10, 2.0],
        ["p", 1, ADDRS[0], 1e30, 10, 10, 2.0],  # finite but beyond any engine: was reserved as is
        ["p", 1, ADDRS[0], 4, 10, 1 << 40, 2.0],
        ["p", 1, ADDRS[0], -4, 10, 10, 2.0],
        ["p", 1, ADDRS[0], 4, 10, 10, float("inf")],  # a reservation that never settles
        ["p", 1, ADDRS[0], 4, 10, 10, float("nan")],
        ["p", 1, ADDRS[0], 4, 10, 10, -1.0],
        ["p", 1, ADDRS[0], 4, 10, 10, 3601.0],
        ["p", [1], ADDRS[0], 4, 10, 10, 2.0],  # an unhashable id
        ["p", 1, [ADDRS[0]], 4, 10, 10, 2.0],
        "p",
        5,
    ],
)
def test_non_finite_or_out_of_range_numbers_are_rejected_per_event(event):
    sync, store, _ = make_sync()
    good = ["p", 2, ADDRS[1], 1, 10, 10, 2.0]
    assert sync.apply(batch("peer", event, good)) == 1  # the good event after it still applies
    assert rejected(sync, "event") == 1
    assert store.get(ADDRS[0]).inflight == 0 and store.get(ADDRS[1]).inflight == 1
    assert store.get(ADDRS[0]).reserved_blocks == 0


def test_a_remote_weight_override_applies_here_and_a_malformed_one_is_rejected_alone():
    sync, store, _ = make_sync()
    bad = [
        ["o", ADDRS[0], 1.5, 60.0, "r", "api"],  # factor above 1
        ["o", ADDRS[0], float("nan"), 60.0, "r", "api"],
        ["o", ADDRS[0], 0.0, 0.0, "r", "api"],  # no duration
        ["o", ADDRS[0], 0.0, 1e9, "r", "api"],  # past MAX_DURATION_S
        ["o", ADDRS[0], 0.0, 60.0, "r", "anyone"],  # not a source the admin API has
        ["o", ADDRS[0], 0.0, 60.0, 7, "api"],
    ]
    assert sync.apply(batch("peer", *bad)) == 0
    assert rejected(sync, "event") == len(bad) and store.get(ADDRS[0]).override is None
    assert sync.apply(batch("peer", ["o", ADDRS[0], 0.25, 60.0, "x" * 10_000, "alertmanager"], ["o", "10.9.9.9:1", 0.0, 60.0, "", "api"])) == 1
    ov = store.get(ADDRS[0]).override
    assert (ov.factor, ov.source, len(ov.reason)) == (0.25, "alertmanager", 200)
    assert 59 < ov.expires_at - time.monotonic() <= 60  # from when this replica heard it
    sync.apply(batch("peer", ["o", ADDRS[0], 1.0, 60.0, "", "api"]))  # factor 1 clears
    assert store.get(ADDRS[0]).override is None


def test_a_remote_session_key_must_be_short_bytes_and_hashes_are_bounded_ints():
    sync, store, tracker = make_sync(max_hashes=2)
    hashes = chain_block_hashes(list(range(64)), 16)
    # An int session used to become bytes(n): n zero bytes allocated (one small PUBLISH, any n).
    assert sync.apply(batch("peer", ["x", ADDRS[1], hashes, 1000])) == 0
    assert tracker.session_endpoint(bytes(1000)) is None
    assert sync.apply(batch("peer", ["x", ADDRS[1], hashes, b"k" * 257])) == 0
    assert tracker.session_endpoint(b"k" * 257) is None
    assert sync.apply(batch("peer", ["x", ADDRS[1], [1.5, 2.5], None])) == 0  # was int()-ed
    assert sync.apply(batch("peer", ["x", ADDRS[1], [-1], None])) == 0
    assert rejected(sync, "event") == 4
    assert tracker.index.blocks(ADDRS[1]) == 0
    # Longer than max_hashes: only the first max_hashes blocks are learned.
    assert sync.apply(batch("peer", ["x", ADDRS[1], hashes, b"k" * 256])) == 1
    assert tracker.index.match(hashes) == {ADDRS[1]: 2}
    assert tracker.session_endpoint(b"k" * 256) == ADDRS[1]


def test_events_after_a_goodbye_in_the_same_batch_are_not_applied():
    sync, store, _ = make_sync()
    sync.apply(batch("peer", ["p", 1, ADDRS[0], 2, 10, 10, 2.0], ["b"], ["p", 2, ADDRS[0], 2, 10, 10, 2.0]))
    # The second pick used to be reserved into the peer just deleted: held for good.
    assert store.get(ADDRS[0]).inflight == 0 and store.open_reservations == 0
    assert sync.summary()["remote_inflight"] == 0 and sync.summary()["peers"] == {}


def test_the_peer_table_is_bounded_and_holds_only_replicas_that_sent_a_valid_event():
    sync, store, _ = make_sync()
    sync.apply(batch("empty"))
    sync.apply(batch("junk", ["zz"], ["p", 1]))
    assert sync.summary()["peers"] == {}
    for i in range(MAX_PEERS + 10):
        sync.apply(batch(f"r{i}", ["h", []]))
    assert len(sync.summary()["peers"]) == MAX_PEERS
    assert rejected(sync, "message") == 10
    assert sync.apply(batch("late", ["p", 1, ADDRS[0], 0, 1, 1, 2.0])) == 0
    assert store.get(ADDRS[0]).inflight == 0
    assert sync.apply(batch("r0", ["p", 1, ADDRS[0], 0, 1, 1, 2.0])) == 1  # known: still applied


def test_remote_state_is_bounded_and_a_full_queue_drops_instead_of_waiting():
    sync, store, _ = make_sync(max_remote=5, max_queue=3)
    sync.apply(batch("peer", *(["p", i, ADDRS[0], 0, 1, 1, 2.0] for i in range(20))))
    assert store.get(ADDRS[0]).inflight == 5
    for _ in range(5):
        store.reserve(store.get(ADDRS[1]))
    assert len(sync._queue) == 3
    assert sync.metrics.events.labels("dropped")._value.get() == 2


def test_drop_endpoint_forgets_the_remote_reservations_on_it():
    sync, store, _ = make_sync()
    sync.apply(batch("peer", ["p", 1, ADDRS[0], 2, 1, 1, 2.0], ["p", 2, ADDRS[1], 2, 1, 1, 2.0]))
    assert sync.drop_endpoint(ADDRS[0]) == 1
    assert store.get(ADDRS[0]).inflight == 0 and store.get(ADDRS[1]).inflight == 1
    assert sync.summary()["remote_inflight"] == 1


def test_config_and_log_location_keep_secrets_out():
    assert redis_location("redis://user:s3cret@redis.internal:6380/2") == "redis.internal:6380/2"
    assert redis_location("unix://user@/run/redis.sock?db=1&password=s3cret") == "unix:/run/redis.sock"
    with pytest.raises(ValueError, match="owner_timeout_s"):
        ReplicasConfig(sync="redis", heartbeat_s=1.0, owner_timeout_s=1.5)


# -- on a real redis-server --------------------------------------------------------------------


async def until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_picks_reach_the_other_replica_and_redis_loss_is_survived(redis_server):
    a, store_a, _ = make_sync(url=redis_server.url, heartbeat_s=0.2, owner_timeout_s=1.0)
    b, store_b, tracker_b = make_sync(url=redis_server.url, heartbeat_s=0.2, owner_timeout_s=1.0)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.connected and b.connected)
        ep_a, ep_b = store_a.get(ADDRS[0]), store_b.get(ADDRS[0])
        r = store_a.reserve(ep_a, 2, prompt_tokens=50, context_tokens=80)
        await until(lambda: ep_b.inflight == 1)
        assert ep_b.reserved_blocks == 2 and ep_b.prefill_tokens == 50
        r.release()
        await until(lambda: ep_b.inflight == 0)
        assert b.metrics.delay._sum.get() > 0

        # Redis goes away: both keep accounting for their own, the other's entries expire.
        held = store_a.reserve(ep_a)
        await until(lambda: ep_b.inflight == 1)
        await redis_server.stop()
        local = store_b.reserve(ep_b)
        assert ep_b.inflight == 2
        await until(lambda: not b.connected)
        await until(lambda: ep_b.inflight == 1, timeout_s=5.0)  # a's entry expired: only b's own
        held.release()
        local.release()

        # Redis is back on the same port: sharing resumes without a restart.
        await redis_server.start()
        await until(lambda: a.connected and b.connected, timeout_s=10.0)
        hashes = chain_block_hashes(list(range(32)), 16)
        again = store_a.reserve(ep_a)
        a.shared(ADDRS[0], hashes, None)
        await until(lambda: ep_b.inflight == 1 and tracker_b.index.match(hashes) == {ADDRS[0]: 2}, timeout_s=10.0)
        again.release()
        await until(lambda: ep_b.inflight == 0)
    finally:
        await a.aclose()
        await b.aclose()
    assert store_a.open_reservations == 0 and store_b.open_reservations == 0


async def test_replicas_at_different_attention_ratios_count_each_others_picks_in_their_own_units(redis_server):
    a, store_a, _ = make_sync(url=redis_server.url, ratio=0.0)
    b, store_b, _ = make_sync(url=redis_server.url, ratio=1e-4)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.connected and b.connected)
        counts = PrefillCounts(8000, 2000)  # 2,000 uncached after 6,000 cached
        from_a = reserve_counted(a, store_a, ADDRS[0], counts)
        from_b = reserve_counted(b, store_b, ADDRS[1], counts)
        await until(lambda: store_b.get(ADDRS[0]).inflight == 1 and store_a.get(ADDRS[1]).inflight == 1)
        assert store_b.get(ADDRS[0]).prefill_tokens == store_b.get(ADDRS[1]).prefill_tokens == counts.work(1e-4) == 4800
        assert store_a.get(ADDRS[1]).prefill_tokens == store_a.get(ADDRS[0]).prefill_tokens == counts.work(0.0) == 2000
        from_a.release()
        from_b.release()
        await until(lambda: store_b.get(ADDRS[0]).inflight == 0 and store_a.get(ADDRS[1]).inflight == 0)
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_malformed_message_on_the_channel_does_not_end_the_subscription(redis_server):
    a, store_a, _ = make_sync(url=redis_server.url)
    b, store_b, _ = make_sync(url=redis_server.url)
    await a.start()
    await b.start()
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        await until(lambda: a.connected and b.connected)
        channel = b.config.channel
        await raw.publish(channel, msgpack.packb(["evil", 0, None]))  # used to end b's subscriber task
        await raw.publish(channel, msgpack.packb(["evil", 0, [["p", 1, ADDRS[0], float("inf"), 1, 1, 2.0]]]))
        await until(lambda: b.metrics.rejected.labels("event")._value.get() == 1)
        assert b.connected
        r = store_a.reserve(store_a.get(ADDRS[0]), 2)
        await until(lambda: store_b.get(ADDRS[0]).inflight == 1)
        r.release()
        await until(lambda: store_b.get(ADDRS[0]).inflight == 0)
    finally:
        await raw.aclose()
        await a.aclose()
        await b.aclose()


async def test_a_bug_while_applying_a_message_is_logged_and_the_subscription_goes_on(redis_server, caplog):
    a, store_a, _ = make_sync(url=redis_server.url)
    b, store_b, _ = make_sync(url=redis_server.url)
    real_apply, calls = b.apply, []

    def apply_failing_once(payload: bytes) -> int:  # fault injection: a bug apply() does not catch
        calls.append(payload)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_apply(payload)

    b.apply = apply_failing_once
    await a.start()
    await b.start()
    try:
        await until(lambda: a.connected and b.connected)
        first = store_a.reserve(store_a.get(ADDRS[0]))
        await until(lambda: len(calls) == 1)
        second = store_a.reserve(store_a.get(ADDRS[1]))
        await until(lambda: store_b.get(ADDRS[1]).inflight == 1)
        assert b.connected and "injected" in caplog.text
        first.release()
        second.release()
    finally:
        await a.aclose()
        await b.aclose()


async def test_aclose_returns_even_when_redis_py_swallows_the_publishers_cancellation(redis_server):
    # redis-py 8.1 can return normally from a PUBLISH cancelled in flight; the publisher then
    # waited for its next event for good and aclose() with it. Closing right after a release
    # (its PUBLISH in flight) hit that within a few rounds.
    for _ in range(25):
        a, store_a, _ = make_sync(url=redis_server.url, flush_ms=0)
        await a.start()
        await until(lambda: a.connected)
        store_a.reserve(store_a.get(ADDRS[0])).release()
        await asyncio.sleep(0)
        close = asyncio.create_task(a.aclose())
        done, _ = await asyncio.wait({close}, timeout=8.0)  # a hang, not a speed: it takes ms
        close.cancel()
        assert close in done, "aclose() did not return"
        assert store_a.open_reservations == 0


async def test_a_subscriber_on_a_silently_dropped_connection_reconnects_and_hears_again(redis_server, redis_proxy):
    # b's connections to Redis go through a proxy that then black-holes them: no byte either
    # way, no FIN, no RST. b's subscriber must notice it hears nothing (not even its own
    # heartbeats or its PINGs' replies) within owner_timeout_s, subscribe again, and hear a.
    a, store_a, _ = make_sync(url=redis_server.url, heartbeat_s=0.2, owner_timeout_s=1.0)
    b, store_b, _ = make_sync(url=f"redis://127.0.0.1:{redis_proxy.port}/0", heartbeat_s=0.2, owner_timeout_s=1.0)
    await a.start()
    await b.start()
    try:
        await until(lambda: a.connected and b.connected)
        ep_a, ep_b = store_a.get(ADDRS[0]), store_b.get(ADDRS[0])
        first = store_a.reserve(ep_a)
        await until(lambda: ep_b.inflight == 1)
        first.release()
        await until(lambda: ep_b.inflight == 0)

        accepted = redis_proxy.accepted
        redis_proxy.blackhole()
        cut = time.monotonic()
        await until(lambda: not b.connected, timeout_s=5.0)
        noticed = time.monotonic() - cut
        # The documented bound: owner_timeout_s + the poll (min(1, heartbeat_s)), plus slack
        # for a loaded 2-core host.
        assert b.silent_reconnects == 1 and b.metrics.silent_reconnects._value.get() == 1 and noticed <= 1.0 + 0.2 + 0.5, noticed
        await until(lambda: b.connected, timeout_s=5.0)
        assert redis_proxy.accepted > accepted  # a new connection, not the dead one revived
        second = store_a.reserve(ep_a)
        await until(lambda: ep_b.inflight == 1, timeout_s=3.0)
        second.release()
        await until(lambda: ep_b.inflight == 0, timeout_s=3.0)
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_working_subscription_is_kept_by_its_ping_replies_when_nothing_else_is_heard(redis_proxy):
    # The replica's own heartbeats stop reaching the channel (every connection but the
    # subscriber's black-holed, new ones too: its publisher fails), and no one else publishes.
    # The subscriber's PINGs are answered on its own connection: it stays subscribed through
    # several owner_timeout_s of silence instead of reconnecting in a loop.
    a, _, _ = make_sync(url=f"redis://127.0.0.1:{redis_proxy.port}/0", heartbeat_s=0.2, owner_timeout_s=0.6)
    await a.start()
    try:
        await until(lambda: a.connected and redis_proxy.accepted == 1)  # the subscriber's connection, index 0
        redis_proxy.blackhole(spare=0, new_too=True)
        dropped = a.metrics.events.labels("dropped")._value.get()
        await asyncio.sleep(2.5)
        assert a.metrics.events.labels("dropped")._value.get() > dropped  # its heartbeats went nowhere
        assert a.connected and a.silent_reconnects == 0
    finally:
        await a.aclose()
