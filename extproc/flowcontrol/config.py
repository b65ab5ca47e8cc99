"""Configuration of flow control (`flow_control:` in the config file; docs/decisions/0310).

Shape::

    flow_control:
      enabled: false               # off: every request is decided at once, as before
      fairness: drr                # fcfs | round-robin | drr (inside a priority band)
      ordering: fcfs               # fcfs | edf (inside one tenant's flow)
      drr_quantum_tokens: 2048     # tokens a flow of weight 1 earns per DRR round
      weights: {acme: 4, beta: 1}  # per tenant label (configured tenant names); others: default_weight
      default_weight: 1.0
      max_requests: 10000          # queued requests, all bands together (429 beyond)
      max_bytes: 268435456         # queued request bodies, all bands together (bytes; 429 beyond)
      retry_after_s: 1             # retry-after on a queue-full 429
      bands:                       # per priority class
        critical:  {ttl_s: 60}
        standard:  {ttl_s: 30}
        sheddable: {ttl_s: 10, max_requests: 2000}
      gate: {mode: router, max_prefill_requests: 4, max_engine_waiting: 0, max_predicted_ttft_ms: null,
             max_inflight: null, max_inflight_tokens: null, fair_share_headroom: true}
      slo_header: {name: x-slo-ttft-ms, trusted: false, max_ms: 600000}
      fairness_header: {name: x-llm-d-inference-fairness-id, trusted: false}
      objective_header: {name: x-llm-d-inference-objective, trusted: false}
      objectives: {interactive: {band: critical, ttft_slo_ms: 500, ttl_s: 20}}
      tick_s: 0.02                 # re-check of closed gates and expiries while anything waits
      displacement: false          # evict the newest sheddable stream for a critical request that waits
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from extproc.config_base import Strict

__all__ = ["BandLimits", "FlowControlConfig", "GateConfig", "HeaderTrust", "ObjectiveConfig", "BANDS"]

BANDS = ("critical", "standard", "sheddable")
"""The priority bands, served in this order (`extproc.admission.priority.PRIORITIES`)."""

Band = Literal["critical", "standard", "sheddable"]


class BandLimits(Strict):
    """One priority band's queue.

    Attributes:
        ttl_s: longest a request of this band waits (seconds); past it, a 503 `queue_timeout`.
        max_requests: most requests queued in the band (count; None: only the global bound).
        max_bytes: most request-body bytes queued in the band (bytes; None: only the global bound).
    """

    ttl_s: float = Field(default=30.0, gt=0, le=3600)
    max_requests: int | None = Field(default=None, ge=1)
    max_bytes: int | None = Field(default=None, ge=1)


def _default_bands() -> dict[str, BandLimits]:
    return {"critical": BandLimits(ttl_s=60.0), "standard": BandLimits(ttl_s=30.0), "sheddable": BandLimits(ttl_s=10.0)}


class GateConfig(Strict):
    """When a queued request may go to the endpoint the scheduler chose (the saturation gate,
    `extproc.flowcontrol.gate`).

    Attributes:
        mode: `router` (the router's own count of requests before their first token on the
            endpoint, every replica's included, plus the engine's reported queue and optionally
            the predicted TTFT), `concurrency` (a cap on requests or decode-context tokens in
            flight per endpoint), or `utilization` (llm-d's detector: the pool's mean of
            max(waiting / queue_depth, KV usage / kv_threshold) below 1, endpoints without
            fresh metrics counting as saturated).
        max_prefill_requests: router: the endpoint takes a request while fewer than this many
            of the requests routed there (by any replica) wait for their first token (count).
        max_engine_waiting: router: ... and its engine reports at most this many waiting
            requests plus those routed since its latest scrape still in prefill (count; None: not read).
        max_predicted_ttft_ms: router: ... and its learned prefill fit predicts the request's
            first token within this (milliseconds; None: not read).
        max_inflight: router and concurrency: requests in flight per endpoint, decoding ones
            included (count; None: no cap; decision 0311).
        max_inflight_tokens: router and concurrency: decode context in flight per endpoint
            (tokens; None: no cap).
        fair_share_headroom: a queued request whose tenant holds fewer of the pool's in-flight
            requests than its weighted share goes past a closed gate (at most up to twice
            `max_inflight` per endpoint; only with `max_inflight`; decision 0311).
        queue_depth: utilization: waiting requests that count as full (llm-d's default 5).
        kv_threshold: utilization: KV usage that counts as full (0..1; llm-d's default 0.8).
    """

    mode: Literal["router", "concurrency", "utilization"] = "router"
    max_prefill_requests: int = Field(default=4, ge=1)
    max_engine_waiting: int | None = Field(default=0, ge=0)
    max_predicted_ttft_ms: float | None = Field(default=None, gt=0)
    max_inflight: int | None = Field(default=None, ge=1)
    max_inflight_tokens: int | None = Field(default=None, ge=1)
    fair_share_headroom: bool = True
    queue_depth: int = Field(default=5, ge=1)
    kv_threshold: float = Field(default=0.8, gt=0, le=1)

    @model_validator(mode="after")
    def _concurrency_has_a_cap(self) -> GateConfig:
        if self.mode == "concurrency" and self.max_inflight is None and self.max_inflight_tokens is None:
            raise ValueError("gate.mode concurrency needs max_inflight or max_inflight_tokens (else it never closes)")
        return self


class HeaderTrust(Strict):
    """A request header flow control may read; read only when `trusted` (a layer before Envoy's
    ext_proc filter sets it and strips clients' copies; `llm-extproc envoy-config` adds it to the
    stripped list).

    Attributes:
        name: the header (lower case).
        trusted: read it (default false: a client's value is ignored).
        max_ms: for a deadline header, the largest value accepted (milliseconds); more is a 400.
    """

    name: str
    trusted: bool = False
    max_ms: int = Field(default=600_000, ge=1)

    @field_validator("name")
    @classmethod
    def _lower(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("header name must not be blank")
        return v.strip().lower()


class ObjectiveConfig(Strict):
    """An inference objective named by `objective_header` (llm-d's `x-llm-d-inference-objective`).

    Attributes:
        band: the priority band its requests queue in (it replaces the priority header's class).
        ttft_slo_ms: the deadline `edf` orders by (milliseconds after arrival; None: the band's TTL).
        ttl_s: longest its requests wait (seconds; None: the band's TTL).
    """

    band: Band
    ttft_slo_ms: int | None = Field(default=None, ge=1)
    ttl_s: float | None = Field(default=None, gt=0, le=3600)


class FlowControlConfig(Strict):
    """Flow control: queue requests at the gateway while the fleet is saturated, and dispatch
    them by priority band, then tenant fairness, then order inside the tenant's flow.

    Attributes: see the module docstring; `weights` are keyed by tenant label (a configured
    tenant name, the fairness header's value when that is trusted, `anonymous`).
    """

    enabled: bool = False
    fairness: Literal["fcfs", "round-robin", "drr"] = "drr"
    ordering: Literal["fcfs", "edf"] = "fcfs"
    drr_quantum_tokens: int = Field(default=2048, ge=1)
    weights: dict[str, float] = Field(default_factory=dict)
    default_weight: float = Field(default=1.0, gt=0)
    max_requests: int = Field(default=10_000, ge=1)
    max_bytes: int = Field(default=256 * 1024 * 1024, ge=1024)
    retry_after_s: int = Field(default=1, ge=1)
    bands: dict[Band, BandLimits] = Field(default_factory=_default_bands)
    gate: GateConfig = Field(default_factory=GateConfig)
    slo_header: HeaderTrust = Field(default_factory=lambda: HeaderTrust(name="x-slo-ttft-ms"))
    fairness_header: HeaderTrust = Field(default_factory=lambda: HeaderTrust(name="x-llm-d-inference-fairness-id"))
    objective_header: HeaderTrust = Field(default_factory=lambda: HeaderTrust(name="x-llm-d-inference-objective"))
    objectives: dict[str, ObjectiveConfig] = Field(default_factory=dict)
    tick_s: float = Field(default=0.02, gt=0, le=1.0)
    displacement: bool = False
    max_tenant_labels: int = Field(default=100, ge=1)

    @field_validator("weights")
    @classmethod
    def _positive_weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [f"{k!r}: {w}" for k, w in v.items() if not (w > 0 and w < float("inf"))]
        if bad:
            raise ValueError(f"weights must be finite numbers > 0; got {', '.join(bad)}")
        return v

    @model_validator(mode="after")
    def _every_band(self) -> FlowControlConfig:
        # A band left out keeps its default TTL: listing only `sheddable` must not drop the others.
        missing = {b: l for b, l in _default_bands().items() if b not in self.bands}
        if missing:
            object.__setattr__(self, "bands", {**missing, **self.bands})
        if self.objectives and not self.objective_header.trusted:
            raise ValueError(
                "objectives are named by objective_header, which is not trusted: set objective_header.trusted: true "
                "(and strip clients' copies in front of Envoy), or remove objectives"
            )
        return self

    @property
    def max_wait_s(self) -> float:
        """The longest any request may wait in a queue (seconds): the largest TTL configured."""
        return max([b.ttl_s for b in self.bands.values()] + [o.ttl_s for o in self.objectives.values() if o.ttl_s is not None])

    def message_timeout_s(self, decision_timeout_ms: int) -> float:
        """The Envoy ext_proc `message_timeout` a queued request needs (seconds): the longest
        queue wait, plus the decision budget (`limits.decision_timeout_ms`), plus 0.5 s for the
        hops. With the shipped 2 s a request queued for longer than ~0.5 s got Envoy's 504."""
        return self.max_wait_s + decision_timeout_ms / 1000.0 + 0.5

    @property
    def trusted_headers(self) -> list[str]:
        """The headers flow control reads (trusted ones only)."""
        return [h.name for h in (self.slo_header, self.fairness_header, self.objective_header) if h.trusted]
