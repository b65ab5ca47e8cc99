"""Replica sync: each replica's picks reach the others over one Redis pub/sub channel.

What travels (docs/decisions/0210-replicas-share-picks-over-redis.md):

* a pick's reservation — endpoint, KV blocks, prefill and decode-context tokens — so every
  replica counts every replica's requests in flight (`Endpoint.inflight`, `prefill_tokens`,
  `reserved_blocks`, ...), its first token (prefill → decode) and its release;
* a pick's prompt block hashes and session key, which the other replicas add to their approximate
  prefix index and session table (`PrefixTracker.apply_remote_pick`);
* an operator's weight override (`POST /api/v1/weights/override`, the Alertmanager webhook): the
  admin Service reaches one replica, which applies it and passes it on, so every replica drains
  or lowers the endpoint for the same time (measured from when each one hears it);
* a heartbeat every `heartbeat_s` with the ids of the replica's open reservations: a release lost
  in transit is undone by the next heartbeat, and a replica not heard from for
  `owner_timeout_s` (killed, partitioned) has everything it held released.

What does not: engine metrics, KV events, learned prefill speeds and outlier state — each replica
observes the engines itself, and those observations converge without help.

Nothing here is on the critical path of a decision: the datastore's and tracker's hooks append a
tuple to a bounded in-memory queue (full: the event is dropped and counted) and a publisher task
sends what accumulated in one PUBLISH (msgpack). A subscriber task applies the others' batches
on the event loop between decisions. Redis down: the replica decides on its own state, the
others' reservations expire, and both tasks reconnect by themselves.

Keepalive: the subscriber's connection has no read timeout (it is idle between messages by
design), so a TCP path dropped without a FIN or RST (a NAT or conntrack entry lost, a peer
host gone) would leave it "connected" and hearing nothing, forever. It therefore counts what it
hears: any message (this replica's own heartbeats, every `heartbeat_s`, included) or the reply
to a PING it sends on its own connection after `heartbeat_s` of silence. Nothing heard for
`owner_timeout_s` means the connection is dead: it is dropped and the channel subscribed again,
so a half-open connection is replaced within `owner_timeout_s` + `min(1, heartbeat_s)` (the
poll) + `RECONNECT_S` + the new subscription (docs/replicas.md). redis-py's own
`health_check_interval` does not do this: it sends a PING but never notices the missing PONG.

Wire format (msgpack): `[origin, sent_at, events]`, `origin` a random id per process,
`sent_at` the wall time (`time.time()`, seconds) the oldest event of the batch was queued, and
each event one of:

    ["p", rid, address, blocks, prompt_tokens, context_tokens, settle_after_s]   reservation
    ["w", rid, prompt_tokens, uncached_tokens, [prompt length, ...]]             its prefill counts
    ["f", rid]                                                                  first token
    ["r", rid]                                                                  release
    ["x", address, [block hash, ...], session key or nil]                        prefix / session
    ["o", address, factor, duration_s, reason, source]                           weight override
    ["h", [rid, ...] or nil]                                                     heartbeat
    ["b"]                                                                       leaving

A pick's `prompt_tokens` is its prefill work at the sender's attention ratio
(`scheduling.prefill_model.attention_ratio`); the "w" event after it, in the same batch, carries
the counts that work came from (the whole prompt, the part not believed cached on the endpoint,
each prompt's length of a batched completion, `[]` for one prompt), and a receiver that has it
counts the pick's work at its own ratio (`PrefillCounts.work`): replicas mid-way through a rolling
change of the ratio mixed units in one endpoint's backlog (decision 0280). A receiver without
one (an older sender; the event dropped by a full queue) uses the sender's work. A replica of
an older version rejects a "w" alone (counted) and still applies the pick.

Anything that can publish on the channel is read as untrusted input: a message not of this shape
is rejected whole, an event not of its shape (a number that is not finite or out of range, an id
that is not an int, a session key that is not short bytes) is rejected alone, both counted in
`llm_extproc_replica_sync_rejected_total{what}` and logged at most once per `LOG_EVERY_S`. No
message, however built, ends the subscription. Events after a goodbye in the same batch are
ignored, and at most `MAX_PEERS` other replicas are tracked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgpack
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from extproc.datastore.endpoints import Datastore, Reservation
from extproc.datastore.overrides import MAX_DURATION_S, MAX_REASON_CHARS, SOURCES, set_override
from extproc.datastore.prefill_fit import PREFILL_ATTENTION_RATIO, PrefillCounts
from extproc.logthrottle import WarnEvery
from extproc.prefix.tracker import PrefixTracker
from extproc.ratelimit.config import RedisConfig
from extproc.ratelimit.redis_client import redis_client
from extproc.replicas.config import ReplicasConfig

__all__ = ["ReplicaSync", "SyncMetrics", "redis_location"]

log = logging.getLogger(__name__)

MAX_HEARTBEAT_IDS = 50_000
"""A heartbeat lists at most this many open reservations (about 0.5 MB of msgpack); beyond it it
lists none and the others skip that round of reconciliation (owner expiry still applies)."""

RECONNECT_S = 0.5
"""Seconds between two attempts to reach Redis again."""

KEEPALIVE_PING = b"llm-extproc-replica-keepalive"
"""The argument of the subscriber's own PING (echoed in the PONG, which counts as hearing)."""

CLOSE_WAIT_S = 5.0
"""Most seconds `aclose` waits for its tasks to stop. redis-py (8.1) can return normally from a
PUBLISH whose task was cancelled, so the cancellation is lost: every loop also checks a closing
flag, and a task that still has not stopped by then is left behind with a warning."""

LOG_EVERY_S = 10.0
"""Least seconds between two log lines of one kind (Redis lost, input rejected): a flood of bad
messages or a Redis outage is counted in the metrics, not written once per message."""

MAX_PEERS = 1024
"""Other replicas tracked at once (count). A batch from a replica not yet tracked is rejected
while this many are (each is forgotten `owner_timeout_s` after its last batch), so random
origin ids on the channel cannot grow the table without bound. Far above the handful of router
replicas a fleet runs."""

MAX_ORIGIN_CHARS = 256
"""Longest replica id accepted from the channel (characters; ours are about 20)."""

MAX_COUNT = 1 << 24
"""Largest KV block count and token count of a remote pick accepted (16,777,216): above any
engine's KV cache in blocks and any model's context in tokens, so a larger number is bad input,
not a request."""

MAX_PREFILL_WORK = 1 << 40
"""Largest prefill work of a remote pick accepted (linear-token equivalents, ~1.1e12): the work
counts attention (`extproc.datastore.prefill_fit.prefill_work`), which grows with the square of
the prompt, so a 1M-token prompt is 21M of work at the default ratio; `MAX_COUNT` dropped such
picks as malformed and every other replica went on routing to the busy endpoint."""

MAX_PROMPT_LENGTHS = 1 << 16
"""Most prompt lengths of a remote pick's counts accepted (count; `limits.max_prompts`, the
prompts of one batched completion, defaults to 1,024)."""

MAX_SETTLE_S = 3600.0
"""Largest `settle_after_s` of a remote pick accepted (seconds); the configured value is a few
seconds (`scheduling.settle_after_s`, default 2). An infinite one would never settle."""

MAX_SESSION_BYTES = 256
"""Longest session key accepted from the channel (bytes; ours are 16-byte BLAKE2b digests,
`extproc.prefix.sessions.session_key`)."""

_U64 = 1 << 64
"""Block hashes are unsigned 64-bit (`extproc.prefix.hashing.chain_block_hashes`)."""


def redis_location(url: str) -> str:
    """`host:port/db` of a Redis URL, or `unix:/path` of a socket's, without user, password or
    query string (for logs; a socket's password goes in its query, `?password=`)."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "unix":  # was "?:6379/run/redis.sock"
        return f"unix:{parts.path}"
    return f"{parts.hostname or '?'}:{parts.port or 6379}{parts.path or ''}"


class SyncMetrics:
    """Prometheus series of replica sync (no endpoint or replica labels: a fixed set)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        kw = {"registry": registry}
        self.events = Counter(
            "llm_extproc_replica_sync_events_total",
            "Replica-sync events, by direction: published (sent to Redis), applied (another replica's, "
            "applied here), dropped (queue full or Redis unreachable: never sent).",
            ["direction"],
            **kw,
        )
        self.delay = Histogram(
            "llm_extproc_replica_sync_delay_seconds",
            "From another replica queueing an event to this replica applying it (seconds; wall clocks, "
            "exact on one host, as good as clock sync across hosts).",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            **kw,
        )
        self.expired = Counter(
            "llm_extproc_replica_sync_expired_total",
            "Reservations of another replica released here without its release event, by reason "
            "(owner_gone: not heard from for owner_timeout_s; reconciled: absent from its heartbeat).",
            ["reason"],
            **kw,
        )
        self.rejected = Counter(
            "llm_extproc_replica_sync_rejected_total",
            "Input from the replica channel ignored, by what: message (not [origin, sent_at, events], or "
            "from one replica more than max peers), event (malformed, non-finite or out-of-range values, "
            "or failed to apply).",
            ["what"],
            **kw,
        )
        self.connected = Gauge("llm_extproc_replica_sync_connected", "1 while subscribed to the replica channel.", **kw)
        self.silent_reconnects = Counter(
            "llm_extproc_replica_sync_silent_reconnects_total",
            "Subscriptions dropped and made again because nothing was heard on them for owner_timeout_s, "
            "not even the reply to their own PING (a connection dropped without FIN or RST).",
            **kw,
        )
        self.peers = Gauge("llm_extproc_replica_sync_peers", "Other replicas heard from within owner_timeout_s.", **kw)
        self.remote_inflight = Gauge(
            "llm_extproc_replica_sync_remote_inflight", "Requests in flight that other replicas routed, counted here.", **kw
        )


@dataclass(slots=True)
class _Peer:
    """Another replica as seen from here: when it was last heard, its open reservations."""

    last_seen: float
    open: dict[int, Reservation] = field(default_factory=dict)


class ReplicaSync:
    """Publish this replica's picks and apply the others' (see the module doc).

    Args:
        config: `replicas`.
        redis: the Redis connection (`ratelimit.redis`: url, timeout_ms).
        store: the datastore (its `listener` is set to this object).
        tracker: the prefix tracker (its `on_shared` hook is set), or None.
        registry: where the metrics go (None: a private registry).
        replica_id: this replica's id on the channel (default: random, new per process).
        clock: monotonic seconds.
        attention_ratio: this replica's `scheduling.prefill_model.attention_ratio` (1/tokens):
            the other replicas' picks are counted at it when they carry their counts.
    """

    def __init__(
        self,
        config: ReplicasConfig,
        redis: RedisConfig,
        store: Datastore,
        tracker: PrefixTracker | None = None,
        *,
        registry: CollectorRegistry | None = None,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        attention_ratio: float = PREFILL_ATTENTION_RATIO,
    ) -> None:
        self.config = config
        self.attention_ratio = attention_ratio
        self.id = replica_id or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._own_head = b"\x93" + msgpack.packb(self.id)
        """How this replica's own batches start (a 3-array, then its id): skipped unread."""
        self.metrics = SyncMetrics(registry if registry is not None else CollectorRegistry())
        self._redis = redis
        self._store = store
        self._tracker = tracker
        self._clock = clock
        self._queue: list[list[Any]] = []
        self._queued_at = 0.0
        self._wake = asyncio.Event()
        self._next_rid = 0
        self._local: dict[Reservation, int] = {}
        self._peers: dict[str, _Peer] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._pub: aioredis.Redis | None = None
        # One throttle per kind of line. A Redis outage is logged at the rate limiter's interval
        # (`ratelimit.redis.log_interval_s`: the same server, the same outage); a failing
        # subscriber and rejected input at LOG_EVERY_S.
        self._redis_log = WarnEvery(log, redis.log_interval_s, self._clock)
        self._subscriber_log, self._reject_log = (WarnEvery(log, LOG_EVERY_S, self._clock) for _ in range(2))
        self.connected = False
        self.silent_reconnects = 0
        """Subscriptions dropped for hearing nothing for `owner_timeout_s` (count; module doc)."""
        self._closing = False
        m = self.metrics
        self._published = m.events.labels("published")
        self._applied = m.events.labels("applied")
        self._dropped = m.events.labels("dropped")
        self._bad_message = m.rejected.labels("message")
        self._bad_event = m.rejected.labels("event")
        self._reconciled = m.expired.labels("reconciled")
        self._owner_gone = m.expired.labels("owner_gone")
        m.remote_inflight.set_function(lambda: self.remote_inflight)
        m.peers.set_function(lambda: len(self._peers))
        store.listener = self
        if tracker is not None:
            tracker.on_shared = self.shared

    # -- the decision's side: queue only ----------------------------------------------------
    def _enqueue(self, event: list[Any]) -> None:
        if len(self._queue) >= self.config.max_queue:
            self._dropped.inc()
            return
        if not self._queue:
            self._queued_at = time.time()
        self._queue.append(event)
        self._wake.set()

    def reserved(self, r: Reservation) -> None:
        """A reservation was made here: share it (a remote one is applied with `notify=False`,
        so it never comes here to be sent again)."""
        rid = self._next_rid = self._next_rid + 1
        self._local[r] = rid
        ep = r.endpoint
        # A batched completion reserves every sequence's blocks and decode context (up to
        # `limits.max_prompts` × n of 128), which may pass the bound the receivers accept; any
        # count at the bound already exceeds every engine, so sending the bound loses nothing,
        # while sending more had every other replica drop the pick as malformed.
        blocks, context = min(r.blocks, MAX_COUNT), min(r.context_tokens, MAX_COUNT)
        work = min(r.prompt_tokens, MAX_PREFILL_WORK)
        self._enqueue(["p", rid, ep.address, blocks, work, context, round(r.settle_at - r.created_at, 3)])
        c = r.prefill_counts
        if c is not None:  # right after its pick: one batch holds both (module doc)
            self._enqueue(["w", rid, c.prompt_tokens, c.uncached, list(c.prompt_lengths)])

    def first_token(self, r: Reservation) -> None:
        """A local reservation reached its first token."""
        rid = self._local.get(r)
        if rid is not None:
            self._enqueue(["f", rid])

    def released(self, r: Reservation) -> None:
        """A local reservation was released."""
        rid = self._local.pop(r, None)
        if rid is not None:
            self._enqueue(["r", rid])

    def override(self, address: str, factor: float, duration_s: float, reason: str, source: str) -> None:
        """A weight override was applied here (the admin API's): pass it on, so the other
        replicas apply it too (`factor` in [0, 1], 1 clears; `duration_s` seconds from when each
        hears it)."""
        self._enqueue(["o", address, float(factor), float(duration_s), reason[:MAX_REASON_CHARS], source])

    def shared(self, address: str, hashes: list[int], session: bytes | None) -> None:
        """A pick's prompt block hashes (at the endpoint's block size, which the receiver knows)
        and session, for the others' prefix index and session table."""
        self._enqueue(["x", address, hashes[: self.config.max_hashes], session])

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start publishing, subscribing and expiring (returns at once; Redis may be down)."""
        self._closing = False
        self._pub = redis_client(self._redis)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._publisher(), name="replica-sync-publish"),
            loop.create_task(self._subscriber(), name="replica-sync-subscribe"),
            loop.create_task(self._ticker(), name="replica-sync-heartbeat"),
        ]
        log.info(
            "replica sync on redis %s channel %r as replica %s: picks, first tokens, releases and prefix blocks "
            "are shared with the other replicas",
            redis_location(self._redis.url),
            self.config.channel,
            self.id,
        )

    async def aclose(self) -> None:
        """Say goodbye (the others release what this replica held at once), stop the tasks
        (waiting at most `CLOSE_WAIT_S` for them)."""
        self._closing = True
        if self._pub is not None and self._tasks:
            try:
                async with asyncio.timeout(self._redis.timeout_ms / 1000 * 2):
                    await self._pub.publish(self.config.channel, msgpack.packb([self.id, time.time(), [["b"]]]))
            except (RedisError, OSError, TimeoutError):
                pass
        for t in self._tasks:
            t.cancel()
        self._wake.set()  # a publisher whose cancellation redis-py swallowed sees _closing at once
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=CLOSE_WAIT_S)
            for t in self._tasks:
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved: an error of a task being stopped changes nothing
            if pending:
                log.warning("replica sync: %d task(s) did not stop within %.0f s", len(pending), CLOSE_WAIT_S)
        self._tasks = []
        if self._pub is not None:
            await self._pub.aclose()
            self._pub = None
        self._store.listener = None
        if self._tracker is not None:
            self._tracker.on_shared = None
        for peer in self._peers.values():
            self._release_all(peer)
        self._peers.clear()

    def _warn(self, what: str, exc: BaseException) -> None:
        self._redis_log.warning(
            "replica sync: %s (%s: %s); deciding on this replica's own state until Redis answers", what, type(exc).__name__, exc
        )

    async def _publisher(self) -> None:
        assert self._pub is not None
        timeout = self._redis.timeout_ms / 1000 * 2
        window = self.config.flush_ms / 1000
        last = float("-inf")
        while not self._closing:
            await self._wake.wait()
            if self._closing:
                return
            # At most one PUBLISH per `flush_ms`: what queues meanwhile goes in the same batch,
            # so the cost per second is bounded whatever the decision rate (an event after a
            # quiet spell goes at once).
            wait = last + window - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._wake.clear()
            if not self._queue:
                continue
            last = time.monotonic()
            batch, self._queue = self._queue, []
            payload = msgpack.packb([self.id, self._queued_at, batch])
            try:
                async with asyncio.timeout(timeout):
                    await self._pub.publish(self.config.channel, payload)
                self._published.inc(len(batch))
            except (RedisError, OSError, TimeoutError) as exc:
                self._dropped.inc(len(batch))
                self._warn("cannot publish", exc)
                await asyncio.sleep(RECONNECT_S)  # what queues meanwhile goes in the next try

    async def _subscriber(self) -> None:
        timeout = self._redis.timeout_ms / 1000
        poll = min(1.0, self.config.heartbeat_s)
        while not self._closing:
            client = redis_client(self._redis, subscriber=True)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                async with asyncio.timeout(timeout * 4):
                    await pubsub.subscribe(self.config.channel)
                self._set_connected(True)
                heard = pinged = time.monotonic()
                while not self._closing:
                    msg = await pubsub.get_message(timeout=poll)
                    now = time.monotonic()
                    if msg is not None:
                        heard = now  # a message, ours included, or our PING's reply
                    elif now - heard >= self.config.owner_timeout_s:
                        self.silent_reconnects += 1
                        self.metrics.silent_reconnects.inc()
                        raise TimeoutError(f"nothing heard for {now - heard:.1f} s, not even a PING's reply: the connection is dead")
                    elif now - max(heard, pinged) >= self.config.heartbeat_s:
                        async with asyncio.timeout(timeout):
                            await pubsub.ping(KEEPALIVE_PING)
                        pinged = now
                    if msg is not None and msg.get("type") == "message" and not msg["data"].startswith(self._own_head):
                        try:
                            self.apply(msg["data"])
                        except Exception as exc:  # a bug must not end the subscription for good
                            self._bad_message.inc()
                            self._reject("a message could not be applied", exc, exc_info=True)
            except (RedisError, OSError, TimeoutError) as exc:
                self._set_connected(False)
                self._warn("lost the replica channel", exc)
            except Exception as exc:  # anything else (not CancelledError): subscribe again, never stop
                self._set_connected(False)
                self._subscriber_log.log(
                    logging.ERROR, "replica sync: the subscriber failed (%s: %s); subscribing again", type(exc).__name__, exc, exc_info=True
                )
            finally:
                self._set_connected(False)
                try:
                    async with asyncio.timeout(timeout):  # a dead connection must not hold the retry
                        await pubsub.aclose()
                        await client.aclose()
                except (RedisError, OSError, TimeoutError):
                    pass
            if not self._closing:
                await asyncio.sleep(RECONNECT_S)

    def _set_connected(self, up: bool) -> None:
        if up and not self.connected:
            log.info("replica sync: subscribed to %r", self.config.channel)
        self.connected = up
        self.metrics.connected.set(1 if up else 0)

    async def _ticker(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.config.heartbeat_s)
            ids = list(self._local.values()) if len(self._local) <= MAX_HEARTBEAT_IDS else None
            self._enqueue(["h", ids])
            self.expire()

    # -- the others' events -----------------------------------------------------------------
    def apply(self, payload: bytes) -> int:
        """Apply one batch from the channel (this replica's own are skipped). A batch not of the
        wire format is rejected whole, a malformed event alone (both counted and logged, see the
        module doc); events after a goodbye are ignored; nothing raises. Returns the events
        applied."""
        try:
            message = msgpack.unpackb(payload, raw=False)
        except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, StackError, ...)
            self._bad_message.inc()
            self._reject("ignored a malformed message", exc)
            return 0
        if not (
            isinstance(message, list)
            and len(message) == 3
            and isinstance(message[0], str)
            and 0 < len(message[0]) <= MAX_ORIGIN_CHARS
            and isinstance(message[2], list)
        ):
            self._bad_message.inc()
            self._reject("ignored a malformed message", ValueError("not [origin, sent_at, [event, ...]]"))
            return 0
        origin, sent_at, events = message
        if origin == self.id:
            return 0  # (normally skipped before unpacking: see _own_head)
        parsed: list[tuple[Any, ...]] = []
        for ev in events:
            try:
                parsed.append(self._parse_event(ev))
            except ValueError as exc:
                self._bad_event.inc()
                self._reject(f"ignored a malformed event from {origin}", exc)
                continue
            if parsed[-1][0] == "b":
                break  # the peer is gone with its goodbye: nothing after it may be held for it
        if not parsed:
            return 0  # no peer entry for a replica that said nothing valid
        parsed = self._own_work(parsed)
        now = self._clock()
        peer = self._peers.get(origin)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self._bad_message.inc()
                self._reject(f"ignored replica {origin}", ValueError(f"already {MAX_PEERS} other replicas (MAX_PEERS)"))
                return 0
            peer = self._peers[origin] = _Peer(now)
        peer.last_seen = now
        done = 0
        for ev in parsed:
            try:
                done += self._apply_event(origin, peer, ev)
            except Exception as exc:  # one event's failure must not stop the batch or the subscriber
                self._bad_event.inc()
                self._reject(f"could not apply an event from {origin}", exc, exc_info=True)
        if done:
            self._applied.inc(done)
            if isinstance(sent_at, (int, float)) and math.isfinite(sent_at):
                self.metrics.delay.observe(max(0.0, time.time() - sent_at))
        return done

    def _own_work(self, parsed: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """A batch's parsed events with each pick's prefill work counted at this replica's
        `attention_ratio` from the "w" counts of its id in the batch (the sender's work kept
        for a pick without them), the "w" events themselves taken out."""
        counts: dict[int, PrefillCounts] = {ev[1]: ev[2] for ev in parsed if ev[0] == "w"}
        if not counts:
            return parsed
        out = []
        for ev in parsed:
            if ev[0] == "w":
                continue
            if ev[0] == "p" and ev[1] in counts:
                ev = (*ev[:4], counts[ev[1]].work(self.attention_ratio), *ev[5:])
            out.append(ev)
        return out

    def _reject(self, what: str, exc: BaseException, *, exc_info: bool = False) -> None:
        self._reject_log.warning(
            "replica sync: %s (%s: %s); further rejections for %.0f s are only counted (llm_extproc_replica_sync_rejected_total)",
            what,
            type(exc).__name__,
            exc,
            LOG_EVERY_S,
            exc_info=exc_info,
        )

    def _parse_event(self, ev: object) -> tuple[Any, ...]:
        """One event of the wire format (module doc) checked and normalised: `("p", rid, address,
        blocks, prompt_tokens, context_tokens, settle_after_s)`, `("w", rid, PrefillCounts)`,
        `("f"|"r", rid)`, `("x", address,
        hashes, session)` (hashes cut to `max_hashes`), `("o", address, factor, duration_s, reason,
        source)`, `("h", rids or None)` or `("b",)`.

        Raises:
            ValueError: not one of those shapes, or a value of the wrong type or out of range.
        """
        if not isinstance(ev, list) or not ev:
            raise ValueError(f"an event is a non-empty array, got {type(ev).__name__}")
        kind, n = ev[0], len(ev)
        if kind == "p" and n == 7:
            _, rid, address, blocks, prompt_tokens, context_tokens, settle_after_s = ev
            return (
                "p",
                _rid(rid),
                _address(address),
                _count(blocks, "blocks"),
                _count(prompt_tokens, "prompt_tokens", MAX_PREFILL_WORK),
                _count(context_tokens, "context_tokens"),
                _settle_s(settle_after_s),
            )
        if kind == "w" and n == 5:
            return ("w", _rid(ev[1]), _prefill_counts(ev[2], ev[3], ev[4]))
        if kind in ("f", "r") and n == 2:
            return (kind, _rid(ev[1]))
        if kind == "x" and n == 4:
            _, address, hashes, session = ev
            if not isinstance(hashes, list):
                raise ValueError("block hashes are an array")
            hashes = hashes[: self.config.max_hashes]
            if not all(type(h) is int and 0 <= h < _U64 for h in hashes):
                raise ValueError("a block hash is not an unsigned 64-bit int")
            if session is not None and not (isinstance(session, bytes) and len(session) <= MAX_SESSION_BYTES):
                raise ValueError(f"a session key is bytes of at most {MAX_SESSION_BYTES}")
            return ("x", _address(address), hashes, session)
        if kind == "o" and n == 6:
            _, address, factor, duration_s, reason, source = ev
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor <= 1:
                raise ValueError(f"an override's factor is a number in [0, 1], got {_shown(factor)}")
            if isinstance(duration_s, bool) or not isinstance(duration_s, (int, float)) or not 0 < duration_s <= MAX_DURATION_S:
                raise ValueError(f"an override's duration_s is a number in (0, {MAX_DURATION_S:g}], got {_shown(duration_s)}")
            if not isinstance(reason, str) or source not in SOURCES:
                raise ValueError(f"an override's reason is a str and its source one of {sorted(SOURCES)}")
            return ("o", _address(address), float(factor), float(duration_s), reason[:MAX_REASON_CHARS], source)
        if kind == "h" and n == 2:
            rids = ev[1]
            if rids is None:
                return ("h", None)
            if not isinstance(rids, list):
                raise ValueError("a heartbeat lists reservation ids in an array")
            return ("h", {_rid(rid) for rid in rids})
        if kind == "b":
            return ("b",)
        raise ValueError(f"unknown event {str(kind)[:20]!r} of {n} items")

    def _apply_event(self, origin: str, peer: _Peer, ev: tuple[Any, ...]) -> int:
        """Apply one event `_parse_event` returned; returns 1 when it changed something."""
        kind = ev[0]
        if kind == "p":
            _, rid, address, blocks, prompt_tokens, context_tokens, settle_after_s = ev
            ep = self._store.get(address)
            if ep is None or self.remote_inflight >= self.config.max_remote or rid in peer.open:
                return 0
            r = self._store.reserve(
                ep, blocks, prompt_tokens=prompt_tokens, settle_after_s=settle_after_s, context_tokens=context_tokens, notify=False
            )
            peer.open[rid] = r
            return 1
        if kind == "f":
            r = peer.open.get(ev[1])
            if r is None:
                return 0
            r.mark_first_token(learn=False)  # the owner saw the time to first token, not this replica
            return 1
        if kind == "r":
            r = peer.open.pop(ev[1], None)
            if r is None:
                return 0
            r.release()
            return 1
        if kind == "x":
            _, address, hashes, session = ev
            if self._tracker is None or self._store.get(address) is None:
                return 0
            self._tracker.apply_remote_pick(address, hashes, session)
            return 1
        if kind == "o":
            _, address, factor, duration_s, reason, source = ev
            ep = self._store.get(address)
            if ep is None:
                return 0
            set_override(ep, factor, duration_s, reason=reason, source=source)
            log.warning(
                "weight override from replica %s on %s (factor %s, %ss, source %s, reason %r)", origin, address, factor, duration_s, source, reason
            )
            return 1
        if kind == "h":
            alive = ev[1]
            if alive is not None:
                gone = [rid for rid in peer.open if rid not in alive]
                for rid in gone:
                    peer.open.pop(rid).release()
                if gone:
                    self._reconciled.inc(len(gone))
            return 0
        # "b" (the only other kind `_parse_event` returns)
        self._release_all(peer)
        del self._peers[origin]
        return 1

    def _release_all(self, peer: _Peer) -> int:
        n = len(peer.open)
        for r in peer.open.values():
            r.release()
        peer.open.clear()
        return n

    def expire(self) -> int:
        """Release everything held by replicas not heard from for `owner_timeout_s`; returns
        how many reservations went."""
        limit = self._clock() - self.config.owner_timeout_s
        gone = 0
        for origin in [o for o, p in self._peers.items() if p.last_seen < limit]:
            n = self._release_all(self._peers.pop(origin))
            if n:
                log.info("replica sync: replica %s not heard from for %.1f s; released its %d reservations", origin, self.config.owner_timeout_s, n)
            gone += n
        if gone:
            self._owner_gone.inc(gone)
        return gone

    @property
    def remote_inflight(self) -> int:
        """Other replicas' requests counted here (count): the peers' open reservations."""
        return sum(len(peer.open) for peer in self._peers.values())

    def drop_endpoint(self, address: str) -> int:
        """The endpoint left the fleet: forget the other replicas' reservations on it (released,
        so its counts go too). Returns how many went."""
        gone = 0
        for peer in self._peers.values():
            for rid in [rid for rid, r in peer.open.items() if r.endpoint.address == address]:
                peer.open.pop(rid).release()
                gone += 1
        return gone

    # -- observability ----------------------------------------------------------------------
    def summary(self) -> dict[str, object]:
        """For `/api/v1/endpoints`: this replica's id, whether it is subscribed, its peers."""
        now = self._clock()
        return {
            "replica_id": self.id,
            "connected": self.connected,
            "local_inflight": len(self._local),
            "remote_inflight": self.remote_inflight,
            "peers": {o: {"inflight": len(p.open), "last_seen_s_ago": round(now - p.last_seen, 3)} for o, p in self._peers.items()},
        }


def _rid(value: object) -> int:
    """A reservation id from the channel (an int; msgpack keeps ints within 64 bits)."""
    if type(value) is not int:
        raise ValueError(f"a reservation id is an int, got {type(value).__name__}")
    return value


def _address(value: object) -> str:
    """An endpoint address from the channel (a str; looked up, never stored unless known)."""
    if not isinstance(value, str):
        raise ValueError(f"an endpoint address is a str, got {type(value).__name__}")
    return value


def _count(value: object, name: str, limit: int = MAX_COUNT) -> int:
    """A block or token count from the channel: finite, 0..`limit` (an int; a float is truncated)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value <= limit):
        raise ValueError(f"{name} must be a number in 0..{limit}, got {_shown(value)}")
    return int(value)


def _prefill_counts(prompt_tokens: object, uncached: object, lengths: object) -> PrefillCounts:
    """A remote pick's prefill counts from the channel: token counts in 0..`MAX_COUNT`, the
    uncached part at most the prompt, at most `MAX_PROMPT_LENGTHS` prompt lengths summing to at
    most `MAX_COUNT` (so the work at any accepted ratio stays below `MAX_PREFILL_WORK`)."""
    total, fresh = _count(prompt_tokens, "prompt_tokens"), _count(uncached, "uncached_tokens")
    if fresh > total:
        raise ValueError(f"uncached_tokens ({fresh}) is more than prompt_tokens ({total})")
    if not isinstance(lengths, list) or len(lengths) > MAX_PROMPT_LENGTHS:
        raise ValueError(f"prompt lengths are an array of at most {MAX_PROMPT_LENGTHS}")
    each = tuple(_count(n, "a prompt length") for n in lengths)
    if sum(each) > MAX_COUNT:
        raise ValueError(f"prompt lengths sum to more than {MAX_COUNT}")
    return PrefillCounts(total, fresh, each)


def _settle_s(value: object) -> float:
    """A pick's `settle_after_s` from the channel: finite, 0..`MAX_SETTLE_S` seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value <= MAX_SETTLE_S):
        raise ValueError(f"settle_after_s must be a number in 0..{MAX_SETTLE_S:g}, got {_shown(value)}")
    return float(value)


def _shown(value: object) -> str:
    """A received value for a log line: a number as is, anything else by its type only."""
    return repr(value) if isinstance(value, (int, float)) else type(value).__name__
