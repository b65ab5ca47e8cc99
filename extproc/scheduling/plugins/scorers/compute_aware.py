"""`compute-aware-scorer`: the design notes' weight

    w_i = α · (1 / latency_i) + β · (free_kv_i / total_kv_i) + γ · (1 − gpu_util_i)

* latency_i: P95 TTFT of the endpoint (seconds) — measured on the response path
  (`endpoint.stream_stats`) when available, else derived from the engine's TTFT histogram;
  normalised across candidates as `min_latency / latency_i` so the term is in (0, 1].
  An endpoint with no latency data yet gets the candidates' median (neutral).
* free_kv_i / total_kv_i: 1 − effective KV usage (our unsettled reservations included).
* gpu_util_i: from the node agent (`endpoint.node.gpu_util`); without an agent the γ term is
  dropped and α, β renormalised, so the score stays in [0, 1].

Parameters:
    alpha, beta, gamma (finite float ≥ 0, defaults 0.4 / 0.4 / 0.2; at least one > 0).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import Field, model_validator

from extproc.datastore.endpoints import Endpoint, effective_kv_usage
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register

__all__ = ["ComputeAwareScorer", "components", "p95_ttft_s"]


def p95_ttft_s(ep: Endpoint) -> float | None:
    """The endpoint's P95 TTFT (seconds): response-path measurement first, engine histogram second."""
    stats = ep.stream_stats
    if stats is not None:
        value = getattr(stats, "ttft_p95_s", None)
        value = value() if callable(value) else value
        if value:
            return float(value)
    engine = ep.engine
    if engine is not None and engine.ttft_p95_s:
        return float(engine.ttft_p95_s)
    return None


def components(endpoints: Sequence[Endpoint]) -> list[dict[str, float | None]]:
    """Per endpoint: latency term (0..1), free-KV term (0..1), GPU-idle term (0..1 or None)."""
    lat = [p95_ttft_s(ep) for ep in endpoints]
    known = [x for x in lat if x]
    fill = statistics.median(known) if known else None
    lo = min(known) if known else None
    out = []
    for ep, latency in zip(endpoints, lat):
        latency = latency or fill
        lat_term = (lo / latency) if (latency and lo) else 1.0
        usage = effective_kv_usage(ep)
        kv_term = 0.5 if usage is None else max(0.0, 1.0 - usage)
        util = getattr(ep.node, "gpu_util", None)
        gpu_term = None if util is None else max(0.0, 1.0 - float(util))
        out.append({"latency": lat_term, "free_kv": kv_term, "gpu_idle": gpu_term})
    return out


@register("compute-aware-scorer")
class ComputeAwareScorer(Plugin):
    class Params(Params):
        # finite: an inf weight made every score inf / inf = NaN
        alpha: float = Field(default=0.4, ge=0, allow_inf_nan=False)
        beta: float = Field(default=0.4, ge=0, allow_inf_nan=False)
        gamma: float = Field(default=0.2, ge=0, allow_inf_nan=False)

        @model_validator(mode="after")
        def _some_weight(self):
            if self.alpha + self.beta + self.gamma <= 0:
                raise ValueError("at least one of alpha, beta, gamma must be > 0")
            return self

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        p = self.params
        out = []
        for c in components(endpoints):
            if c["gpu_idle"] is None:
                total = p.alpha + p.beta
                out.append((p.alpha * c["latency"] + p.beta * c["free_kv"]) / total if total else 0.0)
            else:
                total = p.alpha + p.beta + p.gamma
                out.append((p.alpha * c["latency"] + p.beta * c["free_kv"] + p.gamma * c["gpu_idle"]) / total)
        return out
