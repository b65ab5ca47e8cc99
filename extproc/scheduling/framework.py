"""The scheduling framework: filters drop endpoints, scorers rank them, a picker chooses.

Modelled on the Gateway API Inference Extension's endpoint picker. Plugins are synchronous and
free of I/O: they read snapshots (the datastore's endpoint state, computed once per request in
`SchedulingContext`). The profile runner — not the plugins — clamps scores to [0, 1], applies
weights, times each plugin and records an explanation of the decision.

Interfaces::

    Filter.filter(ctx, endpoints) -> endpoints            (a subset, order kept)
    Scorer.score(ctx, endpoints)  -> [score per endpoint]  (same order; clamped to [0, 1])
    Picker.pick(ctx, scored)      -> PickResult            (primary and fallbacks)
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from extproc.datastore.endpoints import Endpoint
from extproc.datastore.prefill_fit import PREFILL_ATTENTION_RATIO, request_prefill_work
from extproc.prefix.match import PrefixMatch
from extproc.types import LLMRequest

__all__ = [
    "Filter",
    "Scorer",
    "Picker",
    "SchedulingContext",
    "ScoredEndpoint",
    "PickResult",
    "WeightedScorer",
    "Profile",
    "ProfileResult",
    "min_max_inverted",
]


@dataclass(slots=True)
class SchedulingContext:
    """Everything plugins may read about the request being scheduled.

    Attributes:
        request: the parsed request (prompt tokens, max_tokens, n, ...).
        expected_output_tokens: max_tokens when given, else the model's estimate (tokens): what
            the KV cache is reserved for (`kv-fit-filter`).
        decode_output_tokens: the output length the decode-cost terms use (tokens):
            `min(max_tokens, the model's learned output-length quantile)`
            (`extproc.pipeline.output_estimate`); None: `expected_output_tokens`. Read it
            through `decode_tokens`.
        default_block_size: block size when an endpoint does not export its own (tokens).
        now: `time.monotonic()` at the start of the cycle (seconds).
        rng: randomness for tie-breaks.
        priority: the request's priority class (critical / standard / sheddable).
        stale_after_s: engine metrics older than this are stale (seconds).
        prefix: the prefix index's view of the request (blocks each endpoint holds), or None
            when prefix tracking is off or the prompt has no full block.
        session_endpoint: the endpoint the request's session was last routed to, or None.
        panic_threshold: below this share of healthy endpoints `healthy-filter` keeps every
            live one (0..1; `scheduling.health_check.panic_threshold`).
        attention_ratio: prefill attention per token pair relative to a token's linear cost
            (1/tokens; `scheduling.prefill_model.attention_ratio`), for `prefill_work`. Defaults to
            `PREFILL_ATTENTION_RATIO`, as the config does.
        lora_max_loras: GPU LoRA slots assumed for an engine that does not export its own
            (`scheduling.lora_max_loras`; count).
        data: per-cycle scratch space shared by plugins (e.g. predicted TTFT per endpoint).
    """

    request: LLMRequest
    expected_output_tokens: int
    default_block_size: int
    now: float
    rng: random.Random
    priority: str = "standard"
    stale_after_s: float = 2.0
    prefix: PrefixMatch | None = None
    session_endpoint: str | None = None
    panic_threshold: float = 0.5
    attention_ratio: float = PREFILL_ATTENTION_RATIO
    decode_output_tokens: int | None = None
    lora_max_loras: int = 1
    data: dict[str, object] = field(default_factory=dict)

    @property
    def decode_tokens(self) -> int:
        """Output tokens the request is expected to decode (tokens): `decode_output_tokens`
        when set, else `expected_output_tokens`. For decode-time estimates, never for KV."""
        return self.expected_output_tokens if self.decode_output_tokens is None else self.decode_output_tokens

    def uncached_tokens(self, ep: Endpoint) -> int:
        """The request's prefill work on `ep` (tokens): its prompt less the prefix believed
        cached there (at least 1)."""
        if self.prefix is None:
            return max(1, self.request.prompt_tokens)
        return self.prefix.uncached_tokens(ep.address)

    def prefill_work(self, ep: Endpoint) -> int:
        """The request's prefill work on `ep` in linear-token equivalents (tokens, ≥ 1): its
        uncached tokens, their attention over the cached prefix and each other included
        (`extproc.datastore.prefill_fit.request_prefill_work`, at `attention_ratio`)."""
        r = self.request
        return max(1, request_prefill_work(r.prompt_tokens, self.uncached_tokens(ep), self.attention_ratio, r.prompt_lengths))

    def block_size(self, ep: Endpoint) -> int:
        """The endpoint's KV block size (tokens): from its metrics, else the configured default."""
        engine = ep.engine
        if engine is not None and engine.block_size:
            return engine.block_size
        return self.default_block_size

    def is_stale(self, ep: Endpoint) -> bool:
        """True when the endpoint has been scraped but not within `stale_after_s` seconds."""
        age = ep.metrics_age(self.now)
        return age is not None and age > self.stale_after_s


@runtime_checkable
class Filter(Protocol):
    """Drops endpoints that must not take the request."""

    name: str

    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores each endpoint in [0, 1]; higher is better."""

    name: str

    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]: ...


@dataclass(slots=True)
class ScoredEndpoint:
    """An endpoint with its weighted total and each scorer's (clamped, unweighted) value."""

    endpoint: Endpoint
    total: float
    parts: dict[str, float]


@dataclass(slots=True)
class PickResult:
    """The chosen endpoint and the others in preference order."""

    primary: ScoredEndpoint
    fallbacks: list[ScoredEndpoint]


@runtime_checkable
class Picker(Protocol):
    """Chooses among scored endpoints."""

    name: str

    def pick(self, ctx: SchedulingContext, scored: Sequence[ScoredEndpoint]) -> PickResult: ...


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(slots=True)
class ProfileResult:
    """The outcome of one scheduling cycle.

    Attributes:
        pick: the decision, or None when every endpoint was filtered out.
        filtered_by: for each filter, how many endpoints it removed (count).
        rejected_by: the filter that removed the last candidates (when `pick` is None).
        timings_s: seconds spent per plugin name.
    """

    pick: PickResult | None
    filtered_by: dict[str, int]
    rejected_by: str | None
    timings_s: dict[str, float]

    def explain(self) -> str:
        """One line: every scorer's value for the chosen endpoint and the runner-up."""
        if self.pick is None:
            return f"rejected by {self.rejected_by}"

        def fmt(s: ScoredEndpoint) -> str:
            parts = " ".join(f"{k}={v:.3f}" for k, v in s.parts.items())
            return f"{s.endpoint.address} total={s.total:.3f} [{parts}]"

        out = f"chose {fmt(self.pick.primary)}"
        if self.pick.fallbacks:
            out += f"; runner-up {fmt(self.pick.fallbacks[0])}"
        return out


class Profile:
    """A named pipeline of filters, weighted scorers and a picker.

    Args:
        name: profile name (from config).
        filters: applied in order.
        scorers: weighted; the total is Σ weight × clamp(score, 0, 1), times the clamped value
            of every scorer marked `multiplies` (operator overrides).
        picker: chooses from the scored endpoints.
    """

    def __init__(self, name: str, filters: Sequence[Filter], scorers: Sequence[WeightedScorer], picker: Picker) -> None:
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker

    def score(self, ctx: SchedulingContext, candidates: Sequence[Endpoint], timings: dict[str, float] | None = None) -> list[ScoredEndpoint]:
        """Every candidate's weighted total and each scorer's clamped value (same order), with no
        filter and no pick (the cycle's scoring step; `/api/v1/weights` shows it for all
        endpoints). Seconds per scorer go into `timings` when given."""
        totals = [0.0] * len(candidates)
        factors = [1.0] * len(candidates)
        parts: list[dict[str, float]] = [{} for _ in candidates]
        clock = time.perf_counter
        for ws in self.scorers:
            scorer = ws.scorer
            name, weight = scorer.name, ws.weight
            t = clock()
            values = scorer.score(ctx, candidates)
            if timings is not None:
                timings[name] = clock() - t
            multiplies = getattr(scorer, "multiplies", False)
            for i, v in enumerate(values):
                v = 0.0 if v != v else 1.0 if v >= 1.0 else v if v > 0.0 else 0.0  # NaN → 0, then clamp to [0, 1]
                parts[i][name] = v
                if multiplies:
                    factors[i] *= v  # an operator override (weight-override-scorer): scales the total
                else:
                    totals[i] += weight * v
        return [ScoredEndpoint(ep, totals[i] * factors[i], parts[i]) for i, ep in enumerate(candidates)]

    def run(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> ProfileResult:
        """One scheduling cycle over `endpoints` (already restricted to the request's model)."""
        timings: dict[str, float] = {}
        filtered: dict[str, int] = {}
        candidates = list(endpoints)
        for f in self.filters:
            t = time.perf_counter()
            kept = f.filter(ctx, candidates)
            timings[f.name] = time.perf_counter() - t
            filtered[f.name] = len(candidates) - len(kept)
            if not kept:
                return ProfileResult(None, filtered, f.name, timings)
            candidates = kept
        scored = self.score(ctx, candidates, timings)
        t = time.perf_counter()
        pick = self.picker.pick(ctx, scored)
        timings[self.picker.name] = time.perf_counter() - t
        return ProfileResult(pick, filtered, None, timings)


def min_max_inverted(values: Sequence[float]) -> list[float]:
    """Lower is better, scaled to [0, 1] across the candidates: (max − v) / (max − min);
    all equal → 1.0 for everyone (no preference). The GIE queue and KV scorers' normalisation."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]
