"""The prefix tracker: the prefix index, session bindings and hot prefixes behind one object the
request pipeline calls at three points.

* `lookup(request, candidates, ...)` — before scoring: hash the prompt's cacheable blocks at each
  candidate's block size and match them against the index (`PrefixMatch`, read by the scorers).
* `on_pick(endpoint, match, session)` — right after the pick, before any await: the request's
  blocks count for the chosen endpoint at once (approximate source), so the same long prompt sent
  again 5 ms later follows it; the session is bound there.
* `on_scrape(endpoint)` — after each engine scrape: the index is bounded by the engine's
  `num_gpu_blocks`, and an engine whose prefix-cache counters went backwards restarted, so what
  it held is gone (its entries are dropped).

Index sources per endpoint: *approximate* (default) learns from our own decisions; *precise*
endpoints (those with `kv_events` configured) learn from the engine's KV-cache events
(`extproc.prefix.precise`), and a pick only adds short-lived speculative entries there.

Prompts shorter than one block (plus the one token vLLM always computes) carry no affinity, nor
does a match shorter than `min_match_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.prefix.hashing import cacheable_blocks, chain_block_hashes, root_hash
from extproc.prefix.hot import HotPrefixes
from extproc.prefix.index import BYTES_PER_ENTRY, PrefixIndex
from extproc.prefix.match import PrefixMatch
from extproc.prefix.sessions import SessionTable, session_key
from extproc.prefix.warmup import PrefixWarmer

if TYPE_CHECKING:
    from extproc.config.schema import PrefixConfig
    from extproc.datastore.endpoints import Endpoint
    from extproc.types import LLMRequest

__all__ = ["PrefixTracker", "PrefixMetrics", "EndpointPrefixStats"]


@dataclass(slots=True)
class EndpointPrefixStats:
    """Per-endpoint counts for comparing our predictions with the engine's own hit rate.

    Attributes:
        routed_prompt_tokens: prompt tokens of requests routed there (tokens).
        predicted_hit_tokens: of those, tokens the index believed cached there (tokens).
        engine_queries_at / engine_hits_at: the engine's prefix-cache counters when we started
            counting (tokens), to report the engine's hit rate over the same span.
        last_engine_queries: the engine's query counter at the previous scrape (tokens), to
            notice a restart (counters go backwards).
        resets: times its entries were dropped (engine restart or clear).
    """

    routed_prompt_tokens: int = 0
    predicted_hit_tokens: int = 0
    engine_queries_at: float | None = None
    engine_hits_at: float | None = None
    last_engine_queries: float | None = None
    resets: int = 0
    counters: tuple[Any, Any] | None = None
    """This endpoint's (routed prompt tokens, predicted hit tokens) counter children, taken once:
    prometheus_client's `labels()` validates and locks on every call."""


class PrefixMetrics:
    """The tracker's Prometheus series (endpoint labels only: a bounded set)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        kw = {"registry": registry}
        self.predicted_hit_tokens = Counter(
            "llm_extproc_prefix_predicted_hit_tokens_total",
            "Prompt tokens the prefix index believed cached on the endpoint a request was routed to "
            "(compare with vllm:prefix_cache_hits_total).",
            ["endpoint"],
            **kw,
        )
        self.routed_prompt_tokens = Counter(
            "llm_extproc_prefix_routed_prompt_tokens_total",
            "Prompt tokens routed to the endpoint (compare with vllm:prefix_cache_queries_total).",
            ["endpoint"],
            **kw,
        )
        self.index_blocks = Gauge("llm_extproc_prefix_index_blocks", "Blocks the prefix index holds for the endpoint.", ["endpoint"], **kw)
        self.index_bytes = Gauge("llm_extproc_prefix_index_bytes", "Approximate memory of the whole prefix index (bytes).", **kw)
        self.index_resets = Counter(
            "llm_extproc_prefix_index_resets_total",
            "Times an endpoint's prefix entries were dropped, by reason (restart, cleared, removed, gap).",
            ["endpoint", "reason"],
            **kw,
        )
        self.sessions = Gauge("llm_extproc_sessions", "Sessions bound to an endpoint.", **kw)
        self.hot_seeded = Counter(
            "llm_extproc_prefix_hot_seeded_total",
            "Requests with a hot prefix routed to an endpoint that did not hold it (a cold endpoint seeded "
            "because the warm ones were busier than the prefill saved).",
            **kw,
        )
        self.hot_hits = Counter(
            "llm_extproc_prefix_hot_hits_total",
            "Requests with a hot prefix routed to an endpoint holding it.",
            **kw,
        )


class PrefixTracker:
    """The prefix index, sessions and hot prefixes (see the module doc).

    Args:
        config: `scheduling.prefix`.
        metrics: Prometheus series (None: a private registry, for tests).
        clock: monotonic seconds.
        registry: where the warmer's metrics go (None: a private registry).
    """

    def __init__(
        self,
        config: PrefixConfig,
        metrics: PrefixMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.enabled = config.enabled
        self.index = PrefixIndex(max(1, config.max_index_bytes // BYTES_PER_ENTRY), config.default_capacity_blocks)
        self.sessions = SessionTable(config.max_sessions, config.session_ttl_s)
        hot = config.hot
        self.hot = HotPrefixes(hot.window_s, hot.buckets, hot.min_count, hot.max_tracked)
        self.metrics = metrics or PrefixMetrics(CollectorRegistry())
        self.stats: dict[str, EndpointPrefixStats] = {}
        self.precise: set[str] = set()
        """Addresses whose index comes from KV events (picks add nothing lasting there)."""
        self.on_precise_pick: Callable[[str, list[int]], None] | None = None
        """Set by the KV-event source: called instead of `index.add` for precise endpoints."""
        self.on_reset: Callable[[str], None] | None = None
        """Set by the KV-event source: called after an endpoint's entries were dropped."""
        self.on_shared: Callable[[str, list[int], bytes | None], None] | None = None
        """Set by replica sync: called by `on_pick` with (address, the prompt's block
        hashes at that endpoint's block size, session key) when there is something to learn, so the
        other replicas learn the pick (`apply_remote_pick`)."""
        self._clock = clock
        self.warmer = PrefixWarmer(config.warmup, self.index, registry, clock)
        self.metrics.index_bytes.set_function(lambda: len(self.index) * BYTES_PER_ENTRY)
        self.metrics.sessions.set_function(lambda: len(self.sessions))

    # -- the request path -------------------------------------------------------------------
    def session_of(self, header_value: str | None, user: str | None) -> bytes | None:
        """The session key of a request: the session header's value, else (when configured) its
        `user` field; None without either."""
        if header_value:
            return session_key(header_value)
        if self.config.session_from_user and user:
            return session_key("user\0" + user)
        return None

    def lookup(self, request: LLMRequest, candidates: Sequence[Endpoint], block_size_of: Callable[[Endpoint], int]) -> PrefixMatch | None:
        """Hash the request's prompt (at each candidate's block size) and match it against the
        index. None when tracking is off, the token ids are unknown (a character estimate), or
        the prompt has no cacheable full block."""
        ids = request.token_ids
        if not self.enabled or not ids:
            return None
        prompt = int(request.prompt_tokens) or len(ids)
        match = PrefixMatch(prompt_tokens=prompt)
        root = root_hash(request.adapter, request.cache_salt)  # an adapter's blocks are its own
        for bs in {block_size_of(ep) for ep in candidates}:
            hashes = match.hashes[bs] = chain_block_hashes(ids[: cacheable_blocks(len(ids), bs) * bs], bs, root)
            for addr, blocks in self.index.match(hashes).items():
                match.matched[addr] = blocks
                match.block_size[addr] = bs
        any_blocks = any(match.hashes.values())
        if not any_blocks:
            return None
        # An endpoint matched at another block size than its own cannot really hold it; a match
        # shorter than min_match_tokens is noise beside load (short prompts spread freely).
        by_addr = {ep.address: block_size_of(ep) for ep in candidates}
        floor = self.config.min_match_tokens
        for addr in [a for a, bs in match.block_size.items() if by_addr.get(a, bs) != bs or match.matched[a] * bs < floor]:
            del match.matched[addr]
            del match.block_size[addr]
        return match

    def on_pick(
        self,
        endpoint: Endpoint,
        block_size: int,
        match: PrefixMatch | None,
        session: bytes | None,
        *,
        candidates: Sequence[Endpoint] = (),
        token_ids: Sequence[int] | None = None,
        model: str = "",
    ) -> None:
        """Count the decision (call right after the pick, with no await before it). With
        `candidates`, the prompt's `token_ids` and the served `model`, a hot prefix may be
        warmed onto a cold endpoint (`scheduling.prefix.warmup`)."""
        now = self._clock()
        addr = endpoint.address
        if session is not None:
            self.sessions.bind(session, addr, now)
        hashes = (match.hashes.get(block_size) or []) if match is not None else []
        if self.on_shared is not None and (session is not None or hashes):
            self.on_shared(addr, hashes, session)
        if match is None:
            return
        st = self._stats(addr)
        cached = match.cached_tokens(addr)
        st.routed_prompt_tokens += match.prompt_tokens
        st.predicted_hit_tokens += cached
        m = self.metrics
        if st.counters is None:
            st.counters = (m.routed_prompt_tokens.labels(addr), m.predicted_hit_tokens.labels(addr))
        st.counters[0].inc(match.prompt_tokens)
        if cached:
            st.counters[1].inc(cached)
        # Hot prefixes: the longest shared part any endpoint held at routing time.
        best = max((b for a, b in match.matched.items() if match.block_size.get(a) == block_size), default=0)
        if best > 0 and hashes:
            shared = hashes[best - 1]
            hot_before = self.hot.is_hot(shared, now)
            self.hot.record(shared, best * block_size, now)
            warm_here = match.matched.get(addr, 0) >= best
            self.warmer.note_routed(addr, shared, warm_here)
            if hot_before:
                if warm_here:
                    m.hot_hits.inc()
                else:
                    m.hot_seeded.inc()
                if candidates and token_ids is not None:
                    holders = {a for a, b in match.matched.items() if b >= best} | {addr}
                    self.warmer.consider(candidates, sorted(holders), shared, hashes[:best], token_ids[: best * block_size], model)
        self._learn(addr, hashes)

    def apply_remote_pick(self, address: str, hashes: list[int], session: bytes | None) -> None:
        """Another replica routed a prompt with these block `hashes` (and `session`) to
        `address`: learn it as if this replica had (index entries, speculative ones for a precise
        endpoint; the session binding). Statistics and hot prefixes stay this replica's own."""
        if session is not None:
            self.sessions.bind(session, address, self._clock())
        if self.enabled:
            self._learn(address, hashes)

    def _learn(self, address: str, hashes: list[int]) -> None:
        """`address` now holds (or will have prefilled) these blocks: index entries, speculative
        ones for an endpoint whose index comes from its KV events."""
        if not hashes:
            return
        if address in self.precise and self.on_precise_pick is not None:
            self.on_precise_pick(address, hashes)
        else:
            self.index.add(address, hashes)

    def session_endpoint(self, session: bytes | None) -> str | None:
        """The endpoint `session` was last routed to, or None."""
        return self.sessions.get(session, self._clock())

    # -- engine state -----------------------------------------------------------------------
    def on_scrape(self, endpoint: Endpoint) -> None:
        """After a successful scrape: bound the endpoint's index by its engine's KV capacity;
        drop its entries when its prefix-cache counters went backwards (a restart)."""
        engine = endpoint.engine
        if engine is None:
            return
        addr = endpoint.address
        if engine.num_gpu_blocks:
            self.index.set_capacity(addr, int(engine.num_gpu_blocks))
        st = self._stats(addr)
        queries = float(engine.prefix_queries)
        if st.engine_queries_at is None:
            st.engine_queries_at, st.engine_hits_at = queries, float(engine.prefix_hits)
        elif st.last_engine_queries is not None and queries < st.last_engine_queries:
            self.reset(addr, "restart")
            st.engine_queries_at, st.engine_hits_at = queries, float(engine.prefix_hits)
            st.routed_prompt_tokens = st.predicted_hit_tokens = 0
        st.last_engine_queries = queries

    def _stats(self, address: str) -> EndpointPrefixStats:
        """The endpoint's statistics, created (with its index-size gauge, read at scrape time)
        the first time it is seen."""
        st = self.stats.get(address)
        if st is None:
            st = self.stats[address] = EndpointPrefixStats()
            self.metrics.index_blocks.labels(address).set_function(lambda: self.index.blocks(address))
        return st

    def reset(self, address: str, reason: str) -> int:
        """Drop everything the index holds for `address` (`reason`: restart, cleared, removed,
        gap)."""
        gone = self.index.clear(address)
        if self.on_reset is not None:
            self.on_reset(address)
        st = self.stats.get(address)
        if st is not None:
            st.resets += 1
        self.metrics.index_resets.labels(address, reason).inc()
        return gone

    def drop_endpoint(self, address: str) -> None:
        """The endpoint left the fleet: its index entries, sessions and statistics go, and so do
        its metric series."""
        self.reset(address, "removed")
        self.sessions.drop_endpoint(address)
        self.warmer.drop_endpoint(address)
        self.stats.pop(address, None)
        self.precise.discard(address)
        m = self.metrics
        for metric in (m.predicted_hit_tokens, m.routed_prompt_tokens, m.index_blocks):
            try:
                metric.remove(address)
            except KeyError:
                pass
        for reason in ("restart", "cleared", "removed", "gap"):
            try:
                m.index_resets.remove(address, reason)
            except KeyError:
                pass

    # -- observability ----------------------------------------------------------------------
    def describe(self, endpoint: Endpoint) -> dict[str, object]:
        """The endpoint's index for `/api/v1/endpoints`: blocks, bound, source, our predicted hit
        rate and the engine's own over the same span."""
        addr = endpoint.address
        st = self.stats.get(addr) or EndpointPrefixStats()
        engine = endpoint.engine
        engine_rate = None
        if engine is not None and st.engine_queries_at is not None:
            dq = float(engine.prefix_queries) - st.engine_queries_at
            dh = float(engine.prefix_hits) - (st.engine_hits_at or 0.0)
            engine_rate = dh / dq if dq > 0 else None
        return {
            "source": "precise" if addr in self.precise else "approximate",
            "blocks": self.index.blocks(addr),
            "capacity_blocks": self.index.capacity(addr),
            "sessions": self.sessions.count_for(addr),
            "routed_prompt_tokens": st.routed_prompt_tokens,
            "predicted_hit_tokens": st.predicted_hit_tokens,
            "predicted_hit_rate": st.predicted_hit_tokens / st.routed_prompt_tokens if st.routed_prompt_tokens else None,
            "engine_hit_rate": engine_rate,
            "resets": st.resets,
        }

    def summary(self) -> dict[str, object]:
        """Index-wide numbers for `/api/v1/endpoints`."""
        now = self._clock()
        return {
            "enabled": self.enabled,
            "entries": len(self.index),
            "max_entries": self.index.max_entries,
            "bytes": len(self.index) * BYTES_PER_ENTRY,
            "evictions": self.index.evictions,
            "sessions": len(self.sessions),
            "warmups_in_flight": self.warmer.in_flight,
            "hot_prefixes": [{"hash": f"{h:016x}", "tokens": t, "requests": c} for h, t, c in self.hot.hottest(now)],
        }
