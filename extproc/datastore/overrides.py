"""Operator weight overrides: lower or drain an endpoint for a bounded time.

An override is a factor in [0, 1] on one endpoint (`Endpoint.override`) with an expiry:
0 drains it (the `weight-override-filter` drops it unless every candidate is drained), a value
in (0, 1) lowers it (the `weight-override-scorer` multiplies its total score by the factor),
1 or an expired override is no override. Overrides come from the admin server's authenticated
webhook (Alertmanager) or `POST /api/v1/weights/override` — on the replica that received it, and
with `replicas.sync: redis` on every other replica too (`extproc.replicas.sync`); nothing else
sets them, and every override ends by itself after at most `MAX_DURATION_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["WeightOverride", "MAX_DURATION_S", "MAX_REASON_CHARS", "DEFAULT_DURATION_S", "DEFAULT_LOWER_FACTOR", "SOURCES", "factor", "set_override"]

MAX_DURATION_S = 3600.0
"""Longest override (seconds): a forgotten drain must not outlive an on-call shift's hour."""

DEFAULT_DURATION_S = 300.0
"""Override length when the caller names none (seconds): Alertmanager's default
`repeat_interval` is longer, so a still-firing alert re-sends and renews before this lapses
only when configured to (deploy/prometheus/alertmanager.yml repeats every 1 min)."""

DEFAULT_LOWER_FACTOR = 0.25
"""Score multiplier of a `lower` override without an explicit factor."""

MAX_REASON_CHARS = 200
"""Longest reason kept with an override (characters; the rest is cut)."""

SOURCES = frozenset({"alertmanager", "api"})
"""Where an override can come from (the admin server's two write routes)."""


@dataclass(frozen=True, slots=True)
class WeightOverride:
    """One endpoint's override.

    Attributes:
        factor: score multiplier in [0, 1]; 0 = drained.
        expires_at: `time.monotonic()` at which it lapses (seconds).
        reason: short operator text (alert name or the caller's reason; never a credential).
        source: `alertmanager` or `api`.
    """

    factor: float
    expires_at: float
    reason: str
    source: str

    def active(self, now: float) -> bool:
        """True until `expires_at` (`now`: monotonic seconds)."""
        return now < self.expires_at


def factor(ep, now: float | None = None) -> float:
    """The endpoint's live override factor: 1.0 without an active override."""
    ov: WeightOverride | None = ep.override
    if ov is None:
        return 1.0
    if not ov.active(time.monotonic() if now is None else now):
        return 1.0
    return ov.factor


def set_override(ep, factor_: float, duration_s: float, *, reason: str, source: str, now: float | None = None) -> WeightOverride | None:
    """Set (factor < 1) or clear (factor == 1) the endpoint's override.

    Args:
        ep: the `Endpoint`.
        factor_: score multiplier in [0, 1].
        duration_s: how long it lasts (seconds), in (0, MAX_DURATION_S].
        reason, source: recorded with it (shown in /api/v1/weights).

    Returns:
        The new override, or None when cleared.

    Raises:
        ValueError: factor outside [0, 1] or duration outside (0, MAX_DURATION_S].
    """
    if not 0.0 <= factor_ <= 1.0:
        raise ValueError(f"factor must be in [0, 1], got {factor_}")
    if not 0.0 < duration_s <= MAX_DURATION_S:
        raise ValueError(f"duration_s must be in (0, {MAX_DURATION_S:g}], got {duration_s}")
    if factor_ == 1.0:
        ep.override = None
        return None
    now = time.monotonic() if now is None else now
    ep.override = WeightOverride(factor_, now + duration_s, reason[:MAX_REASON_CHARS], source)
    return ep.override
