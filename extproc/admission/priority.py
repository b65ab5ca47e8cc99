"""Priority classes and saturation shedding.

Classes (header `x-llm-priority` by default): `critical`, `standard`, `sheddable`. A client may
claim by that header only the classes `admission.priority.claimable` lists (default: standard and
sheddable); a higher claim is downgraded to the highest claimable class, or refused with a 400
when `on_unclaimable: reject`, and counted either way. Any class comes from
`admission.priority.trusted_header`, a header only a trusted layer before Envoy's ext_proc filter
sets (an auth filter), or from the hook `extra_claimable` (a tenant's allowance). Under
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

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from extproc.config.schema import PriorityConfig
from extproc.datastore.endpoints import Endpoint, effective_kv_usage
from extproc.errors import RateLimitedError, ValidationError

__all__ = ["PRIORITIES", "PriorityClaim", "parse_priority", "claim_priority", "fleet_saturation", "check_shedding"]

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


@dataclass(frozen=True, slots=True)
class PriorityClaim:
    """A request's class after the claim bounds.

    Attributes:
        priority: the class the request is admitted under.
        claimed: the class its header claimed (normalised), or None without a claim.
        downgraded: the claim exceeded what the request may claim and `priority` is lower.
    """

    priority: str
    claimed: str | None = None
    downgraded: bool = False


def claim_priority(
    value: str | None,
    cfg: PriorityConfig,
    *,
    trusted_value: str | None = None,
    extra_claimable: Collection[str] = (),
) -> PriorityClaim:
    """The class a request is admitted under, from its (untrusted) header and a trusted one.

    Args:
        value: the client's `cfg.header` value, if sent; normalised as in `parse_priority`
            (`CRITICAL` and `critical\t` are claims of `critical`, not a way around the bound).
        trusted_value: the `cfg.trusted_header` value, if configured and sent: any class,
            taken as is (it wins over `value`).
        extra_claimable: classes this request may also claim by `cfg.header` — the hook for a
            tenant's allowance (empty until tenants grant one).

    Raises:
        ValidationError: a value that is not a class (400), or a claim above the bound when
            `cfg.on_unclaimable` is `reject` (400, code `priority_not_allowed`).
    """
    if trusted_value:
        return PriorityClaim(parse_priority(trusted_value, cfg))
    if value is None or value == "":
        return PriorityClaim(cfg.default)
    claimed = parse_priority(value, cfg)
    if claimed in cfg.claimable or claimed in extra_claimable:
        return PriorityClaim(claimed, claimed)
    if cfg.on_unclaimable == "reject":
        raise ValidationError(
            f"{cfg.header}: {claimed!r} may not be claimed by this request; allowed: {', '.join(cfg.claimable)}",
            param=cfg.header,
            code="priority_not_allowed",
        )
    # The highest class the request may claim that is below its claim (PRIORITIES is ordered).
    lower = [p for p in PRIORITIES[PRIORITIES.index(claimed) + 1 :] if p in cfg.claimable or p in extra_claimable]
    return PriorityClaim(lower[0] if lower else PRIORITIES[-1], claimed, downgraded=True)


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
