"""Which flow a queued request joins: its tenant, band, weight, deadline and TTL.

* Tenant: llm-d's fairness id (`flow_control.fairness_header`, read only when trusted), else
  the rate limiter's tenant (`extproc.ratelimit.tenant`: a configured name or a key's hash),
  else `anonymous`. A fairness id is hashed before it is kept; its label is the id itself when
  `weights` names it, else `fid-<8 hex>` for the first `max_tenant_labels` ids, then `other`.
* Band: the objective's band (`objective_header`, trusted only) or the request's priority class.
* Deadline: arrival + `slo_header` milliseconds (trusted only; 1..`max_ms`, else a 400), or the
  objective's `ttft_slo_ms`, or the TTL. TTL: the objective's, else the band's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from extproc.errors import ValidationError
from extproc.flowcontrol.config import BANDS, FlowControlConfig

__all__ = ["FlowIdentity", "IdentityResolver"]


class FlowIdentity(NamedTuple):
    """Attributes: flow id, label, band index, weight, SLO (seconds or None), TTL (seconds)."""

    id: str
    label: str
    band: int
    weight: float
    slo_s: float | None
    ttl_s: float


class IdentityResolver:
    """`resolve(headers, tenant, priority)` → `FlowIdentity` (see the module docstring)."""

    def __init__(self, config: FlowControlConfig) -> None:
        self.config = config
        self._labels: dict[str, str] = {}
        self.reads_headers = bool(config.trusted_headers)
        """Some flow header is trusted: `resolve` may refuse a request (checked on every one)."""

    def resolve(self, headers: Mapping[str, str], tenant: Any, priority: str) -> FlowIdentity:
        """Raises:
            ValidationError: a trusted SLO header that is not an integer in 1..max_ms, or a trusted
                objective header naming no configured objective (400).
        """
        cfg = self.config
        band = BANDS.index(priority) if priority in BANDS else 1
        slo_s: float | None = None
        ttl: float | None = None
        h = cfg.objective_header
        if h.trusted and (name := headers.get(h.name)):
            objective = cfg.objectives.get(name)
            if objective is None:
                known = ", ".join(sorted(cfg.objectives)) or "none configured"
                raise ValidationError(f"{h.name}: unknown objective {name[:64]!r}; known: {known}", param=h.name, code="unknown_objective")
            band = BANDS.index(objective.band)
            slo_s = objective.ttft_slo_ms / 1000.0 if objective.ttft_slo_ms is not None else None
            ttl = objective.ttl_s
        h = cfg.slo_header
        if h.trusted and (raw := headers.get(h.name)):
            try:
                ms = int(raw.strip())
            except ValueError:
                ms = 0
            if not 1 <= ms <= h.max_ms:
                raise ValidationError(f"{h.name} must be an integer of milliseconds in 1..{h.max_ms}", param=h.name)
            slo_s = ms / 1000.0
        if ttl is None:
            ttl = cfg.bands[BANDS[band]].ttl_s
        h = cfg.fairness_header
        fid = headers.get(h.name, "").strip() if h.trusted else ""
        if fid:
            flow_id = "fid:" + hashlib.sha256(fid.encode("utf-8", "surrogateescape")).hexdigest()
            label = fid if fid in cfg.weights else self._label(flow_id)
        elif tenant is not None:
            flow_id, label = tenant.id, tenant.label
        else:
            flow_id = label = "anonymous"
        weight = cfg.weights.get(label, cfg.default_weight)
        return FlowIdentity(flow_id, label, band, weight, slo_s, ttl)

    def _label(self, flow_id: str) -> str:
        label = self._labels.get(flow_id)
        if label is None:
            if len(self._labels) >= self.config.max_tenant_labels:
                return "other"
            label = self._labels[flow_id] = "fid-" + flow_id[4:12]
        return label
