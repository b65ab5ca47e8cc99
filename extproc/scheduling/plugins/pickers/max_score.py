"""`max-score-picker`: the highest total wins; ties (within `tie_epsilon`) are broken uniformly
at random so equal endpoints share a burst instead of the first one taking it all.

With `lead_scorer` set (the default profile sets `ttft-estimate-scorer`), a request whose prefix
some candidate holds is first restricted to the candidates that scorer rates at least
`lead_min_score` — for the TTFT cost, whose score is `P / (P + cost_i − min cost)`, those
costing at most `(1 / lead_min_score − 1) × P` seconds more than the cheapest (P: the request's
best prefill cost), a quarter of it at the default 0.8 — and the highest total among them wins.
The count balancers (in-flight, queue, KV, FLOPs, ...) still choose among near-equal endpoints,
but can no longer send a request away from the engine holding its prefix when the cost says the
warm engine is clearly the faster choice: on the shared-system-prompt benchmark their 6.5 points
for an idler A100 overturned cost leads of 40-300 ms and the fleet prefilled a 6k-token system
prompt again (decisions 0180, 0240). This is sglang-router's `cache_aware` shape (affinity
holds unless the load is clearly unbalanced) with "clearly" measured by the cost in seconds,
which already counts the warm engine's queue and decode batch, so affinity still breaks by
itself once the warm engine is saturated. Requests no candidate holds a prefix of (no shared
prefix, or shorter than `prefix.min_match_tokens`) are picked on the total alone, unless
`lead_min_score_unmatched` is set: then the same restriction applies with that (lower) floor.
At 0.5 (the default profile's) a prefix-free request may not go to an endpoint costing more
than one whole prefill cost `P` above the cheapest: the balancers still spread short prompts,
whose costs differ by tens of milliseconds, but can no longer send a cold 7k-token prompt to an
A100 predicted at 0.7 s while an H100 is predicted at 0.2 s (a shared-system request traced in
decision 0255; decision 0265 measured the rule: with the cost's decode step floor such votes
became rare, and the remaining slow cold prefills there are the cost's own choice). Every
candidate stays in the fallbacks, by total. At 0.8 on prefix-free requests too (decision
0270, opt-in) the Mooncake synthetic trace's p99 TTFT fell from 3.5 to 2.5 s, but on short
prompts a quarter of `P` is a few milliseconds: one endpoint whose first few first tokens were
slowed by the host (22 ms predicted against 13) was kept out for good and never learned again.

Exploration (decision 0295): an endpoint nobody routes to is never measured again, so a
pessimistic fit (a few slow first tokens while the host was busy) or a cold prefix cache kept a
re-added endpoint identical to the others at 0 of ~11,000 requests over 55 s. With probability
`explore_share`, a pick goes instead to a random candidate whose TTFT fit has fewer than
`explore_min_samples` fresh samples (`PrefillFit.fresh_samples`: those since the fit last
started over, none once its newest is more than a minute old),
while some other candidate is learned; once it has them it competes on its fit like the rest.
Only candidates are explored: the filters already removed unhealthy, ejected and KV-full
endpoints, and one an operator override zeroes (total 0) is never explored.

Parameters:
    tie_epsilon (float ≥ 0, default 1e-9): totals this close count as equal.
    explore_share (float in [0, 0.05], default 0.01): the share of picks that may explore (0:
        never). Bounded: each explored request may pay a cold prefill or a slower endpoint.
    explore_min_samples (int in [1, 100], default 20): fresh samples an endpoint's fit needs to
        stop being explored: the fit's memory (`PrefillPrior.forget` 0.95 keeps ~20 samples),
        so the samples that made it pessimistic have faded by then (at 8, three slow ones of
        eight still held a 13 ms endpoint at 17 ms, under a 0.8 floor).
    lead_scorer (str, default ""): the scorer (by name) whose clear lead the others may not
        overturn on prefix-matched requests; "" for none. A configured picker's must name one
        of its profile's scorers (`extproc.config.schema`); a lead scorer the candidates were
        not scored by (load-aware's scorers replaced, its picker kept) restricts nothing.
    lead_min_score (float in (0, 1], default 0.8): the least `lead_scorer` value a candidate
        needs to stay in the running on such a request. Set without `lead_scorer` (this one or
        the next), it is an error: it would do nothing.
    lead_min_score_unmatched (float in (0, 1] or None, default None): the same floor for a
        request no candidate holds a prefix of; None leaves those to the total alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, model_validator

from extproc.scheduling.framework import PickResult, SchedulingContext, ScoredEndpoint
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


@register("max-score-picker")
class MaxScorePicker(Plugin):
    class Params(Params):
        tie_epsilon: float = Field(default=1e-9, ge=0)
        lead_scorer: str = ""
        lead_min_score: float = Field(default=0.8, gt=0, le=1)
        lead_min_score_unmatched: float | None = Field(default=None, gt=0, le=1)
        explore_share: float = Field(default=0.01, ge=0, le=0.05)
        explore_min_samples: int = Field(default=20, ge=1, le=100)

        @model_validator(mode="after")
        def _floors_need_a_lead(self) -> MaxScorePicker.Params:
            floors = sorted(f for f in {"lead_min_score", "lead_min_score_unmatched"} & self.model_fields_set if getattr(self, f) is not None)
            if floors and not self.lead_scorer:
                verb = "need" if len(floors) > 1 else "needs"
                raise ValueError(
                    f"{' and '.join(floors)} {verb} lead_scorer (the scorer whose value it bounds); without it nothing is bounded "
                    "(a picker given for a built-in profile replaces the built-in's whole: load-aware's is "
                    "lead_scorer: ttft-estimate-scorer)"
                )
            return self

    def pick(self, ctx: SchedulingContext, scored: Sequence[ScoredEndpoint]) -> PickResult:
        if not scored:
            raise ValueError("no candidates")
        order = sorted(scored, key=lambda s: s.total, reverse=True)
        running = self._in_the_running(ctx, order)
        best = running[0].total
        ties = [s for s in running if best - s.total <= self.params.tie_epsilon]
        chosen = ties[0] if len(ties) == 1 else ctx.rng.choice(ties)
        explored = self._explore(ctx, order)
        if explored is not None:
            chosen = explored
        return PickResult(chosen, [s for s in order if s is not chosen])

    def _explore(self, ctx: SchedulingContext, order: list[ScoredEndpoint]) -> ScoredEndpoint | None:
        """A candidate to learn instead of the best, with probability `explore_share`: one whose
        fit has fewer than `explore_min_samples` fresh samples, while another's has them (when
        none is learned the picks learn them all anyway). None: no exploration this time. The
        random draw is made only when there is someone to explore (the usual pick draws nothing)."""
        p = self.params
        if p.explore_share <= 0 or len(order) < 2:
            return None
        learning = [s for s in order if s.total > 0 and s.endpoint.prefill_fit.fresh_samples(ctx.now) < p.explore_min_samples]
        if not learning or len(learning) == len(order) or ctx.rng.random() >= p.explore_share:
            return None
        chosen = ctx.rng.choice(learning)
        ctx.data["explored"] = chosen.endpoint.address
        return chosen

    def _in_the_running(self, ctx: SchedulingContext, order: list[ScoredEndpoint]) -> list[ScoredEndpoint]:
        """The candidates the primary is chosen from (by total, best first): those `lead_scorer`
        rates at least `lead_min_score` on a prefix-matched request, at least
        `lead_min_score_unmatched` on another one, or all of them (no lead scorer, or no floor
        for an unmatched request). Never none: an endpoint an operator override zeroes does not
        count for its lead, and if nothing is left every candidate is."""
        p = self.params
        name = p.lead_scorer
        if not name:
            return order
        prefix = ctx.prefix
        matched = prefix is not None and any(prefix.cached_tokens(s.endpoint.address) > 0 for s in order)
        floor = p.lead_min_score if matched else p.lead_min_score_unmatched
        if floor is None:
            return order
        kept = [s for s in order if s.parts.get(name, 1.0) >= floor and s.total > 0]
        return kept or order
