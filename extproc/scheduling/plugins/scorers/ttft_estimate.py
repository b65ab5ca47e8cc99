"""`ttft-estimate-scorer`: prefer the endpoint expected to produce this request's first token
soonest.

    predicted_ttft_i = (prefill backlog_i + this prompt) × prefill_s_per_token_i

* prefill backlog_i: prompt tokens of the requests we routed to endpoint i that have not
  produced their first token yet (`Endpoint.prefill_tokens`);
* prefill_s_per_token_i: learned per endpoint from observed first tokens — the time each took
  divided by the backlog it joined (`Endpoint.prefill_s_per_token`, an EWMA). It folds the GPU's
  prefill speed, chunked-prefill interference from running decodes and queueing into one
  number, so a mixed H100/A100 fleet sorts itself out without per-GPU configuration. Until an
  endpoint has been observed it takes the fastest observed value (or `prior_s_per_token`):
  optimistic, so it is tried and learned. With the median instead, one-at-a-time traffic on an
  idle fleet stayed on the first endpoint that looked fast and never learned the others (all
  twenty requests of a new user's curl loop went to one A100 while both H100s sat idle). A
  value learned more than `relearn_after_s` ago on an endpoint with nothing in prefill (long
  decodes may still run there) counts as unobserved again: one slow first token (a cold start) must not keep an endpoint idle
  forever, since only traffic can correct it.

Score = min_j(predicted_j) / predicted_i: the fastest endpoint scores 1.0 and one predicted
twice as slow 0.5 (proportional, unlike a min-max normalisation that would give it 0).

Parameters:
    prior_s_per_token (float > 0, default 5e-5): seconds per backlog token before anything was
        observed anywhere (≈ an A100 prefilling an 8B model).
    relearn_after_s (float > 0, default 10): forget an idle endpoint's value this old (seconds).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register

__all__ = ["TTFTEstimateScorer", "predicted_ttft_s"]


def predicted_ttft_s(
    endpoints: Sequence[Endpoint],
    prompt_tokens: int,
    prior_s_per_token: float,
    *,
    now: float | None = None,
    relearn_after_s: float = float("inf"),
) -> list[float]:
    """Predicted seconds to first token on each endpoint for a prompt of `prompt_tokens`
    (`now`: `time.monotonic()` seconds, to tell an idle endpoint's old value; see the module doc)."""
    learned = [_learned(ep, now, relearn_after_s) for ep in endpoints]
    known = [s for s in learned if s is not None]
    fill = min(known) if known else prior_s_per_token
    return [(ep.prefill_tokens + max(1, prompt_tokens)) * (fill if s is None else s) for ep, s in zip(endpoints, learned)]


def _learned(ep: Endpoint, now: float | None, relearn_after_s: float) -> float | None:
    value = ep.prefill_s_per_token
    if value is None or value <= 0:
        return None
    if now is not None and ep.prefill_inflight == 0 and ep.prefill_sampled_at is not None and now - ep.prefill_sampled_at > relearn_after_s:
        return None
    return value


@register("ttft-estimate-scorer")
class TTFTEstimateScorer(Plugin):
    class Params(Params):
        prior_s_per_token: float = Field(default=5e-5, gt=0)
        relearn_after_s: float = Field(default=10.0, gt=0)

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        p = self.params
        predicted = predicted_ttft_s(
            endpoints, ctx.request.prompt_tokens, p.prior_s_per_token, now=ctx.now, relearn_after_s=p.relearn_after_s
        )
        best = min(predicted)
        return [best / p if p > 0 else 1.0 for p in predicted]
