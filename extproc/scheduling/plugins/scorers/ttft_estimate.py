"""`ttft-estimate-scorer`: prefer the endpoint expected to produce this request's first token
soonest — the one cost in which prefix-cache affinity and queueing trade, in seconds.

    predicted_ttft_i = t0_i + s_i × (prefill backlog_i + uncached_i)

* prefill backlog_i: uncached prompt tokens of the requests we routed to endpoint i that have
  not produced their first token yet, less what the engine has probably computed of them since
  (`Endpoint.prefill_ahead`: at the endpoint's learned speed, oldest first), at pick time;
* uncached_i: this request's prompt less the prefix endpoint i is believed to hold
  (`SchedulingContext.prefix`, from the prefix index; the whole prompt without one). A warm
  endpoint wins exactly while the prefill it saves outweighs its longer queue, and loses by
  itself when its queue grows past that ("sticky until saturated", as llm-d's precise scheduler
  and Dynamo's cost function trade it) — no separate affinity weight to tune;
* t0_i, s_i: the endpoint's learned fit of TTFT against that work (`Endpoint.prefill_fit`, a
  robust ridge fit towards a prior with forgetting; `extproc.datastore.prefill_fit`). It folds
  the GPU's prefill speed, chunked-prefill interference from running decodes and queueing into
  two numbers, so a mixed H100/A100 fleet sorts itself out; a GPU label only sets where each
  endpoint's fit starts (its prior).

Until an endpoint has been observed it is predicted with the fastest observed fit (or the
prior): optimistic, so it is tried and learned. With the median instead, one-at-a-time traffic
on an idle fleet stayed on the first endpoint that looked fast and never learned the others. An
endpoint whose GPU label (`Endpoint.gpu`) names a GPU of `scheduling.prefill_model.prior_s_per_token_by_gpu` is
the exception: it is predicted with its own GPU's prefill speed (`PrefillPrior.known`). On a
mixed fleet the optimism sent the first cold 7k-token prompts to an idle A100, predicted as fast
as the H100 just observed (220 ms; it took 640; decision 0255). A
fit last sampled more than `relearn_after_s` ago on an endpoint with nothing in prefill counts
as unobserved again: one slow first token (a cold start) must not keep an endpoint idle forever.

The cost ranked is the request's own predicted TTFT plus the delay its prefill imposes on every
request routed there after it, `work_weight × s_i × uncached_i` (seconds): without it, a second
copy of a long prompt sent while the first is still in prefill ties between the warm endpoint
(behind the first copy, then almost nothing to compute) and a cold one (nothing ahead, all to
compute), and half the time the fleet prefills the prompt twice. With it the warm endpoint wins
until its backlog exceeds the cold one's by about (1 + work_weight) × the tokens it saves.

The decode side is in the same cost: every decode step on an endpoint reads the KV of every
sequence running there, `d` seconds per context token (vLLM's attention read; the calibration's
d = 44 ns/token for an H100 serving an 8B model, 72 ns for an A100, chosen per endpoint by its
GPU label, `Endpoint.gpu`: `DECODE_S_PER_CONTEXT_TOKEN_BY_GPU`), so this request's own decode
of `expected_output` tokens takes about `d × context_tokens_i × expected_output` seconds longer
there than on an idle endpoint (`Endpoint.context_tokens`: full prompts plus half the expected
outputs of what is in flight). Weighted by `decode_weight`, this keeps long streams spread (one
engine dying must not take most of the fleet's streams with it) and stops a burst of identical
prompts piling onto the endpoint that holds their prefix once its decode batch costs more than a
cold prefill elsewhere.

A decode step also has a floor, reading the weights once (the calibration's `a`: H100 6.4 ms,
A100 10.5 ms for an 8B model; `DECODE_STEP_S_BY_GPU`), paid by every request whatever the
batch: `decode_weight × expected_output × step_i` adds it, so that a busy H100 is not priced as
if moving a long decode to an idle A100 saved the whole of the H100's context read. Without it
the decode term counted about twice what the move really saves (6.7 against 3.3 ms a step in
the near-ties traced in decision 0255). On a fleet of one GPU type it is the same everywhere
and says nothing (only differences of cost count).

The decode side runs both ways: the request's prefill also stalls every sequence decoding on
the endpoint (with chunked prefill each prefill step is a step of the running decodes too), by
about its own prefill time each, `decode_weight × decode_inflight_i × s_i × uncached_i`
(seconds of other requests' decode, weighed like the request's own). A cold 7k-token prefill on
an A100 running 20 decodes stalls them ~0.5 s each; a warm one, for the few uncached tokens,
almost not at all. Without this term the decode-context term alone moved shared-system-prompt
requests off the engine holding their system prompt whenever its batch was longer, and the
fleet prefilled the prompt again (decision 0240).

Score = P / (P + cost_i − min_j cost_j), with P = min_j (the first two terms plus the work
term), the request's best prefill cost: the cheapest endpoint scores 1.0 and one costing P more
0.5 (`cost_scores`). With no decode load this is min_j(cost_j) / cost_i. The earlier ratio of
whole costs let decode load present on every engine squeeze every score towards 1: on the
shared-system-prompt benchmark, with ~150k tokens decoding on each engine, a warm endpoint 0.3 s
cheaper than a cold A100 (0.08 s predicted TTFT against 0.56 s) scored 1.0 against 0.73, under
three points at weight 10, and the count balancers' three points for the idler A100 sent the
request there to prefill the 6k-token system prompt again (7-12 such duplicates in 120 requests;
decision 0180). Scored on differences, seconds of decode and seconds of prefill weigh the same.
Each endpoint's predicted TTFT is kept in `ctx.data["predicted_ttft_s"]` for the route-debug
header.

`expected_output` in the decode terms is `SchedulingContext.decode_tokens`: the request's
`max_tokens` capped by the model's learned output length (a high quantile of its recent
completed outputs, `extproc.pipeline.output_estimate`), not `max_tokens` itself, which clients
often set far above what they get (32768 for a 300-token answer made the step floor alone
price an idle A100 34 s dearer than an H100 at the default weight, 0.25 × 32768 × 4.1 ms,
and piled requests onto the H100s whatever their queues; decision 0275).

Parameters:
    relearn_after_s (float > 0, default 10): forget an idle endpoint's fit this old (seconds).
    work_weight (finite float ≥ 0, default 1): weight of the delay imposed on later requests.
    decode_s_per_context_token (finite float ≥ 0, default 4.4e-8): `d` above (seconds per context
        token per decode step) for an endpoint whose GPU is not in the table below.
    decode_s_per_context_token_by_gpu (dict GPU name → float ≥ 0, default
        `DECODE_S_PER_CONTEXT_TOKEN_BY_GPU`: h100 44, h200 31, a100 72 ns): `d` per GPU, the
        name matched case-insensitively as a word of the endpoint's GPU label (`Endpoint.gpu`,
        the label `scheduling.prefill_model.gpu_label` names; the longest match wins), so
        "a100" finds "NVIDIA-A100-SXM4-80GB" (the form of GPU feature discovery's
        `nvidia.com/gpu.product` node label); the label comes from the endpoint's
        config or its discovery template (`labels`). One `d` for every GPU charged an H100
        decoding 1.5× an A100's context as the slower decode, and sent requests to the A100
        without their cached system prompt (decision 0240). Scale the table for other models
        (d is proportional to KV bytes per token).
    decode_step_s (finite float ≥ 0, default 6.4e-3): a decode step's floor (seconds) for an endpoint
        whose GPU is not in the table below.
    decode_step_s_by_gpu (dict GPU name → float ≥ 0, default `DECODE_STEP_S_BY_GPU`: h100
        6.4, h200 4.5, a100 10.5 ms): the floor per GPU, matched like `d`'s table.
    gpu_label: moved to `scheduling.prefill_model.gpu_label`, the one setting naming the GPU
        label for every per-GPU table (`Endpoint.gpu`); set here it is a configuration error
        saying so.
    decode_weight (finite float ≥ 0, default 0.25): weight of the decode terms (0: TTFT alone). At 1
        (a request's whole decode slowdown against its TTFT) the term outweighed every prefix
        saving on the shared-system-prompt benchmark (hit rate 53 % of 73 % possible); at 0 a
        burst of identical prompts piles onto one engine; 0.25 kept 90 % of the oracle hit rate
        there with the burst spread (docs/benchmarks.md, "Prefix-cache-aware routing").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from extproc.datastore.endpoints import Endpoint
from extproc.datastore.prefill_fit import PrefillFit, gpu_table, gpu_value
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register

__all__ = ["DECODE_STEP_S_BY_GPU", "DECODE_S_PER_CONTEXT_TOKEN_BY_GPU", "TTFTEstimateScorer", "cost_scores", "effective_fits", "predicted_ttft_s"]

DECODE_S_PER_CONTEXT_TOKEN_BY_GPU: dict[str, float] = {"h100": 4.4e-8, "h200": 3.1e-8, "a100": 7.2e-8}
"""`d` per GPU for an 8B model with 16-bit KV (seconds per context token per decode step): KV bytes
per token over the GPU's effective HBM bandwidth. H100 43.7 ns measured (vLLM's FP8-KV blog, ITL
against input length at batch 1); A100 ×3.35/2.04 TB/s = 72 ns, H200 ×3.35/4.8 = 31 ns, both
scaled by HBM bandwidth (docs/simulator.md, the simulator's profiles). Keys are
matched as words of the endpoint's GPU label."""


DECODE_STEP_S_BY_GPU: dict[str, float] = {"h100": 6.4e-3, "h200": 4.5e-3, "a100": 10.5e-3}
"""A decode step's floor per GPU for an 8B model (seconds): the weights read once per step. H100
6.4 ms and A100 10.5 ms are the calibration's `a` (docs/simulator.md, `extproc.sim.profiles`);
H200 is the H100's scaled by HBM bandwidth (3.35/4.8 TB/s). Scale for other models (the floor
is proportional to weight bytes per GPU)."""


def effective_fits(endpoints: Sequence[Endpoint], work_tokens: Sequence[int], *, now: float | None = None, relearn_after_s: float = float("inf")) -> list[PrefillFit]:
    """The fit each endpoint is predicted with: its own once observed (and not forgotten), else
    its prior when that is its GPU's own figure (`PrefillPrior.known`), else the observed fit
    fastest for its work (`work_tokens`, own prefill tokens per endpoint), else the prior."""
    learned = [_learned(ep, now, relearn_after_s) for ep in endpoints]
    known = [f for f in learned if f is not None]
    out: list[PrefillFit] = []
    for ep, fit, own in zip(endpoints, learned, work_tokens):
        if fit is None and ep.prefill_fit.prior.known:
            fit = PrefillFit(ep.prefill_fit.prior)  # its GPU's own figure, not another GPU's fit
        elif fit is None:
            x = _ahead(ep, now) + max(1, own)
            fit = min(known, key=lambda f: f.predict(x)) if known else ep.prefill_fit
        out.append(fit)
    return out


def predicted_ttft_s(
    endpoints: Sequence[Endpoint],
    work_tokens: Sequence[int],
    *,
    now: float | None = None,
    relearn_after_s: float = float("inf"),
) -> list[float]:
    """Predicted seconds to first token on each endpoint.

    Args:
        endpoints: the candidates.
        work_tokens: the request's own prefill work on each endpoint (tokens, same order:
            uncached prompt tokens).
        now: `time.monotonic()` (seconds), to tell an idle endpoint's old fit and how much of
            its prefill backlog is done (None: none of it).
        relearn_after_s: a fit older than this on an idle endpoint counts as unobserved (seconds).
    """
    fits = effective_fits(endpoints, work_tokens, now=now, relearn_after_s=relearn_after_s)
    return [fit.predict(_ahead(ep, now) + max(1, own)) for ep, fit, own in zip(endpoints, fits, work_tokens)]


def _ahead(ep: Endpoint, now: float | None) -> float:
    """Prefill work ahead on `ep` (tokens): at `now` (monotonic seconds), less what it has
    probably computed already; without `now`, all of it."""
    return ep.prefill_tokens if now is None else ep.prefill_ahead(now)


def _learned(ep: Endpoint, now: float | None, relearn_after_s: float) -> PrefillFit | None:
    fit = ep.prefill_fit
    if not fit.samples:
        return None
    if now is not None and ep.prefill_inflight == 0 and fit.sampled_at is not None and now - fit.sampled_at > relearn_after_s:
        return None
    return fit


@register("ttft-estimate-scorer")
class TTFTEstimateScorer(Plugin):
    class Params(Params):
        relearn_after_s: float = Field(default=10.0, gt=0)
        # Every term of the cost is finite, like the GPU tables' entries: an infinite weight or
        # figure made every candidate's cost inf, inf − inf a NaN score, and the scorer (and the
        # picker's lead) silently nothing.
        work_weight: float = Field(default=1.0, ge=0, allow_inf_nan=False)
        decode_s_per_context_token: float = Field(default=4.4e-8, ge=0, allow_inf_nan=False)
        decode_s_per_context_token_by_gpu: dict[str, float] = Field(default_factory=lambda: dict(DECODE_S_PER_CONTEXT_TOKEN_BY_GPU))
        decode_step_s: float = Field(default=6.4e-3, ge=0, allow_inf_nan=False)
        decode_step_s_by_gpu: dict[str, float] = Field(default_factory=lambda: dict(DECODE_STEP_S_BY_GPU))
        gpu_label: str | None = None
        decode_weight: float = Field(default=0.25, ge=0, allow_inf_nan=False)

        @field_validator("decode_s_per_context_token_by_gpu", "decode_step_s_by_gpu", mode="before")  # strict: no True, no "3e-5"
        @classmethod
        def _non_negative(cls, v: Any, info: ValidationInfo) -> dict[str, float]:
            what = "decode step seconds" if info.field_name == "decode_step_s_by_gpu" else "decode seconds per context token"
            return gpu_table(v, what, allow_zero=True)

        @field_validator("gpu_label")
        @classmethod
        def _moved(cls, v: str | None) -> None:
            if v is not None:
                raise ValueError(
                    "the scorer no longer has its own GPU label: set scheduling.prefill_model.gpu_label "
                    f"(to {v!r}), which names the GPU label for every per-GPU table"
                )
            return None

    def __init__(self, params: Params, *, name: str) -> None:
        super().__init__(params, name=name)
        self._decode_by_label: dict[str, tuple[float, float]] = {}

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        work = [ctx.prefill_work(ep) for ep in endpoints]
        fits = effective_fits(endpoints, work, now=ctx.now, relearn_after_s=self.params.relearn_after_s)
        predicted = [f.predict(ep.prefill_ahead(ctx.now) + max(1, w)) for ep, f, w in zip(endpoints, fits, work)]
        ctx.data["predicted_ttft_s"] = {ep.address: p for ep, p in zip(endpoints, predicted)}
        p = self.params
        # Decode terms' output count: max_tokens capped by the model's learned output length
        # (`SchedulingContext.decode_tokens`, decision 0275), not the KV reservation's max_tokens.
        per_step = p.decode_weight * ctx.decode_tokens
        prefill = [t + p.work_weight * f.s_per_token * w for f, t, w in zip(fits, predicted, work)]
        cost = []
        for c, ep, f, w in zip(prefill, endpoints, fits, work):
            d, step = self.decode_model(ep)
            cost.append(c + per_step * (step + d * ep.context_tokens) + p.decode_weight * ep.decode_inflight * f.s_per_token * w)
        return cost_scores(prefill, cost)

    def decode_model(self, ep: Endpoint) -> tuple[float, float]:
        """`(d, step floor)` for the endpoint's GPU (seconds per context token per decode step,
        seconds per decode step): each from its `_by_gpu` table by the endpoint's GPU label
        (`Endpoint.gpu`; the longest whole-word name), else the plain setting."""
        label = ep.gpu
        model = self._decode_by_label.get(label)
        if model is None:  # looked up once per label value, not per candidate and request
            p = self.params
            d = gpu_value(label, p.decode_s_per_context_token_by_gpu)
            step = gpu_value(label, p.decode_step_s_by_gpu)
            model = (p.decode_s_per_context_token if d is None else d, p.decode_step_s if step is None else step)
            if len(self._decode_by_label) < 1024:  # label values are few; bounded against churn
                self._decode_by_label[label] = model
        return model


def cost_scores(prefill_s: Sequence[float], cost_s: Sequence[float]) -> list[float]:
    """Scores in [0, 1] from each endpoint's cost (seconds, same order as `prefill_s`).

    `scale / (scale + cost_i − min cost)`, with `scale` the least prefill cost (`prefill_s`:
    predicted TTFT plus the delay imposed on later requests, seconds): the cheapest endpoint
    scores 1.0, one costing `scale` seconds more 0.5. Only differences of cost count, so a
    decode slowdown every endpoint would charge says nothing, and a second of decode weighs what
    a second of prefill does. Without decode terms (`cost_s == prefill_s`) this is
    `min cost / cost_i`. An empty list gives an empty list.
    """
    if not cost_s:
        return []
    best = min(cost_s)
    scale = min(prefill_s)
    if scale <= 0:
        return [1.0 if c <= best else 0.0 for c in cost_s]
    return [scale / (scale + (c - best)) for c in cost_s]
