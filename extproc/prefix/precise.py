"""The *precise* source of the prefix index: each engine's own KV-cache events.

For every endpoint with `kv_events` configured, a `KVEventSubscriber` holds a ZMQ SUB socket on
the engine's publisher (vLLM `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'`) and feeds each decoded batch to the shared
`PreciseIndexer`, which mirrors what the engine caches into the `PrefixIndex`:

* `BlockStored` — the engine's hashes depend on its hash seed, ours must not, so our chained
  hashes are recomputed from the event's `token_ids`, chained on *our* hash of the event's
  parent (looked up by the engine's parent hash in a per-endpoint translation table, kept LRU and
  bounded at twice the endpoint's index bound). A store whose parent we never saw (we joined late,
  or the parent was a block we do not index) is skipped: the index only matches from a
  prompt's first block anyway. A LoRA adapter's blocks (`lora_name`) and a salted prompt's
  (`cache_salt` in the first block's `extra_keys`) are keyed as the approximate index keys them
  (`extproc.prefix.hashing.root_hash`: the adapter and salt mixed into the chain's root), so the
  same tokens under another adapter or salt never match. Blocks with other extra hash keys
  (multimodal inputs), with a `lora_id` but no `lora_name`, of a group other than the first, or
  on a medium other than the GPU are not indexed: our hashes cover token ids only, so they would
  match prompts the engine cannot serve from them.
* `BlockRemoved` — the block leaves the index once the engine holds no copy of it (vLLM does not
  deduplicate, so one hash may be stored twice and removed twice: copies are counted).
* `AllBlocksCleared` — the endpoint's entries go (`PrefixTracker.reset(address, "cleared")`).

Sequence numbers: a batch whose number goes back means a new publisher process (an engine
restart): the endpoint's entries go (`"restart"`). A gap means lost batches: with a replay
endpoint the missing ones are asked for (vLLM keeps the last `buffer_steps`); without one, or if
the replay cannot fill the gap, the endpoint's entries go (`"gap"`), since a missed
`BlockRemoved` would otherwise leave an entry for a block the engine no longer holds. On joining,
a replay endpoint also fills in the history before the first batch seen.

Speculative entries: events arrive after the engine computed the prompt (hundreds of ms for a
long one), so a pick alone must count at once — the same long prompt sent twice 5 ms apart must
follow the first. At pick time (`PrefixTracker.on_precise_pick`) the request's blocks enter the
index as speculative, for `speculative_ttl_s` (2 s by default: a long prefill's time to its first
stored block, with margin); a `BlockStored` for the same block confirms it, otherwise it leaves
the index when it expires.

Not thread-safe: everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from extproc.aio import cancel_and_wait
from extproc.prefix.hashing import chain_block_hashes, root_hash
from extproc.prefix.kv_events import (
    MEDIUM_GPU,
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEventBatch,
    KVEvent,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
    encode_seq,
    token_span_ok,
)
from extproc.prefix.tracker import PrefixTracker

__all__ = ["PreciseIndexer", "PreciseMetrics", "KVEventSubscriber", "PreciseSource"]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Largest KV-event message accepted (bytes; ZMQ drops the connection beyond it, then
reconnects). A batch storing an 8k-token prompt is ~38 kB, a 128k-token one ~0.6 MB; an 11 MB
batch held the event loop ~3 s before decoding moved off it (below), so 16 MiB bounds the worst
case that is still decoded."""

OFF_LOOP_DECODE_BYTES = 256 * 1024
"""Payloads larger than this (bytes) are decoded in a worker thread, so the event loop keeps
deciding requests meanwhile (the thread holds the GIL only in slices)."""

APPLY_SLICE_EVENTS = 256
"""Events applied per event-loop turn (the index is updated on the loop, so a long batch is
applied in slices with a yield between them; decisions interleave with a large batch)."""

REPLAY_TIMEOUT_S = 1.0
"""How long a replay may take before the gap is given up (seconds): the publisher answers from
memory in one pass, so anything slower means it is gone."""


class PreciseMetrics:
    """Prometheus series of the KV-event source (endpoint labels only: a bounded set)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        kw = {"registry": registry}
        self.batches = Counter(
            "llm_extproc_kv_event_batches_total", "KV-event batches received from the endpoint's engine.", ["endpoint"], **kw
        )
        self.events = Counter(
            "llm_extproc_kv_events_total",
            "KV events applied, by type (stored, removed, cleared) and outcome (applied, skipped).",
            ["endpoint", "type", "outcome"],
            **kw,
        )
        self.errors = Counter(
            "llm_extproc_kv_event_errors_total",
            "KV-event messages that could not be used, by reason (decode, frames).",
            ["endpoint", "reason"],
            **kw,
        )
        self.gaps = Counter(
            "llm_extproc_kv_event_gaps_total",
            "Sequence gaps in the endpoint's KV events, by how they were handled (replayed, reset).",
            ["endpoint", "outcome"],
            **kw,
        )
        self.speculative = Counter(
            "llm_extproc_prefix_speculative_blocks_total",
            "Blocks added to the prefix index at pick time for a precise endpoint, by fate (confirmed, expired).",
            ["endpoint", "outcome"],
            **kw,
        )


@dataclass(slots=True)
class _Mirror:
    """What we know of one engine's prefix cache.

    Attributes:
        ours: engine hash → [our hash, copies the engine holds] (LRU; copies 0 = a translation
            kept only so a child's parent can still be found).
        held: our hash → engine entries with copies > 0 mapping to it.
        speculative: our hash → its expiry (monotonic seconds), for blocks added at pick time.
        last_seq: the last sequence number applied (None before the first batch).
    """

    ours: OrderedDict[EngineBlockHash, list[int]] = field(default_factory=OrderedDict)
    held: dict[int, int] = field(default_factory=dict)
    speculative: dict[int, float] = field(default_factory=dict)
    last_seq: int | None = None


_UNKEYABLE = object()
"""`stored_salt`'s answer for a store whose extra keys the index cannot key."""


def stored_salt(ev: BlockStored) -> str | None | object:
    """The `cache_salt` of a stored run of blocks, from its `extra_keys` (vLLM: per block a tuple
    of the adapter's name, multimodal hashes, and on a prompt's first block its salt; None for a
    block with none): None for no salt, the salt, or `_UNKEYABLE` where a block carries anything
    else (multimodal inputs: our hashes cannot cover them) or a salt on a block that does not
    start a prompt."""
    if ev.extra_keys is None:
        return None
    salt: str | None = None
    for i, keys in enumerate(ev.extra_keys):
        if keys is None:
            continue
        rest = [k for k in (keys if isinstance(keys, tuple | list) else (keys,)) if k != ev.lora_name]
        if not rest:
            continue
        if i == 0 and ev.parent_block_hash is None and len(rest) == 1 and isinstance(rest[0], str):
            salt = rest[0]
            continue
        return _UNKEYABLE
    return salt


class PreciseIndexer:
    """Applies KV-event batches and pick-time speculation to the tracker's prefix index.

    Args:
        tracker: the prefix tracker; `tracker.precise` and `tracker.on_precise_pick` are set here.
        speculative_ttl_s: how long a pick-time entry lives unconfirmed (seconds, > 0).
        metrics: Prometheus series (None: a private registry, for tests).
        clock: monotonic seconds.

    Raises:
        ValueError: `speculative_ttl_s` is not positive.
    """

    def __init__(
        self,
        tracker: PrefixTracker,
        *,
        speculative_ttl_s: float = 2.0,
        metrics: PreciseMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if speculative_ttl_s <= 0:
            raise ValueError(f"speculative_ttl_s must be positive, got {speculative_ttl_s}")
        self.tracker = tracker
        self.ttl = speculative_ttl_s
        self.metrics = metrics or PreciseMetrics(CollectorRegistry())
        self._clock = clock
        self._mirrors: dict[str, _Mirror] = {}
        self._expiry: deque[tuple[float, str, tuple[int, ...]]] = deque()
        tracker.on_precise_pick = self.on_pick
        tracker.on_reset = self._forget

    # -- registration -----------------------------------------------------------------------
    def register(self, address: str) -> None:
        """Make `address` a precise endpoint (its index comes from its engine's events)."""
        self._mirrors.setdefault(address, _Mirror())
        self.tracker.precise.add(address)

    def unregister(self, address: str) -> None:
        """Stop treating `address` as precise and forget its mirror (its index entries stay
        until the tracker drops them)."""
        self._mirrors.pop(address, None)
        self.tracker.precise.discard(address)

    def mirror_size(self, address: str) -> int:
        """Engine hashes remembered for `address` (held or kept for translation)."""
        m = self._mirrors.get(address)
        return len(m.ours) if m is not None else 0

    def last_seq(self, address: str) -> int | None:
        """The last sequence number applied for `address`."""
        m = self._mirrors.get(address)
        return m.last_seq if m is not None else None

    # -- events -----------------------------------------------------------------------------
    def reset(self, address: str, reason: str) -> None:
        """Forget what `address`'s engine holds (`reason`: cleared, restart, gap): its index
        entries (through the tracker, which calls `_forget` back) and its mirror."""
        if address in self._mirrors:
            self.tracker.reset(address, reason)

    def _forget(self, address: str) -> None:
        """The tracker dropped `address`'s entries (also on a restart seen in its metrics)."""
        m = self._mirrors.get(address)
        if m is not None:
            m.ours.clear()
            m.held.clear()
            m.speculative.clear()

    def accept_seq(self, address: str, seq: int) -> None:
        """Record that batch `seq` of `address` was applied."""
        m = self._mirrors.get(address)
        if m is not None:
            m.last_seq = seq

    def apply(self, address: str, batch: KVEventBatch) -> None:
        """Apply one batch's events in order, at once (an unregistered address is ignored)."""
        for _ in self._apply_slices(address, batch, len(batch.events) or 1):
            pass

    async def apply_sliced(self, address: str, batch: KVEventBatch, *, slice_events: int = APPLY_SLICE_EVENTS) -> None:
        """`apply`, yielding to the event loop after every `slice_events` events (a batch of
        thousands of events would otherwise hold every decision behind it)."""
        for _ in self._apply_slices(address, batch, slice_events):
            await asyncio.sleep(0)

    def _apply_slices(self, address: str, batch: KVEventBatch, slice_events: int) -> Iterator[None]:
        """Count the batch and apply its events `slice_events` at a time, yielding between two
        slices (nothing for an unregistered address)."""
        if address not in self._mirrors:
            return
        self.metrics.batches.labels(address).inc()
        events = batch.events
        for start in range(0, len(events), slice_events):
            if start:
                yield
            self.apply_events(address, events[start : start + slice_events])

    def apply_events(self, address: str, events: Sequence[KVEvent]) -> None:
        """Apply events in order (an unregistered address — e.g. removed between slices — is
        ignored). Counts no batch: `apply` / `apply_sliced` do."""
        m = self._mirrors.get(address)
        if m is None:
            return
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(address, m, ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(address, m, ev)
            elif isinstance(ev, AllBlocksCleared):
                self.reset(address, "cleared")
                self.metrics.events.labels(address, "cleared", "applied").inc()

    def _stored(self, address: str, m: _Mirror, ev: BlockStored) -> None:
        count = self.metrics.events
        salt = stored_salt(ev)
        if (
            ev.medium not in (None, MEDIUM_GPU)
            or (ev.lora_id is not None and ev.lora_name is None)
            or salt is _UNKEYABLE
            or ev.group_idx not in (None, 0)
            or not token_span_ok(ev)
        ):
            count.labels(address, "stored", "skipped").inc()
            return
        if ev.parent_block_hash is None:
            parent = root_hash(ev.lora_name, salt)  # type: ignore[arg-type]
        else:
            entry = m.ours.get(ev.parent_block_hash)
            if entry is None:
                count.labels(address, "stored", "skipped").inc()
                return
            parent = entry[0]
        hashes = chain_block_hashes(ev.token_ids, ev.block_size, parent)
        ours = m.ours
        for engine_hash, h in zip(ev.block_hashes, hashes, strict=True):
            entry = ours.get(engine_hash)
            if entry is None:
                ours[engine_hash] = entry = [h, 0]
            else:
                ours.move_to_end(engine_hash)
                entry[0] = h
            entry[1] += 1
            if entry[1] == 1:
                m.held[h] = m.held.get(h, 0) + 1
            if m.speculative.pop(h, None) is not None:
                self.metrics.speculative.labels(address, "confirmed").inc()
        self.tracker.index.add(address, hashes)
        self._bound(address, m)
        count.labels(address, "stored", "applied").inc()

    def _removed(self, address: str, m: _Mirror, ev: BlockRemoved) -> None:
        if ev.medium not in (None, MEDIUM_GPU) or ev.group_idx not in (None, 0):
            self.metrics.events.labels(address, "removed", "skipped").inc()
            return
        gone: list[int] = []
        for engine_hash in ev.block_hashes:
            entry = m.ours.get(engine_hash)
            if entry is None or entry[1] == 0:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                self._release(m, entry[0], gone)
        if gone:
            self.tracker.index.remove(address, gone)
        self.metrics.events.labels(address, "removed", "applied").inc()

    @staticmethod
    def _release(m: _Mirror, h: int, gone: list[int]) -> None:
        left = m.held.get(h, 0) - 1
        if left > 0:
            m.held[h] = left
            return
        m.held.pop(h, None)
        if h not in m.speculative:
            gone.append(h)

    def _bound(self, address: str, m: _Mirror) -> None:
        """Keep the translation table within twice the endpoint's index bound; a held entry
        that falls off leaves the index too (we could no longer match its removal)."""
        limit = 2 * self.tracker.index.capacity(address)
        gone: list[int] = []
        while len(m.ours) > limit:
            _, (h, copies) = m.ours.popitem(last=False)
            if copies > 0:
                self._release(m, h, gone)
        if gone:
            self.tracker.index.remove(address, gone)

    # -- pick-time speculation --------------------------------------------------------------
    def on_pick(self, address: str, hashes: list[int]) -> None:
        """A request with the block chain `hashes` (ours) was just routed to `address`: its
        blocks count there until its engine confirms them or `speculative_ttl_s` passes."""
        now = self._clock()
        self.expire(now)
        m = self._mirrors.get(address)
        if m is None or not hashes:
            return
        until = now + self.ttl
        fresh = tuple(h for h in hashes if h not in m.held)
        for h in fresh:
            m.speculative[h] = until
        self.tracker.index.add(address, hashes)
        if fresh:
            self._expiry.append((until, address, fresh))

    def expire(self, now: float | None = None) -> int:
        """Drop speculative entries past their expiry that no event confirmed. Returns how
        many left the index."""
        now = self._clock() if now is None else now
        q = self._expiry
        dropped = 0
        while q and q[0][0] <= now:
            until, address, hashes = q.popleft()
            m = self._mirrors.get(address)
            if m is None:
                continue
            gone = []
            for h in hashes:
                if m.speculative.get(h) == until:  # not refreshed by a later pick
                    del m.speculative[h]
                    if h not in m.held:
                        gone.append(h)
            if gone:
                dropped += self.tracker.index.remove(address, gone)
                self.metrics.speculative.labels(address, "expired").inc(len(gone))
        return dropped


class KVEventSubscriber:
    """One endpoint's KV-event stream: a ZMQ SUB socket (all topics) and, when configured, a
    DEALER socket on the publisher's replay ROUTER.

    Args:
        address: the endpoint (`ip:port`, the index key).
        endpoint: the engine's publisher, e.g. `tcp://10.0.0.5:5557` (we connect).
        replay: the engine's replay socket (`tcp://host:port`), or None.
        indexer: where batches go.
        context: the ZMQ asyncio context.
    """

    def __init__(
        self, address: str, endpoint: str, replay: str | None, indexer: PreciseIndexer, context: zmq.asyncio.Context
    ) -> None:
        self.address = address
        self.endpoint = endpoint
        self.replay_endpoint = replay
        self.indexer = indexer
        self._ctx = context
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self.stopped = False

    async def start(self) -> None:
        """`open` (kept awaitable for callers that start subscribers in a loop)."""
        self.open()

    def open(self) -> None:
        """Connect (ZMQ connects in the background; a publisher not up yet is fine) and start
        reading (on the running event loop)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.IPV6, 1)  # off by default: a tcp://[addr]:port connect would hear nothing
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.connect(self.endpoint)
        self._sub = sub
        self.indexer.register(self.address)
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.address}")

    def stop(self) -> None:
        """Stop applying now: cancel the reading task and mark this subscriber stopped, so a
        message it already received applies nothing once its wait ends (the address may
        already belong to another publisher's subscriber). `aclose` closes the sockets."""
        self.stopped = True
        if self._task is not None:
            self._task.cancel()

    async def aclose(self) -> None:
        """Stop reading and close the sockets. Idempotent."""
        self.stop()
        await cancel_and_wait([self._task])
        self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        assert self._sub is not None
        sub = self._sub
        while True:
            frames = await sub.recv_multipart()
            try:
                await self.handle(frames)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad message end the stream
                log.exception("kv events from %s: unexpected error", self.address)

    async def handle(self, frames: Sequence[bytes]) -> None:
        """Apply one PUB message `[topic, seq, payload]` (gaps filled or reset first)."""
        idx = self.indexer
        addr = self.address
        metrics = idx.metrics
        if self.stopped:
            return
        if len(frames) != 3:
            metrics.errors.labels(addr, "frames").inc()
            return
        try:
            seq = decode_seq(frames[1])
            payload = frames[2]
            if len(payload) > OFF_LOOP_DECODE_BYTES:
                batch = await asyncio.to_thread(decode_batch, payload)
            else:
                batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            metrics.errors.labels(addr, "decode").inc()
            log.warning("kv events from %s: %s", addr, exc)
            return
        if self.stopped:  # while decoding off the loop
            return
        last = idx.last_seq(addr)
        if last is None:
            if seq > 0 and self.replay_endpoint is not None:
                await self._replay(0, seq, reset_if_short=False)
        elif seq <= last:
            idx.reset(addr, "restart")  # a new publisher process counts from 0 again
        elif seq > last + 1:
            replayed = self.replay_endpoint is not None and await self._replay(last + 1, seq, reset_if_short=True)
            if self.stopped:  # while asking for a replay
                return
            if not replayed:
                metrics.gaps.labels(addr, "reset").inc()
                idx.reset(addr, "gap")
            else:
                metrics.gaps.labels(addr, "replayed").inc()
        if self.stopped:  # while asking for a replay
            return
        await idx.apply_sliced(addr, batch)
        idx.accept_seq(addr, seq)

    async def _replay(self, start: int, stop: int, *, reset_if_short: bool) -> bool:
        """Ask the replay socket for batches `start`..`stop − 1` and apply them. Returns
        whether all of them came (with `reset_if_short`, none is applied unless all did)."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        got: list[tuple[int, KVEventBatch]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", encode_seq(start)])
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 3:
                        self.indexer.metrics.errors.labels(self.address, "frames").inc()
                        continue
                    seq = decode_seq(frames[1])
                    if seq == REPLAY_END_SEQ:
                        break
                    if start <= seq < stop:
                        got.append((seq, decode_batch(frames[2])))
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError) as exc:
            log.warning("kv events from %s: replay of %d..%d failed: %s", self.address, start, stop - 1, exc)
            if reset_if_short:
                return False
        finally:
            sock.close(linger=0)
        got.sort(key=lambda x: x[0])
        # Every seq of start..stop-1 exactly once, checked without building that range: joining
        # an engine up for weeks asks from 0 to a seq in the 10^8s.
        complete = len(got) == stop - start and all(s == start + i for i, (s, _) in enumerate(got))
        if (reset_if_short and not complete) or self.stopped:
            return False
        for seq, batch in got:
            self.indexer.apply(self.address, batch)
            self.indexer.accept_seq(self.address, seq)
        return complete


class PreciseSource:
    """The subscribers of every endpoint with `kv_events` configured, and their indexer; one
    speculative-expiry sweep. `start()` / `aclose()` from the server's lifecycle; `add` and
    `remove` as endpoints come, go or change publisher.

    Args:
        tracker: the prefix tracker.
        endpoints: (address, kv_events endpoint, replay endpoint or None) per precise endpoint
            known at construction (more come with `add`).
        speculative_ttl_s: see `PreciseIndexer`.
        registry: Prometheus registry.
    """

    def __init__(
        self,
        tracker: PrefixTracker,
        endpoints: Iterable[tuple[str, str, str | None]],
        *,
        speculative_ttl_s: float = 2.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.indexer = PreciseIndexer(tracker, speculative_ttl_s=speculative_ttl_s, metrics=PreciseMetrics(registry))
        self._endpoints = list(endpoints)
        self._ctx: zmq.asyncio.Context | None = None
        self.subscribers: list[KVEventSubscriber] = []
        self._sweep: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._started = False
        for address, _, _ in self._endpoints:
            self.indexer.register(address)

    async def start(self) -> None:
        """Open one subscriber per endpoint and start the expiry sweep (once there is one)."""
        self._started = True
        for address, endpoint, replay in self._endpoints:
            self._open(address, endpoint, replay)

    def _open(self, address: str, endpoint: str, replay: str | None) -> None:
        """Subscribe to one publisher now (on the running event loop)."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        s = KVEventSubscriber(address, endpoint, replay, self.indexer, self._ctx)
        s.open()
        self.subscribers.append(s)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().create_task(self._sweep_loop(), name="kv-events-expiry")

    def add(self, address: str, endpoint: str, replay: str | None) -> None:
        """Make `address` precise, its events read from `endpoint` (`tcp://host:port`; replay
        socket `replay` or None): subscribed now when started, else at `start`. The same
        publisher again changes nothing; another one replaces the old subscription (the
        mirror starts over: a new publisher's sequence restarts)."""
        if (address, endpoint, replay) in self._endpoints:
            return
        if any(e[0] == address for e in self._endpoints):
            self.remove(address)
        self._endpoints.append((address, endpoint, replay))
        self.indexer.register(address)
        if self._started:
            self._open(address, endpoint, replay)

    def remove(self, address: str) -> asyncio.Task[None] | None:
        """The endpoint `address` left the fleet (or no longer publishes events): forget its
        mirror and stop its subscriber: stopped now (nothing it received applies any more, to
        this mirror or to a new publisher's for the same address), its sockets closed in the
        background (returns that task, None when it had none). Call before the tracker's
        `drop_endpoint`, so no late batch re-adds what that drops."""
        self.indexer.unregister(address)
        self._endpoints = [e for e in self._endpoints if e[0] != address]
        gone = [s for s in self.subscribers if s.address == address]
        if not gone:
            return None
        self.subscribers = [s for s in self.subscribers if s.address != address]
        for s in gone:
            s.stop()
        task = asyncio.get_running_loop().create_task(self._close(gone), name=f"kv-events-close-{address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    @staticmethod
    async def _close(subscribers: list[KVEventSubscriber]) -> None:
        for s in subscribers:
            await s.aclose()

    async def _sweep_loop(self) -> None:
        period = min(0.5, self.indexer.ttl / 4)
        while True:
            await asyncio.sleep(period)
            self.indexer.expire()

    async def aclose(self) -> None:
        """Stop every subscriber and the sweep; close the ZMQ context. Idempotent."""
        self._started = False
        await cancel_and_wait([self._sweep])
        self._sweep = None
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        for s in self.subscribers:
            await s.aclose()
        self.subscribers.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
