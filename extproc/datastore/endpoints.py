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

Endpoints come and go (`extproc.discovery`): `add_endpoint` adds or updates one,
`drain_endpoint` stops new picks and removes it once its last request ends, and
`remove_endpoint` is the one place an endpoint leaves — every index and metric series keyed
by its address is dropped by the `on_removed` hooks registered there.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from extproc.datastore.prefill_fit import PrefillCounts, PrefillFit, PrefillPrior, gpu_table, gpu_value
from extproc.types import EndpointAddress

if TYPE_CHECKING:  # annotations only: importing the config here closes an import cycle
    # (config.schema → scheduling registry → plugins → datastore.endpoints)
    from extproc.config.schema import EndpointConfig

__all__ = ["canonical_address", "canonical_host", "Endpoint", "Datastore", "Reservation", "ReservationListener", "PREFILL_WEIGHT", "DECODE_WEIGHT", "effective_kv_usage"]


def canonical_host(host: str) -> str:
    """`host` in `ipaddress`'s canonical text when it is an IP address ("2001:DB8:0::1" →
    "2001:db8::1"), else unchanged (a name)."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


def canonical_address(address: str) -> str:
    """`host:port` with an IP host in canonical text (`canonical_host`: "[2001:DB8:0::1]:8000" →
    "[2001:db8::1]:8000"); a name, or text that is not `host:port`, comes back unchanged."""
    host, sep, port = address.rpartition(":")
    if not sep:
        return address
    bracketed = host.startswith("[") and host.endswith("]")
    canon = canonical_host(host[1:-1] if bracketed else host)
    return f"[{canon}]:{port}" if ":" in canon else f"{canon}:{port}"


log = logging.getLogger(__name__)

PREFILL_WEIGHT = 3
"""A request before its first token counts 3× in the FLOPs-weighted load (design notes)."""
DECODE_WEIGHT = 1
"""A request after its first token counts 1×."""


@dataclass(slots=True, eq=False)
class Endpoint:
    """One endpoint and its live state.

    Attributes:
        address: `ip:port`.
        models: canonical model names served.
        labels: configured labels.
        gpu: the value of its GPU label (`scheduling.prefill_model.gpu_label`, "gpu" by
            default; "" without one), e.g. "NVIDIA-A100-SXM4-80GB": what the per-GPU tables
            (the fit's prior, the decode model) are matched against. Set by the `Datastore`.
        healthy: result of the latest probes (True until probed otherwise when probing is off).
        inflight: requests routed here and not yet ended (count).
        prefill_inflight / decode_inflight: of those, before / after their first token (count).
        prefill_tokens: uncached prompt tokens of the requests in prefill (tokens): the
            prefill work routed here and not yet past its first token, by our own count (a
            prompt's prefix that the prefix index believes cached there is not work). Part of
            it may be computed already: `prefill_ahead` is what is still ahead.
        in_prefill: our reservations here before their first token, oldest first (the
            engine's queue by our own count; `prefill_ahead`).
        prefill_left_at: `time.monotonic()` when the latest of them left prefill (seconds;
            -inf before any): the oldest one left has been computed since then at the latest.
        context_tokens: decode context of the requests in flight (tokens; full prompts plus half
            their expected outputs): what each decode step on the endpoint reads.
        prefill_fit: the learned fit TTFT ≈ t0 + s · prefill work ahead
            (`extproc.datastore.prefill_fit`; queueing, chunked-prefill interference and the
            GPU's speed all show in it).
        reserved_blocks: KV blocks reserved by unsettled reservations (blocks).
        consecutive_failures / consecutive_successes: probe streaks.
        consecutive_5xx: generation answers in a row with a 5xx status (count).
        ejected_until: `time.monotonic()` until which outlier detection keeps it out (seconds).
        ejected_at: `time.monotonic()` when the latest ejection began (seconds; -inf before any):
            answers to requests routed earlier no longer count (`extproc.datastore.outliers`).
        ejections: ejections so far, the multiplier of the next ejection's length (count).
        probed: whether any probe has completed.
        engine: latest scraped engine metrics (`extproc.datastore.scraper.EngineMetrics`), or None.
        scrape_errors: consecutive failed scrapes (count).
        routed_total: requests ever routed here (count).
        routed_at_scrape: `routed_total` when the latest successful scrape started: requests
            routed after it are not in the engine's numbers yet.
        node: latest node-agent report (`extproc.datastore.agent_client.NodeReport`), or None.
        stream_stats: response-path statistics (`extproc.telemetry.stats.EndpointStreamStats`), or None.
        override: an operator's weight override (`extproc.datastore.overrides.WeightOverride`), or None.
        draining: discovery dropped it (gone from its source, not ready, or terminating): no new
            picks; it is removed once `inflight` reaches 0 (`Datastore.drain_endpoint`).
        draining_since: `time.monotonic()` when draining began (seconds), or None.
        engine_check: per configured model it serves, the latest check of the engine's own
            token counts and `max_model_len` against the router's
            (`extproc.datastore.engine_check.EngineCheck`), or None before any.
        agent: `host:port` of its node agent (`EndpointConfig.agent`), or None.
        kv_events / kv_events_replay: its engine's KV-event publisher and replay socket
            (`EndpointConfig.kv_events`, `tcp://host:port`), or None.
        role: `prefill`, `decode` or `both` (`EndpointConfig.role`): which side of a
            disaggregated request it may take (`extproc.scheduling.pd`).
        lora_sent: the LoRA adapters this router sent here (`extproc.datastore.lora.SentAdapters`),
            or None before the first.
        listed_adapters: adapter name → base model of the LoRA entries of its `/v1/models`
            (entries with a `parent`), as the engine check last read them.
    """

    address: EndpointAddress
    models: frozenset[str]
    labels: dict[str, str] = field(default_factory=dict)
    gpu: str = ""
    role: str = "both"
    healthy: bool = True
    inflight: int = 0
    prefill_inflight: int = 0
    decode_inflight: int = 0
    prefill_tokens: int = 0
    in_prefill: dict[Reservation, None] = field(default_factory=dict, repr=False)
    prefill_left_at: float = float("-inf")
    context_tokens: int = 0
    reserved_blocks: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    consecutive_5xx: int = 0
    ejected_until: float = 0.0
    ejected_at: float = float("-inf")
    ejections: int = 0
    last_probe_error: str | None = None
    probed: bool = False
    prefill_fit: PrefillFit = field(default_factory=PrefillFit)
    engine: Any = None
    scrape_errors: int = 0
    routed_total: int = 0
    routed_at_scrape: int = 0
    node: Any = None
    stream_stats: Any = None
    override: Any = None
    draining: bool = False
    draining_since: float | None = None
    engine_check: dict[str, Any] | None = None
    agent: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    lora_sent: Any = None
    listed_adapters: dict[str, str] = field(default_factory=dict)
    unsettled: set[Reservation] = field(default_factory=set, repr=False)

    @property
    def prefill_s_per_token(self) -> float | None:
        """The fitted prefill speed (seconds per token), None until a first token was observed."""
        return self.prefill_fit.s_per_token if self.prefill_fit.samples else None

    @property
    def prefill_sampled_at(self) -> float | None:
        """`time.monotonic()` of the latest first-token sample (seconds), None before any."""
        return self.prefill_fit.sampled_at

    def prefill_ahead(self, now: float) -> float:
        """Prefill work still ahead on this endpoint (tokens): `prefill_tokens` less what the
        engine has probably computed of the oldest of them by `now` (`time.monotonic()` seconds).

        The oldest request in prefill has nothing of ours ahead of it: since it was routed, or
        since the one before it left prefill if that was later, the engine has worked on it at
        about one token per `s` seconds (`prefill_fit.s_per_token`, the learned seconds of TTFT
        per token of work ahead), up to its whole prompt. Only that request is credited: what
        the engine does with the others at once (several prefills share a step) is left in the
        count, which is what the fit was learned on. Counting a prompt in full until its first
        token told a request routed 0.5 s into a 7k-token prefill on an A100 that all 7k were
        still ahead: predicted 685 ms, observed 259 ms; and the fit, fed that backlog, learned
        the A100 twice as fast as it is and then sent cold 7k prefills to it (shared-system
        benchmark, 3 of 6 duplicate prefills; decision 0255)."""
        head = next(iter(self.in_prefill), None)
        if head is None:
            return float(self.prefill_tokens)
        # a leave stamped after `now` is a caller's mistake (another clock than the monotonic
        # one): it would credit nothing until `now` caught up with it, so it counts as unknown
        left_at = self.prefill_left_at if self.prefill_left_at <= now else float("-inf")
        started = max(head.created_at, left_at)
        done = min(float(head.prompt_tokens), max(0.0, now - started) / self.prefill_fit.s_per_token)
        return max(0.0, self.prefill_tokens - done)

    def leave_prefill(self, reservation: Reservation, now: float) -> None:
        """`reservation` left prefill at `now` (monotonic seconds: its first token, or its end).
        Only the oldest one leaving restarts the credit `prefill_ahead` gives the next: a later
        request that ends or gets its first token first (a client abort, a short prompt beside a
        long one, a passthrough) says nothing about how far the oldest has got. The latest
        leave replaces an earlier one even when that was stamped later: a `now` far in the future
        (seconds since the epoch instead of monotonic) stuck under `max` and stopped the credit
        for good."""
        if next(iter(self.in_prefill), None) is reservation:
            self.prefill_left_at = now
        self.in_prefill.pop(reservation, None)

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

    def metrics_age(self, now: float) -> float | None:
        """Seconds since the last successful scrape, or None if never scraped."""
        if self.engine is None:
            return None
        return now - self.engine.scraped_at


def effective_kv_usage(ep: Endpoint) -> float | None:
    """Fraction of the endpoint's KV pool in use, counting our reservations the engine has not
    yet reported (0..1, above 1 when over-reserved): `kv_cache_usage_perc` + reserved blocks /
    `num_gpu_blocks` (`cache_config_info`), the usage alone when the block count is unknown, or
    None when never scraped. Read by the KV-utilization and compute-aware scorers, priority
    shedding and prefix warm-up alike."""
    engine = ep.engine
    if engine is None:
        return None
    if engine.num_gpu_blocks:
        return engine.kv_usage + ep.reserved_blocks / engine.num_gpu_blocks
    return engine.kv_usage


class Reservation:
    """A request's claim on an endpoint: one in-flight slot, its phase, and its KV blocks.

    Args:
        store: the owning datastore.
        endpoint: where the request was routed.
        blocks: KV blocks reserved (blocks).
        prompt_tokens: the request's prefill work on this endpoint (tokens): its prompt less
            the prefix believed cached there.
        settle_after_s: without an observed first token, settle on the first scrape taken this
            many seconds after the reservation (seconds).
        context_tokens: the request's whole context while it decodes (tokens): its full prompt,
            cached part included, plus half its expected output — what its decode steps make
            every other decode step on the endpoint read.
        now: when it was routed (`time.monotonic()` seconds; default now).
        prefill_counts: the token counts `prompt_tokens` was computed from, when known (shared
            with the other replicas, which count the work at their own attention ratio).
    """

    __slots__ = ("endpoint", "blocks", "prompt_tokens", "prefill_counts", "context_tokens", "backlog_tokens", "created_at", "first_token_at", "settle_at", "settled", "in_prefill", "learns", "prefill_side", "_store", "_released")

    def __init__(
        self,
        store: Datastore,
        endpoint: Endpoint,
        blocks: int,
        prompt_tokens: int,
        settle_after_s: float,
        context_tokens: int = 0,
        now: float | None = None,
        prefill_counts: PrefillCounts | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.blocks = blocks
        self.prompt_tokens = prompt_tokens
        self.prefill_counts = prefill_counts
        self.context_tokens = context_tokens
        self.created_at = time.monotonic() if now is None else now
        self.backlog_tokens = endpoint.prefill_ahead(self.created_at) + prompt_tokens
        """Prefill tokens ahead of and including this request when it was routed (tokens)."""
        self.first_token_at: float | None = None
        self.settle_at = self.created_at + settle_after_s
        self.settled = blocks == 0
        self.in_prefill = True
        self.learns = True
        """False: its first token teaches the endpoint's prefill fit nothing (a request moved
        here after its headers came back from another attempt, whose start here is unknown)."""
        self.prefill_side: Reservation | None = None
        """A disaggregated request's reservation on its prefill endpoint (`attach_prefill_side`)."""
        self._store = store
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def attach_prefill_side(self, prefill_side: Reservation) -> None:
        """Make `prefill_side` (the same request's reservation on its prefill endpoint, P/D
        disaggregation) end with this one's prefill: it is released when this reservation
        reaches its first token (the KV has moved to this endpoint) or is released, whichever
        comes first. This reservation's own time to first token then includes the remote
        prefill and the transfer, so it teaches this endpoint's prefill fit nothing."""
        self.prefill_side = prefill_side
        self.learns = False

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
        if self.prefill_side is not None:
            self.prefill_side.release(now)
        self.in_prefill = False
        self.first_token_at = time.monotonic() if now is None else now
        ep = self.endpoint
        elapsed = self.first_token_at - self.created_at
        ep.leave_prefill(self, self.first_token_at)
        if learn and self.learns and elapsed > 0:
            ep.prefill_fit.add(self.backlog_tokens, elapsed, self.first_token_at)
        ep.prefill_inflight -= 1
        ep.prefill_tokens -= self.prompt_tokens
        ep.decode_inflight += 1
        if self._store.listener is not None:
            self._store.listener.first_token(self)

    def settle(self) -> None:
        """Stop counting this request's blocks (the engine's metrics now include it)."""
        if self.settled or self._released:
            return
        self.settled = True
        ep = self.endpoint
        ep.reserved_blocks -= self.blocks
        ep.unsettled.discard(self)

    def release(self, now: float | None = None) -> None:
        """Return everything still counted; safe to call more than once.

        Args:
            now: when (`time.monotonic()` seconds; default now): a request released still in
                prefill (aborted, failed) restarts `prefill_ahead`'s credit at this time if it
                was the oldest there, on the same clock as `mark_first_token`'s.
        """
        if self._released:
            return
        if self.prefill_side is not None:
            self.prefill_side.release(now)
        self.settle()
        self._released = True
        ep = self.endpoint
        ep.inflight -= 1
        ep.context_tokens -= self.context_tokens
        if self.in_prefill:
            ep.prefill_inflight -= 1
            ep.leave_prefill(self, time.monotonic() if now is None else now)
            ep.prefill_tokens -= self.prompt_tokens
        else:
            ep.decode_inflight -= 1
        self._store._open.discard(self)
        if self._store.listener is not None:
            self._store.listener.released(self)
        if ep.draining and ep.inflight == 0:
            self._store._drained(ep)


class ReservationListener(Protocol):
    """Told synchronously, on the event loop, as a reservation is made, reaches its first
    token and is released (`extproc.replicas.sync` shares them with the other replicas). Must
    not raise nor block: it runs inside the decision."""

    def reserved(self, r: Reservation) -> None: ...

    def first_token(self, r: Reservation) -> None: ...

    def released(self, r: Reservation) -> None: ...


class Datastore:
    """Endpoints by address and by model; in-flight and KV-reservation accounting.

    Args:
        endpoints: endpoint configurations.
        prefill_prior: the prior of every endpoint's TTFT fit (default `PrefillPrior()`).
        prefill_s_per_token_by_gpu: prefill seconds per token by GPU name (any case; checked by `gpu_table`, matched as
            a whole word of the endpoint's `gpu_label` label, `Endpoint.gpu`): an endpoint whose GPU is listed
            gets that prior `s` (`PrefillPrior.known`). A mixed fleet otherwise started every
            endpoint at one speed: an idle A100 was predicted as fast as the H100 just observed
            and took cold 7k-token prefills at 640 ms that an H100 did in 230 (decision 0255).
        gpu_label: the endpoint label naming its GPU (`Endpoint.gpu`), for every per-GPU table.

    Raises:
        ValueError: `prefill_s_per_token_by_gpu` has a blank name, a name twice, or a speed
            that is not a finite number > 0 (a bool or a string is not a number; `gpu_table`).

    Attributes:
        on_added: called with each endpoint `add_endpoint` creates (start its probes, scrapes,
            metric series).
        on_changed: called with an existing endpoint whose `agent`, `kv_events` or
            `kv_events_replay` `add_endpoint` changed (a configuration reload): watch the new
            agent, subscribe to the new publisher.
        on_removed: called with each endpoint `remove_endpoint` takes out, after it left every
            table here: drop what other components keep under its address (prefix index,
            sessions, metric label children, background loops). The hook point for anything
            that keeps per-endpoint state (e.g. state shared between replicas).
    """

    def __init__(
        self,
        endpoints: Iterable[EndpointConfig],
        prefill_prior: PrefillPrior | None = None,
        prefill_s_per_token_by_gpu: dict[str, float] | None = None,
        gpu_label: str = "gpu",
    ) -> None:
        self._by_addr: dict[str, Endpoint] = {}
        self._by_model: dict[str, list[Endpoint]] = {}
        self._prior = prefill_prior
        self._s_by_gpu = gpu_table(prefill_s_per_token_by_gpu or {}, "prefill seconds per token")
        self._gpu_label = gpu_label
        self._open: set[Reservation] = set()
        self.listener: ReservationListener | None = None
        """Told of every reservation, first token and release (replica sync); None: nobody."""
        self.on_added: list[Callable[[Endpoint], None]] = []
        self.on_changed: list[Callable[[Endpoint], None]] = []
        self.on_removed: list[Callable[[Endpoint], None]] = []
        for cfg in endpoints:
            self.add_endpoint(cfg)

    def _prior_for(self, labels: dict[str, str]) -> PrefillPrior | None:
        """The TTFT fit's prior for an endpoint with these labels: the configured one, its
        prefill speed taken from `prefill_s_per_token_by_gpu` when the GPU label names a GPU
        there (marked `known`)."""
        s = gpu_value(labels.get(self._gpu_label, ""), self._s_by_gpu)
        if s is None:
            return self._prior
        return replace(self._prior or PrefillPrior(), s_per_token=s, known=True)

    def all(self) -> list[Endpoint]:
        """Every endpoint, draining ones included, in the order they were added."""
        return list(self._by_addr.values())

    def routable(self) -> list[Endpoint]:
        """Every endpoint that may take new requests (not draining)."""
        return [ep for ep in self._by_addr.values() if not ep.draining]

    def get(self, address: str) -> Endpoint | None:
        """The endpoint at `address` ("host:port"), or None. An IPv6 address written otherwise
        than the endpoint's (upper case, zeros not compressed: "[2001:DB8:0::1]:8000") finds it
        too: a gateway or a replica reports an address in its own text."""
        found = self._by_addr.get(address)
        if found is not None or "[" not in address:
            return found
        want = canonical_address(address)
        return next((ep for ep in self._by_addr.values() if canonical_address(ep.address) == want), None)

    def for_model(self, model: str) -> list[Endpoint]:
        """Endpoints serving a canonical model name (healthy or not; never draining ones)."""
        return self._by_model.get(model, [])

    # -- membership ------------------------------------------------------------------------
    def add_endpoint(self, cfg: EndpointConfig) -> Endpoint:
        """Add the endpoint `cfg` describes, or bring an existing one up to date: its models,
        labels, agent and KV-event sockets follow `cfg`, and a draining one takes new requests
        again (its learned state kept, except its prefill fit when its GPU label changed). Runs the `on_added` hooks for a new endpoint, the
        `on_changed` hooks for an existing one whose agent or KV-event sockets changed.

        Returns:
            The endpoint (new or existing).
        """
        ep = self._by_addr.get(cfg.address)
        models = frozenset(cfg.models)
        links = (cfg.agent, cfg.kv_events, cfg.kv_events_replay)
        if ep is not None:
            relinked = links != (ep.agent, ep.kv_events, ep.kv_events_replay)
            if ep.draining:
                log.info("endpoint %s back before its drain ended: it takes new requests again", ep.address)
                ep.draining, ep.draining_since = False, None
            elif ep.models == models and ep.labels == cfg.labels and ep.role == cfg.role and not relinked:
                return ep
            gpu = cfg.labels.get(self._gpu_label, "")
            if ep.gpu.casefold() != gpu.casefold():
                # Another GPU (or a mislabelled one fixed): what was learned was of the old one.
                # Case alone names the same GPU (the tables match any case): "H100" → "h100"
                # threw away what was learned.
                ep.prefill_fit = PrefillFit(self._prior_for(cfg.labels))
            self._unindex(ep)
            ep.models, ep.labels, ep.gpu, ep.role = models, dict(cfg.labels), gpu, cfg.role
            self._index(ep)
            if relinked:
                ep.agent, ep.kv_events, ep.kv_events_replay = links
                for hook in self.on_changed:
                    hook(ep)
            return ep
        ep = Endpoint(
            EndpointAddress(cfg.address), models, dict(cfg.labels), gpu=cfg.labels.get(self._gpu_label, ""), role=cfg.role,
            prefill_fit=PrefillFit(self._prior_for(cfg.labels)),
        )
        ep.agent, ep.kv_events, ep.kv_events_replay = links
        self._by_addr[ep.address] = ep
        self._index(ep)
        for hook in self.on_added:
            hook(ep)
        return ep

    def drain_endpoint(self, address: str, now: float | None = None) -> bool:
        """Stop new picks of `address`; it is removed (`remove_endpoint`) when its last
        in-flight request ends, at once when it has none.

        Args:
            now: `time.monotonic()` (seconds; default now), recorded as `draining_since`.

        Returns:
            False when no such endpoint is known.
        """
        ep = self._by_addr.get(address)
        if ep is None:
            return False
        if not ep.draining:
            ep.draining = True
            ep.draining_since = time.monotonic() if now is None else now
            self._unindex(ep)
            log.info("endpoint %s draining (%d requests in flight)", address, ep.inflight)
        if ep.inflight == 0:
            self.remove_endpoint(address)
        return True

    def remove_endpoint(self, address: str) -> Endpoint | None:
        """Take `address` out now: out of every table here, then the `on_removed` hooks drop
        what other components keep under its address. Requests still in flight there keep
        their `Reservation` (it releases against the detached `Endpoint`, so nothing leaks);
        prefer `drain_endpoint`, which waits for them.

        Returns:
            The removed endpoint, or None when it was not known.
        """
        ep = self._by_addr.pop(address, None)
        if ep is None:
            return None
        self._unindex(ep)
        ep.draining = True
        for hook in self.on_removed:
            try:
                hook(ep)
            except Exception:  # one component's bug must not keep the endpoint in the others
                log.exception("endpoint removal hook %r failed for %s", hook, address)
        log.info("endpoint %s removed", address)
        return ep

    def _drained(self, ep: Endpoint) -> None:
        """The last request of draining `ep` ended: remove it if it is still the one listed."""
        if self._by_addr.get(ep.address) is ep:
            self.remove_endpoint(ep.address)

    # Copy on write: a list `for_model` handed out earlier stays as it was.
    def _index(self, ep: Endpoint) -> None:
        for m in sorted(ep.models):
            self._by_model[m] = [*self._by_model.get(m, ()), ep]

    def _unindex(self, ep: Endpoint) -> None:
        for m in ep.models:
            pool = [other for other in self._by_model.get(m, ()) if other is not ep]
            if pool:
                self._by_model[m] = pool
            else:
                self._by_model.pop(m, None)

    def reserve(
        self,
        endpoint: Endpoint,
        blocks: int = 0,
        *,
        prompt_tokens: int = 0,
        settle_after_s: float = 2.0,
        context_tokens: int = 0,
        now: float | None = None,
        notify: bool = True,
        prefill_counts: PrefillCounts | None = None,
    ) -> Reservation:
        """Count a request in flight on `endpoint` (in prefill) holding `blocks` KV blocks, with
        `prompt_tokens` of prefill work and `context_tokens` of decode context (tokens), routed at
        `now` (`time.monotonic()` seconds; default now); release the returned reservation when
        the request ends, however it ends. `notify=False` does not tell the `listener` (a
        reservation another replica made, applied here). `prefill_counts`: the counts the work
        was computed from, kept on the reservation for the listener."""
        r = Reservation(self, endpoint, blocks, prompt_tokens, settle_after_s, context_tokens, now, prefill_counts)
        if prompt_tokens > 0:  # no prefill work (a passthrough, a fully cached prompt): never the queue's head
            endpoint.in_prefill[r] = None
        endpoint.inflight += 1
        endpoint.context_tokens += context_tokens
        endpoint.routed_total += 1
        endpoint.prefill_inflight += 1
        endpoint.prefill_tokens += prompt_tokens
        if blocks:
            endpoint.reserved_blocks += blocks
            endpoint.unsettled.add(r)
        self._open.add(r)
        if notify and self.listener is not None:
            self.listener.reserved(r)
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
