"""The endpoint datastore: what the scheduler knows about each inference endpoint.

State per endpoint (mutated on the event loop thread only):

* health, from active probes (`health.py`);
* engine metrics, from scrapes (`scraper.py`) — `engine`;
* node-agent reports (`agent_client.py`) — `node`; response-path statistics — `stream_stats`;
* our own accounting of requests we routed there and that have not ended: how many, how many
  are still before their first token (prefill) or after it (decode), and the KV blocks we
  reserved for them that the engine's own metrics do not show yet.

A `Reservation` carries one request's share of that accounting. It *settles* (its blocks stop
counting) once a scrape taken after the request's first token arrives — from then on the
engine's `kv_cache_usage_perc` includes the request, and counting it again would double it —
or, when no first token is ever observed (non-streaming responses), once a scrape taken after
`settle_after_s` arrives. `release()` undoes everything still counted and is idempotent, so
every way a request can end frees exactly what it held.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from extproc.types import EndpointAddress

if TYPE_CHECKING:  # annotations only: importing the config here closes an import cycle
    # (config.schema → scheduling registry → plugins → datastore.endpoints)
    from extproc.config.schema import EndpointConfig

__all__ = ["Endpoint", "Datastore", "Reservation", "PREFILL_WEIGHT", "DECODE_WEIGHT", "PREFILL_EWMA_ALPHA"]

PREFILL_WEIGHT = 3
"""A request before its first token counts 3× in the FLOPs-weighted load (design notes)."""
DECODE_WEIGHT = 1
"""A request after its first token counts 1×."""
PREFILL_EWMA_ALPHA = 0.2
"""Weight of the newest sample in `Endpoint.prefill_s_per_token` (an EWMA over ~5 first tokens)."""


@dataclass(slots=True, eq=False)
class Endpoint:
    """One endpoint and its live state.

    Attributes:
        address: `ip:port`.
        models: canonical model names served.
        labels: configured labels.
        healthy: result of the latest probes (True until probed otherwise when probing is off).
        inflight: requests routed here and not yet ended (count).
        prefill_inflight / decode_inflight: of those, before / after their first token (count).
        prefill_tokens: prompt tokens of the requests in prefill (tokens).
        prefill_s_per_token: learned time to first token per token of prefill backlog
            (seconds per token, EWMA over observed first tokens; queueing, chunked-prefill
            interference and the GPU's speed all show in it), None until observed.
        prefill_samples: first tokens it learned from (count).
        prefill_sampled_at: `time.monotonic()` of its latest sample (seconds), None before.
        reserved_blocks: KV blocks reserved by unsettled reservations (blocks).
        consecutive_failures / consecutive_successes: probe streaks.
        consecutive_5xx: generation answers in a row with a 5xx status (count).
        ejected_until: `time.monotonic()` until which outlier detection keeps it out (seconds).
        probed: whether any probe has completed.
        engine: latest scraped engine metrics (`extproc.datastore.scraper.EngineMetrics`), or None.
        scrape_errors: consecutive failed scrapes (count).
        routed_total: requests ever routed here (count).
        routed_at_scrape: `routed_total` when the latest successful scrape started: requests
            routed after it are not in the engine's numbers yet.
        node: latest node-agent report (`extproc.datastore.agent_client.NodeReport`), or None.
        stream_stats: response-path statistics (`extproc.telemetry.stats.EndpointStreamStats`), or None.
    """

    address: EndpointAddress
    models: frozenset[str]
    labels: dict[str, str] = field(default_factory=dict)
    healthy: bool = True
    inflight: int = 0
    prefill_inflight: int = 0
    decode_inflight: int = 0
    prefill_tokens: int = 0
    reserved_blocks: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    consecutive_5xx: int = 0
    ejected_until: float = 0.0
    last_probe_error: str | None = None
    probed: bool = False
    prefill_s_per_token: float | None = None
    prefill_samples: int = 0
    prefill_sampled_at: float | None = None
    engine: Any = None
    scrape_errors: int = 0
    routed_total: int = 0
    routed_at_scrape: int = 0
    node: Any = None
    stream_stats: Any = None
    unsettled: set[Reservation] = field(default_factory=set, repr=False)

    @property
    def unseen(self) -> int:
        """Requests routed here since the latest successful scrape started, still in flight
        (count): the engine's queue numbers cannot include them yet."""
        return min(self.inflight, self.routed_total - self.routed_at_scrape)

    @property
    def flops_load(self) -> int:
        """FLOPs-weighted in-flight load: 3 per request in prefill, 1 per request in decode."""
        return PREFILL_WEIGHT * self.prefill_inflight + DECODE_WEIGHT * self.decode_inflight

    def ejected(self, now: float) -> bool:
        """True while outlier detection keeps the endpoint out (`now`: monotonic seconds)."""
        return self.ejected_until > now

    def record_status(self, status: int, now: float, *, consecutive_5xx: int, ejection_s: float) -> bool:
        """Count one generation answer's HTTP status; True when this answer ejects the endpoint
        (the `consecutive_5xx`-th 5xx in a row, or a 5xx on the first try after an ejection).
        A 504 (Envoy's own timeout of a slow answer: not the engine failing) and a 429 (the
        engine shedding) leave the streak as it is; other statuses end it."""
        if status in (429, 504):
            return False
        if status < 500:
            self.consecutive_5xx = 0
            return False
        self.consecutive_5xx += 1
        if self.consecutive_5xx >= consecutive_5xx and not self.ejected(now):
            self.ejected_until = now + ejection_s
            self.consecutive_5xx = consecutive_5xx - 1  # after the ejection, one more 5xx ejects again
            return True
        return False

    def metrics_age(self, now: float) -> float | None:
        """Seconds since the last successful scrape, or None if never scraped."""
        if self.engine is None:
            return None
        return now - self.engine.scraped_at


class Reservation:
    """A request's claim on an endpoint: one in-flight slot, its phase, and its KV blocks.

    Args:
        store: the owning datastore.
        endpoint: where the request was routed.
        blocks: KV blocks reserved (blocks).
        prompt_tokens: the request's prompt tokens (tokens), for token-weighted load.
        settle_after_s: without an observed first token, settle on the first scrape taken this
            many seconds after the reservation (seconds).
    """

    __slots__ = ("endpoint", "blocks", "prompt_tokens", "backlog_tokens", "created_at", "first_token_at", "settle_at", "settled", "in_prefill", "_store", "_released")

    def __init__(self, store: Datastore, endpoint: Endpoint, blocks: int, prompt_tokens: int, settle_after_s: float) -> None:
        self.endpoint = endpoint
        self.blocks = blocks
        self.prompt_tokens = prompt_tokens
        self.backlog_tokens = endpoint.prefill_tokens + prompt_tokens
        """Prefill tokens ahead of and including this request when it was routed (tokens)."""
        self.created_at = time.monotonic()
        self.first_token_at: float | None = None
        self.settle_at = self.created_at + settle_after_s
        self.settled = blocks == 0
        self.in_prefill = True
        self._store = store
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def mark_first_token(self, now: float | None = None, *, learn: bool = True) -> None:
        """The first output token reached us: the request moves from prefill to decode.

        Args:
            now: when (`time.monotonic()` seconds; default now).
            learn: feed the time since routing into the endpoint's learned prefill speed. False
                when the signal is not the first token itself (a non-streamed response's
                headers come with its last token).
        """
        if self._released or not self.in_prefill:
            return
        self.in_prefill = False
        self.first_token_at = time.monotonic() if now is None else now
        ep = self.endpoint
        elapsed = self.first_token_at - self.created_at
        if learn and self.backlog_tokens > 0 and elapsed > 0:
            sample = elapsed / self.backlog_tokens
            prev = ep.prefill_s_per_token
            ep.prefill_s_per_token = sample if prev is None else prev + PREFILL_EWMA_ALPHA * (sample - prev)
            ep.prefill_sampled_at = self.first_token_at
            ep.prefill_samples += 1
        ep.prefill_inflight -= 1
        ep.prefill_tokens -= self.prompt_tokens
        ep.decode_inflight += 1

    def settle(self) -> None:
        """Stop counting this request's blocks (the engine's metrics now include it)."""
        if self.settled or self._released:
            return
        self.settled = True
        ep = self.endpoint
        ep.reserved_blocks -= self.blocks
        ep.unsettled.discard(self)

    def release(self) -> None:
        """Return everything still counted; safe to call more than once."""
        if self._released:
            return
        self.settle()
        self._released = True
        ep = self.endpoint
        ep.inflight -= 1
        if self.in_prefill:
            ep.prefill_inflight -= 1
            ep.prefill_tokens -= self.prompt_tokens
        else:
            ep.decode_inflight -= 1
        self._store._open.discard(self)


class Datastore:
    """Endpoints by address and by model; in-flight and KV-reservation accounting.

    Args:
        endpoints: endpoint configurations.
    """

    def __init__(self, endpoints: Iterable[EndpointConfig]) -> None:
        self._by_addr: dict[str, Endpoint] = {}
        self._by_model: dict[str, list[Endpoint]] = {}
        for cfg in endpoints:
            ep = Endpoint(EndpointAddress(cfg.address), frozenset(cfg.models), dict(cfg.labels))
            self._by_addr[ep.address] = ep
            for m in cfg.models:
                self._by_model.setdefault(m, []).append(ep)
        self._open: set[Reservation] = set()

    def all(self) -> list[Endpoint]:
        """Every endpoint, in configuration order."""
        return list(self._by_addr.values())

    def get(self, address: str) -> Endpoint | None:
        return self._by_addr.get(address)

    def for_model(self, model: str) -> list[Endpoint]:
        """Endpoints serving a canonical model name (healthy or not)."""
        return self._by_model.get(model, [])

    def reserve(self, endpoint: Endpoint, blocks: int = 0, *, prompt_tokens: int = 0, settle_after_s: float = 2.0) -> Reservation:
        """Count a request in flight on `endpoint` (in prefill) holding `blocks` KV blocks;
        release the returned reservation when the request ends, however it ends."""
        r = Reservation(self, endpoint, blocks, prompt_tokens, settle_after_s)
        endpoint.inflight += 1
        endpoint.routed_total += 1
        endpoint.prefill_inflight += 1
        endpoint.prefill_tokens += prompt_tokens
        if blocks:
            endpoint.reserved_blocks += blocks
            endpoint.unsettled.add(r)
        self._open.add(r)
        return r

    def settle_scraped(self, endpoint: Endpoint, scraped_at: float) -> int:
        """After a scrape of `endpoint` taken at `scraped_at` (monotonic seconds), settle every
        reservation the engine's metrics now include. Returns how many settled."""
        done = [
            r
            for r in endpoint.unsettled
            if (r.first_token_at is not None and r.first_token_at <= scraped_at) or r.settle_at <= scraped_at
        ]
        for r in done:
            r.settle()
        return len(done)

    @property
    def open_reservations(self) -> int:
        """Reservations not yet released (count): 0 when no request is in flight."""
        return len(self._open)
