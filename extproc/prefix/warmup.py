"""Warm-up of hot prefixes onto cold endpoints (design notes 3.3), opt-in.

When a request whose shared prefix is hot (`extproc.prefix.hot`) is routed and fewer than
`replicas` endpoints hold that prefix, the warmer sends one cold endpoint a completions request
carrying the prefix's token ids with `max_tokens: 1`: the engine prefills it once, off the
request path, and keeps the blocks in its prefix cache, so the next requests with that prefix
find two warm endpoints instead of queueing on one. Guards:

* at most `max_per_s` warm-ups per second (a token bucket; burst 1), one in flight per
  (endpoint, prefix);
* never to an unhealthy endpoint, nor to one whose KV usage (with our unsettled reservations) is
  at or above `kv_watermark`;
* the prefix's blocks count for the endpoint only once the warm-up answered 200.

Metrics: warm-ups sent (by outcome) and requests that later hit a warmed prefix
(`llm_extproc_prefix_warmups_total`, `llm_extproc_prefix_warmup_hits_total`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from extproc.datastore.endpoints import effective_kv_usage

if TYPE_CHECKING:
    from extproc.config.schema import WarmupConfig
    from extproc.datastore.endpoints import Endpoint, Reservation
    from extproc.prefix.index import PrefixIndex

__all__ = ["PrefixWarmer"]

log = logging.getLogger(__name__)


class PrefixWarmer:
    """Sends warm-up requests (see the module doc).

    Args:
        config: `scheduling.prefix.warmup`.
        index: the prefix index (a successful warm-up adds the prefix's blocks).
        registry: where the metrics go (None: a private registry).
        clock: monotonic seconds.
    """

    def __init__(
        self, config: WarmupConfig, index: PrefixIndex, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.index = index
        self._clock = clock
        self._tokens = 1.0
        self._refilled_at = clock()
        self._inflight: set[tuple[str, int]] = set()
        self._warmed: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self.reserve: Callable[[Endpoint, int], Reservation] | None = None
        """Set by the server: counts a warm-up in flight on its endpoint with its prefill work
        (tokens) until it is answered, so routing sees it like any request (None: not counted)."""
        reg = registry if registry is not None else CollectorRegistry()
        self.sent = Counter(
            "llm_extproc_prefix_warmups_total", "Warm-up requests sent to cold endpoints, by outcome (ok, error).", ["outcome"], registry=reg
        )
        self.hits = Counter(
            "llm_extproc_prefix_warmup_hits_total", "Requests routed to an endpoint holding a prefix that a warm-up put there.", registry=reg
        )

    @property
    def in_flight(self) -> int:
        """Warm-ups sent and not answered yet (count)."""
        return len(self._inflight)

    def _take_token(self) -> bool:
        now = self._clock()
        self._tokens = min(1.0, self._tokens + (now - self._refilled_at) * self.config.max_per_s)
        self._refilled_at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def note_routed(self, address: str, prefix_hash: int, matched: bool) -> None:
        """A request with shared prefix `prefix_hash` went to `address`; count it as a warm-up
        hit when a warm-up put that prefix there and the endpoint held it."""
        if matched and (address, prefix_hash) in self._warmed:
            self.hits.inc()

    def drop_endpoint(self, address: str) -> int:
        """`address` left the fleet: forget the prefixes warmed there. Returns how many."""
        gone = [k for k in self._warmed if k[0] == address]
        for k in gone:
            del self._warmed[k]
        return len(gone)

    def consider(
        self,
        candidates: Sequence[Endpoint],
        holders: Sequence[str],
        prefix_hash: int,
        hashes: list[int],
        token_ids: Sequence[int],
        model: str,
    ) -> Endpoint | None:
        """Maybe warm a cold endpoint with a hot prefix. Returns the endpoint a warm-up was sent
        to, or None.

        Args:
            candidates: the request's candidate endpoints (same model).
            holders: addresses believed to hold the prefix.
            prefix_hash: the prefix's last block hash (its name).
            hashes: the prefix's block hashes, first block first.
            token_ids: the prefix's token ids (len(hashes) × block size tokens).
            model: the served model name to put in the warm-up body.
        """
        cfg = self.config
        if not cfg.enabled or len(holders) >= cfg.replicas or not token_ids:
            return None
        held = set(holders)
        cold = [
            ep
            for ep in candidates
            if ep.address not in held
            and ep.healthy
            and (ep.address, prefix_hash) not in self._inflight
            and (effective_kv_usage(ep) or 0.0) < cfg.kv_watermark
        ]
        if not cold or not self._take_token():
            return None
        target = min(cold, key=lambda ep: (ep.inflight, ep.prefill_tokens))
        key = (target.address, prefix_hash)
        self._inflight.add(key)
        reservation = self.reserve(target, len(token_ids)) if self.reserve is not None else None
        task = asyncio.get_running_loop().create_task(
            self._send(target.address, key, list(hashes), list(token_ids), model)
        )
        if reservation is not None:
            # Released when the task ends however it ends — answered, failed, or cancelled even
            # before it started (its body's `finally` would not run then).
            task.add_done_callback(lambda _: reservation.release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return target

    async def _send(self, address: str, key: tuple[str, int], hashes: list[int], token_ids: list[int], model: str) -> None:
        outcome = "error"
        try:
            if self._session is None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
            body = {"model": model, "prompt": token_ids, "max_tokens": 1, "stream": False}
            async with self._session.post(f"http://{address}/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    outcome = "ok"
                    self.index.add(address, hashes)
                    self._warmed[key] = None
                    while len(self._warmed) > 4096:
                        self._warmed.popitem(last=False)
                else:
                    log.debug("warm-up of %s answered %d", address, resp.status)
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("warm-up of %s failed: %s", address, exc)
        finally:
            self._inflight.discard(key)
            self.sent.labels(outcome).inc()

    async def aclose(self) -> None:
        """Cancel warm-ups in flight and close the HTTP session."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
