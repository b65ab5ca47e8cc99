"""Priority classes and saturation shedding.

Classes (header `x-llm-priority` by default): `critical`, `standard`, `sheddable`. Under
saturation sheddable requests are refused first, standard ones next, critical ones never by
this rule (only when no endpoint can fit them at all, which the KV filter decides).

Saturation of the fleet serving a model (0 = idle, 1 = full; may exceed 1):

    saturation = max(mean over endpoints of effective KV usage,
                     mean over endpoints of waiting requests / queue_saturation_depth)

with effective KV usage counting our own unsettled reservations (their blocks are real), and
waiting requests as the engine reports them: only an engine's own queue is evidence of
saturation (a burst it has not reported yet may well fit its batch). Endpoints without metrics
count as idle for this purpose.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.config.schema import PriorityConfig
from extproc.datastore.endpoints import Endpoint
from extproc.errors import RateLimitedError, ValidationError
from extproc.scheduling.plugins.scorers.kv_utilization import effective_kv_usage

__all__ = ["PRIORITIES", "parse_priority", "fleet_saturation", "check_shedding"]

PRIORITIES = ("critical", "standard", "sheddable")


def parse_priority(value: str | None, cfg: PriorityConfig) -> str:
    """The request's priority class from its header value.

    Raises:
        ValidationError: a value other than critical / standard / sheddable.
    """
    if value is None or value == "":
        return cfg.default
    v = value.strip(" \t").lower()  # ASCII blanks only: "critical\xa0" is not a class
    if v not in PRIORITIES:
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise ValidationError(
            f"invalid {cfg.header} header {shown!r}; expected one of: {', '.join(PRIORITIES)}", param=cfg.header
        )
    return v


def fleet_saturation(endpoints: Sequence[Endpoint], queue_saturation_depth: int) -> float:
    """Saturation of a set of endpoints (0..1, may exceed 1); 0 for an empty set."""
    if not endpoints:
        return 0.0
    kv = [effective_kv_usage(ep) or 0.0 for ep in endpoints]
    queue = [(ep.engine.waiting if ep.engine is not None else 0) / queue_saturation_depth for ep in endpoints]
    return max(sum(kv) / len(kv), sum(queue) / len(queue))


def check_shedding(priority: str, saturation: float, cfg: PriorityConfig) -> None:
    """Refuse the request when its class is shed at this saturation.

    Raises:
        RateLimitedError: 429 with retry-after, naming the class and the saturation.
    """
    limit = {"sheddable": cfg.shed_sheddable_at, "standard": cfg.shed_standard_at}.get(priority)
    if limit is not None and saturation >= limit:
        raise RateLimitedError(
            f"the fleet is saturated ({saturation:.0%} ≥ {limit:.0%} for {priority} requests); retry later "
            f"or send a higher {cfg.header}",
            retry_after_s=cfg.retry_after_s,
            code=f"shed_{priority}",
        )
