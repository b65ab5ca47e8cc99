"""The saturation gate: may the request go to the endpoint the scheduler chose, now?

Three shapes (`flow_control.gate.mode`, docs/decisions/0310 for the trade-off):

* `router` (default) — the router's own knowledge first. The endpoint takes the request while
  fewer than `max_prefill_requests` of the requests routed there are still before their first
  token. That count is ours: it moves at the moment of each reservation (synchronously, in
  the decision), at each first token and each release, and it includes every replica's picks
  (`extproc.replicas.sync` applies the others' reservations to the same `Endpoint`), so a burst
  cannot pass on a scrape taken before it. Then the running load (decision 0311): fewer than
  `max_inflight` requests in flight there (decoding ones included) and, when configured, the
  decode context in flight within `max_inflight_tokens` — without it a flooder's decodes fill
  the engine's batch and every other tenant's tokens slow with it. Then, when configured, the engine's own reported
  queue (`max_engine_waiting`: a scraped number can only close the gate, and a stale high value
  closes it until the next scrape — conservative) and the predicted TTFT (the ttft-estimate scorer's for this endpoint, else the learned prefill fit's)
  for this request behind the prefill already there (`max_predicted_ttft_ms`).
* `concurrency` — a pure cap: requests in flight (`max_inflight`) and/or decode-context tokens
  in flight (`max_inflight_tokens`) per endpoint. Simple and predictable, but blind to prompt
  length and prefix reuse: the cap must be tuned per model, GPU and workload.
* `utilization` — llm-d-router's detector: the pool is saturated when the mean over its
  endpoints of max(waiting / `queue_depth`, KV usage / `kv_threshold`) reaches 1, an endpoint
  without fresh metrics counting as saturated. Scraped numbers only (our unsettled KV
  reservations are added): between scrapes a burst passes.

Counters are never reaped by age (llm-d-router #2295: a staleness reaper freed in-flight
accounting of live streams and the gate kept reopening): a reservation leaves the counts only
when its stream ends. An endpoint that leaves and comes back under the same address is a new
`Endpoint` object with its own counters; a request still holding the old one releases against
the old object (llm-d-router PR #1739's underflow cannot happen).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from extproc.datastore.endpoints import Endpoint, effective_kv_usage
from extproc.flowcontrol.config import GateConfig

__all__ = ["Gate"]


class Gate:
    """`admits(routed)`: whether the routed request may be reserved now.

    Args:
        config: `flow_control.gate`.
        pool_of: model name → its endpoints (utilization mode reads the whole pool).
        stale_after_s: metrics older than this count as saturated (utilization; seconds).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        config: GateConfig,
        pool_of: Callable[[str], Sequence[Endpoint]] | None = None,
        stale_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._pool_of = pool_of
        self._stale_after_s = stale_after_s
        self._clock = clock
        self.admits: Callable[[Any], bool] = {
            "router": self._router,
            "concurrency": self._concurrency,
            "utilization": self._utilization,
        }[config.mode]
        self.endpoint_open: Callable[[Endpoint], bool] | None = {
            "router": self._router_open,
            "concurrency": self._concurrency_open,
            "utilization": None,
        }[config.mode]
        """The gate's per-endpoint test, without the request (None: `utilization` reads the whole
        pool): when the scheduler's choice is refused, the request is scheduled again among the
        endpoints it passes, so a busy favourite does not hold a request an idle endpoint can take."""

    def _router_open(self, ep: Endpoint) -> bool:
        """Router mode's tests that read the endpoint alone: its prefill count, its in-flight
        count (`max_inflight`) and the engine's reported queue."""
        cfg = self.config
        if ep.prefill_inflight >= cfg.max_prefill_requests or not self._concurrency_open(ep):
            return False
        engine = ep.engine
        return cfg.max_engine_waiting is None or engine is None or engine.waiting <= cfg.max_engine_waiting

    def _concurrency_open(self, ep: Endpoint) -> bool:
        """Fewer than `max_inflight` requests in flight on `ep` (no cap: always)."""
        cap = self.config.max_inflight
        return cap is None or ep.inflight < cap

    def _router(self, routed: Any) -> bool:
        ep = routed.endpoint
        if ep is None:  # tier mode: Envoy picks the endpoint; nothing of ours to read
            return True
        # The endpoint's own tests, then the decode context (the decode load, not only the prefill queue).
        if not self._router_open(ep) or not self._within_tokens(routed, ep):
            return False
        cfg = self.config
        if cfg.max_predicted_ttft_ms is not None:
            # The ttft-estimate scorer's prediction for this endpoint when the profile made one
            # (prefix-aware, decode stalls included), else the fit over the prefill ahead.
            predicted = routed.predicted_ttft_s.get(ep.address) if routed.predicted_ttft_s else None
            if predicted is None:
                predicted = ep.prefill_fit.predict(ep.prefill_ahead(self._clock()) + routed.prefill_tokens)
            if predicted * 1000.0 > cfg.max_predicted_ttft_ms:
                return ep.prefill_inflight == 0  # alone, it waits for nobody: never blocked for good
        return True

    def _concurrency(self, routed: Any) -> bool:
        ep = routed.endpoint
        if ep is None:
            return True
        return self._concurrency_open(ep) and self._within_tokens(routed, ep)

    def _within_tokens(self, routed: Any, ep: Endpoint) -> bool:
        """The running-load bound's token half (router and concurrency): the endpoint's decode
        context plus this request's (tokens) within `max_inflight_tokens` (an endpoint with
        nothing in flight always takes one, so a request larger than the bound is never
        blocked for good). The count half is `_concurrency_open`."""
        cap = self.config.max_inflight_tokens
        if cap is None or ep.inflight == 0:
            return True
        own = routed.request.prompt_tokens + routed.decode_tokens * routed.request.sequences // 2
        return ep.context_tokens + own <= cap

    def _utilization(self, routed: Any) -> bool:
        ep = routed.endpoint
        if ep is None or self._pool_of is None:
            return True
        return self.pool_saturation(self._pool_of(routed.request.served_model)) < 1.0

    def pool_saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """llm-d's utilization of a pool (0 idle, ≥ 1 saturated): the mean over endpoints of
        max(waiting / queue_depth, effective KV usage / kv_threshold); an endpoint without
        metrics, or with metrics older than `stale_after_s`, counts 1. An empty pool is 1."""
        if not endpoints:
            return 1.0
        cfg, now, total = self.config, self._clock(), 0.0
        for ep in endpoints:
            age = ep.metrics_age(now)
            if age is None or age > self._stale_after_s:
                total += 1.0
                continue
            kv = effective_kv_usage(ep) or 0.0
            total += max(ep.engine.waiting / cfg.queue_depth, kv / cfg.kv_threshold)
        return total / len(endpoints)
