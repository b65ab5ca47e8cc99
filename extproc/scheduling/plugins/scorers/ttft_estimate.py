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
  twenty requests of a new user's curl loop went to one A100 while both H100s sat idle).

Score = min_j(predicted_j) / predicted_i: the fastest endpoint scores 1.0 and one predicted
twice as slow 0.5 (proportional, unlike a min-max normalisation that would give it 0).

Parameters:
    prior_s_per_token (float > 0, default 5e-5): seconds per backlog token before anything was
        observed anywhere (≈ an A100 prefilling an 8B model).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register

__all__ = ["TTFTEstimateScorer", "predicted_ttft_s"]


def predicted_ttft_s(endpoints: Sequence[Endpoint], prompt_tokens: int, prior_s_per_token: float) -> list[float]:
    """Predicted seconds to first token on each endpoint for a prompt of `prompt_tokens`."""
    known = [ep.prefill_s_per_token for ep in endpoints if ep.prefill_s_per_token]
    fill = min(known) if known else prior_s_per_token
    return [(ep.prefill_tokens + max(1, prompt_tokens)) * (ep.prefill_s_per_token or fill) for ep in endpoints]


@register("ttft-estimate-scorer")
class TTFTEstimateScorer(Plugin):
    class Params(Params):
        prior_s_per_token: float = Field(default=5e-5, gt=0)

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        predicted = predicted_ttft_s(endpoints, ctx.request.prompt_tokens, self.params.prior_s_per_token)
        best = min(predicted)
        return [best / p if p > 0 else 1.0 for p in predicted]
