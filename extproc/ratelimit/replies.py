"""What clients are told: OpenAI's `x-ratelimit-*` headers and the 429 / 400 errors.

OpenAI's six headers (https://platform.openai.com/docs/guides/rate-limits):
`x-ratelimit-limit-requests`, `x-ratelimit-limit-tokens`, `x-ratelimit-remaining-requests`,
`x-ratelimit-remaining-tokens`, `x-ratelimit-reset-requests`, `x-ratelimit-reset-tokens`; the
resets are Go duration strings (`1s`, `6m0s`, `20ms`, `1m30.5s`). With several limited scopes
(tenant, tenant × model) each pair comes from the scope with the fewest remaining. A paced scope's
remaining tokens are the fewer of its window's and its bucket's (what could be sent now).

Reset semantics (OpenAI: "the time until the rate limit resets to its initial state"). The
window slides in 1 s buckets (`window.py`): a charge made in bucket i leaves it when bucket
i + 60 starts. On an admitted request `x-ratelimit-reset-*` is until the *newest* charge has
left, i.e. until the window is empty again. It shrinks while no request is sent and jumps back
to ~60 s with each request made in a new bucket: that is correct, the new request has restarted
the time until the window is fully reset. On a 429 the client needs something else, the time
until the refused limit admits one more: that is when the *oldest* charges leave, up to one
bucket sooner than the window's emptying. So a refusal's reset of the refused kind is the
retry wait itself: the body's "try again in 58.828s", `x-ratelimit-reset-requests: 58.828s`
and `retry-after: 59` (whole seconds, rounded up) describe the same instant.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.errors import RateLimitedError, ValidationError
from extproc.ratelimit.window import ScopeLimit, ScopeUse

__all__ = ["duration", "ratelimit_headers", "TenantRateLimitedError", "TooLargeForLimitError"]


def duration(ms: int) -> str:
    """Milliseconds as Go's `time.Duration.String()` at millisecond precision, as OpenAI writes
    resets: 0 → `0s`, 20 → `20ms`, 1000 → `1s`, 1500 → `1.5s`, 360000 → `6m0s`, 3723000 → `1h2m3s`."""
    ms = max(0, int(ms))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, frac = divmod(rest, 1000)
    sec = f"{s}" if frac == 0 else f"{s}.{frac:03d}".rstrip("0")
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


def ratelimit_headers(limits: Sequence[ScopeLimit], uses: Sequence[ScopeUse]) -> dict[str, str]:
    """The six headers for a decision's scopes (only the kinds that have a limit somewhere)."""
    out: dict[str, str] = {}
    for kind, slot in (("requests", 1), ("tokens", 0)):
        best: tuple[int, int, int] | None = None  # (remaining, limit, reset ms)
        for lim, use in zip(limits, uses, strict=True):
            limit = lim.requests if slot else lim.tokens
            if limit < 0:
                continue
            used = use.requests if slot else use.tokens
            reset = use.reset_requests_ms if slot else use.reset_tokens_ms
            remaining = max(0, limit - used)
            if not slot and use.bucket_tokens is not None:
                remaining = max(0, min(remaining, use.bucket_tokens))
            cand = (remaining, limit, reset)
            if best is None or cand[0] < best[0]:
                best = cand
        if best is not None:
            out[f"x-ratelimit-limit-{kind}"] = str(best[1])
            out[f"x-ratelimit-remaining-{kind}"] = str(best[0])
            out[f"x-ratelimit-reset-{kind}"] = duration(best[2])
    return out


class TenantRateLimitedError(RateLimitedError):
    """429 for a tenant over its limit: OpenAI's body (`type` names the limit: `tokens` or
    `requests`), `retry-after` (whole seconds, rounded up) and the six `x-ratelimit-*` headers."""

    def __init__(self, message: str, *, limit: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message, retry_after_s=retry_after_s, code="rate_limit_exceeded")
        self.type = limit
        self._extra = headers

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, -int(-self.retry_after_s // 1))), **self._extra}


class TooLargeForLimitError(ValidationError):
    """400: the request costs more than the whole limit, so no wait would ever admit it."""

    code = "request_exceeds_rate_limit"
