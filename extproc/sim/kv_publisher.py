"""The simulator's KV-cache event publisher, on vLLM's wire (see `extproc.prefix.kv_events`).

A ZMQ PUB socket bound at `endpoint` sends ``[topic, seq (8 B big-endian), payload]`` per engine
step that changed the prefix cache; the last `buffer_steps` payloads stay in memory for the
optional ROUTER replay socket, which answers ``[b"", start_seq]`` with every buffered
``[b"", seq, payload]`` at or after `start_seq`, then ``[b"", -1, b""]`` — what vLLM's
`ZmqEventPublisher` does, without its thread (the simulator's engine runs on the event loop).

`restart()` is a new engine process: the sequence starts again at 0 and the replay buffer is
empty, so a subscriber sees the number go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from extproc.aio import cancel_and_wait
from extproc.prefix.kv_events import KVEvent, KVEventBatch, decode_seq, encode_batch, encode_seq

__all__ = ["KVEventPublisher"]

log = logging.getLogger(__name__)


class KVEventPublisher:
    """Publishes one `KVEventBatch` per engine step.

    Args:
        endpoint: where the PUB socket binds, e.g. `tcp://127.0.0.1:5557` or `tcp://*:5557`
            (`tcp://127.0.0.1:*`: any free port; `endpoint` holds the bound one after `start`).
        replay_endpoint: where the ROUTER replay socket binds (same forms), or None for none.
        topic: the first frame of every message (vLLM's `topic`, default empty).
        buffer_steps: batches kept for replay (vLLM's default 10,000).
        hwm: the PUB socket's high-water mark (messages; beyond it ZMQ drops, as in vLLM).

    Raises:
        ValueError: `buffer_steps` or `hwm` not positive.
    """

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000
    ) -> None:
        if buffer_steps <= 0 or hwm <= 0:
            raise ValueError(f"buffer_steps and hwm must be positive, got {buffer_steps}, {hwm}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.published = 0
        """Batches sent (count, cumulative over restarts)."""

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets."""
        return self._seq

    def start(self) -> None:
        """Bind the sockets (call on the event loop).

        Raises:
            zmq.ZMQError: an endpoint cannot be bound.
        """
        self._ctx = zmq.asyncio.Context()
        pub = zmq.Socket(self._ctx, zmq.PUB)  # a plain socket: PUB sends never wait
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        # `zmq.IPV6` only for an IPv6 address: without it that bind fails, and with it an IPv4
        # bind reports itself as `tcp://[::ffff:a.b.c.d]:port`, which no subscriber was told.
        if "[" in self.endpoint:
            pub.setsockopt(zmq.IPV6, 1)
        self._pub = pub
        try:
            pub.bind(self.endpoint)
            self.endpoint = _bound(pub)
            if self.replay_endpoint is not None:
                router = self._router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                if "[" in self.replay_endpoint:
                    router.setsockopt(zmq.IPV6, 1)
                router.bind(self.replay_endpoint)
                self.replay_endpoint = _bound(router)
                self._task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay")
        except zmq.ZMQError:
            self.close_sockets()
            raise

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> int | None:
        """Send one batch of `events` (nothing for none). Returns its sequence number."""
        if not events or self._pub is None:
            return None
        seq = self._seq
        self._seq += 1
        payload = encode_batch(KVEventBatch(time.time() if ts is None else ts, tuple(events), 0))
        with contextlib.suppress(zmq.Again):  # beyond the HWM a PUB socket drops, as in vLLM
            self._pub.send_multipart([self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1
        return seq

    def restart(self) -> None:
        """A new engine process: sequence numbers start at 0 again, the replay buffer is empty."""
        self._seq = 0
        self._buffer.clear()

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("kv replay: ignoring a request of %d frames", len(frames))
                continue
            ident, _, start_frame = frames
            try:
                start = decode_seq(start_frame)
            except ValueError:
                log.warning("kv replay: ignoring a malformed start sequence")
                continue
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart([ident, b"", encode_seq(seq), payload])
            await router.send_multipart([ident, b"", encode_seq(-1), b""])

    def close_sockets(self) -> None:
        """Close the sockets and the context (no await needed). Idempotent."""
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def aclose(self) -> None:
        """Stop the replay task and close everything. Idempotent."""
        await cancel_and_wait([self._task])
        self._task = None
        self.close_sockets()


def _bound(sock: zmq.Socket) -> str:
    """The endpoint a socket is bound to (a wildcard port resolved)."""
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)
