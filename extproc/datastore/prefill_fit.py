"""A per-endpoint fit of time to first token against the prefill work ahead of a request:

    TTFT ≈ t0 + s · x        x = uncached prompt tokens in prefill on the endpoint when the
                                 request was routed, its own uncached tokens included (tokens)

`t0` (seconds) is what every request pays whatever its size (a scheduler step, sampling, the
first detokenisation, the HTTP hops); `s` (seconds per token) is the prefill speed, with the
queueing and chunked-prefill interference of running decodes folded in. A ratio model
(TTFT / x, the previous estimator) reads a 20-token prompt's fixed cost as a slow GPU: identical
simulators learned 0.17–0.59 ms/token that way and one of four identical engines drew 14 of 20
long streams. With an intercept, short prompts inform `t0` and long ones `s`.

The fit is ridge regression towards a prior (`t0_prior`, `s_prior`) with exponential
forgetting: it minimises

    Σ_i γ^(n−i) w_i (y_i − t0 − s·x_i)²  +  k · (t0 − t0_prior)²  +  k · x_ref² · (s − s_prior)²

— the prior counts as `k` samples at `x_ref` tokens, so one sample moves the fit only part way
and a fleet of short prompts never drives `s` to noise. `γ` (`forget`) keeps ~1/(1−γ) recent
samples. Robustness: a sample whose residual exceeds the prediction itself (|y − ŷ| > ŷ) is
down-weighted to w = ŷ / |y − ŷ| (a Huber-style weight), so one request stuck behind a
preemption does not rewrite the endpoint's speed.

Closed form: the 2×2 normal equations (solved directly; O(1) per sample).

Samples older than `FRESH_GAP_S` no longer weigh: the next sample after such a gap starts the
fit over from its prior. Forgetting is per sample, so an endpoint nobody routed to kept its last
few samples (a slow cold start) at full weight for good; the picker's exploration
(`max-score-picker`'s `explore_share`) sends it a few requests while it has fewer than
`explore_min_samples` (default 20) fresh samples (`fresh_samples`), and those re-measure it from
the prior (decision 0295).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PREFILL_ATTENTION_RATIO", "PREFILL_S_PER_TOKEN_BY_GPU", "PrefillCounts", "PrefillFit", "PrefillPrior", "ROBUST_AFTER", "gpu_table", "gpu_value",
    "prefill_work", "request_prefill_work",
]  # fmt: skip

ROBUST_AFTER = 5
"""Samples before outliers are down-weighted (count)."""

FRESH_GAP_S = 60.0
"""A fit whose newest sample is older than this (seconds) has no fresh samples, and its next
sample starts it over from its prior (decision 0295)."""


PREFILL_S_PER_TOKEN_BY_GPU: dict[str, float] = {"h100": 2.35e-5, "h200": 2.35e-5, "a100": 6.73e-5}
"""Prefill seconds per token of an 8B model by GPU (the prior `s` of an endpoint whose GPU label
names one): the calibration's H100 fit (23.4 µs/token, docs/simulator.md; the simulator's
`b`), the A100 scaled by its lower tensor throughput (67.3 µs/token, the simulator's A100
profile), the H200 as the H100 (same compute; prefill is compute-bound). Keys are matched as
words of the GPU label (`gpu_value`)."""


PREFILL_ATTENTION_RATIO = 2.0e-5
"""Prefill attention's cost per pair of tokens, relative to one token's linear (weights) cost
(1/tokens), for an 8B model: the simulator's calibrated step model charges `b` per batched token
and `q · m · (2p + m)` for a chunk of m new tokens after p already in the KV cache, and q/b is
1.97e-5 on the H100 (0.453 ns / 23 µs) and 2.12e-5 on the A100 (1.4 ns / 66 µs): both scale with
the GPU's compute, so one ratio serves every GPU (docs/simulator.md, `extproc.sim.profiles`).
Proportional to the model's attention width × layers over its parameter count; scale it for
other models."""


def prefill_work(uncached: int, cached: int = 0, attention_ratio: float = PREFILL_ATTENTION_RATIO) -> int:
    """A prefill's work in linear-token equivalents (tokens): `uncached` new tokens after
    `cached` ones already in the KV cache cost `uncached + ratio · uncached · (2·cached +
    uncached)`, the attention of each new token over everything before it counted at
    `attention_ratio` (`PREFILL_ATTENTION_RATIO`) of a token's linear cost. The TTFT fit
    (`PrefillFit`) is linear in this work: in prompt tokens alone it read a 41k-token prompt
    as 41k tokens of work when the engine spends about 75k tokens' worth on it (attention
    grows with the square of the length), predicted it on an A100 at 2.8 s and it took 5.6
    (Mooncake conversation; decision 0265). At 1k tokens the attention adds 2 %, at 8k 16 %.
    Negative inputs count as 0."""
    m = max(0, uncached)
    return m + round(attention_ratio * m * (2 * max(0, cached) + m))


def request_prefill_work(prompt_tokens: int, uncached: int, attention_ratio: float, prompt_lengths: tuple[int, ...] = ()) -> int:
    """A request's prefill work on an endpoint (linear-token equivalents): `prefill_work` of its
    `uncached` tokens after the `prompt_tokens − uncached` cached. A batched completion
    (`prompt_lengths`, each prompt's tokens, more than one) attends within each prompt, not
    across them: charged on the square of the sum, 100 prompts of 1,000 tokens were 300k of
    work instead of 102k. Its cached tokens come off linearly."""
    if len(prompt_lengths) > 1:
        per_prompt = sum(prefill_work(p, 0, attention_ratio) for p in prompt_lengths)
        return max(0, per_prompt - max(0, prompt_tokens - uncached))
    return prefill_work(uncached, prompt_tokens - uncached, attention_ratio)


@dataclass(frozen=True, slots=True)
class PrefillCounts:
    """The token counts behind a request's prefill work on one endpoint, before any attention
    ratio is applied: what another replica needs to count the same work at its own ratio
    (`extproc.replicas.sync`; replicas mid-way through a rolling change of
    `scheduling.prefill_model.attention_ratio` otherwise mixed units).

    Args:
        prompt_tokens: the whole prompt (tokens; all prompts of a batched completion).
        uncached: the tokens not believed cached on the endpoint (tokens, 0..prompt_tokens).
        prompt_lengths: each prompt's tokens of a batched completion (`()` for one prompt).
    """

    prompt_tokens: int
    uncached: int
    prompt_lengths: tuple[int, ...] = ()

    def work(self, attention_ratio: float) -> int:
        """The prefill work at `attention_ratio` (linear-token equivalents; `request_prefill_work`)."""
        return request_prefill_work(self.prompt_tokens, self.uncached, attention_ratio, self.prompt_lengths)


def gpu_value(label: str, table: dict[str, float]) -> float | None:
    """The entry of `table` (lower-case GPU names) that `label` names, case-insensitive, as a
    whole word between non-alphanumerics ("a100" in "NVIDIA-A100-SXM4-80GB", not in "NVIDIA RTX
    A1000" or "GA100"), the longest such name winning; None when none does."""
    low = label.lower()
    names = [n for n in table if re.search(rf"(?<![a-z0-9]){re.escape(n)}(?![a-z0-9])", low)] if label else []
    return table[max(names, key=len)] if names else None


def gpu_table(table: Any, what: str, *, allow_zero: bool = False) -> dict[str, float]:
    """A GPU-name → figure table from configuration, keys lower-cased and stripped, figures as
    floats. Strict about types, so it serves as a pydantic `mode="before"` validator: a figure
    is an int or a float, never a bool (YAML's `yes`) or a string (`"3e-5"`), which pydantic
    would coerce to 1.0 or a number.

    Raises:
        ValueError: not a mapping, a name that is not a string or is empty, two names equal once
            lower-cased, or a figure that is not a finite number > 0 (≥ 0 with `allow_zero`);
            `what` names the figure in the message.
    """
    if not isinstance(table, Mapping):
        raise ValueError(f"must be a mapping of GPU name → {what}, got {type(table).__name__}")
    out: dict[str, float] = {}
    bound = ">=" if allow_zero else ">"
    for key, value in table.items():
        if not isinstance(key, str):
            raise ValueError(f"GPU names must be strings, got {key!r}")
        name = key.strip().lower()
        if not name:
            raise ValueError(f"GPU names must be non-empty, got {key!r}")
        if name in out:
            raise ValueError(f"GPU name {key!r} is listed twice (names are case-insensitive)")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{what} for {key!r} must be a number {bound} 0, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"{what} for {key!r} must be a finite number {bound} 0, got {value!r}")
        out[name] = float(value)
    return out


@dataclass(frozen=True, slots=True)
class PrefillPrior:
    """The fit's prior and forgetting.

    Attributes:
        t0_s: fixed time to first token (seconds). Default 0.02 s: a vLLM step plus the HTTP
            hops of a short prompt on an idle engine (the simulator's H100/A100 profiles give
            12–25 ms; docs/simulator.md).
        s_per_token: prefill seconds per token. Default 5e-5 s (an A100 prefilling an 8B
            model at ~20k tokens/s; the simulator's profiles give b ≈ 23–67 µs/token, docs/simulator.md).
        weight: how many samples the prior counts as (samples).
        x_ref: the prompt size at which the slope prior weighs `weight` samples (tokens).
        forget: per-sample decay of older samples, 0 < forget ≤ 1 (0.95 ≈ the last 20 samples).
        known: `s_per_token` is the endpoint's own GPU's figure (`PREFILL_S_PER_TOKEN_BY_GPU`):
            until observed the endpoint is predicted with this prior, not with the fastest fit
            observed elsewhere (`extproc.scheduling.plugins.scorers.ttft_estimate.effective_fits`).
    """

    t0_s: float = 0.02
    s_per_token: float = 5e-5
    weight: float = 1.0
    x_ref: float = 2048.0
    forget: float = 0.95
    known: bool = False


class PrefillFit:
    """Online ridge fit of TTFT = t0 + s·x for one endpoint (see the module doc).

    Args:
        prior: the prior and forgetting.
    """

    __slots__ = ("prior", "_w", "_sx", "_sy", "_sxx", "_sxy", "samples", "sampled_at", "t0_s", "s_per_token", "_fresh")

    def __init__(self, prior: PrefillPrior | None = None) -> None:
        self.prior = prior or PrefillPrior()
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self.samples = 0
        """Samples ever added (count)."""
        self.sampled_at: float | None = None
        """`time.monotonic()` of the latest sample (seconds), None before any."""
        self.t0_s = self.prior.t0_s
        """Fitted fixed time (seconds, ≥ 0)."""
        self.s_per_token = self.prior.s_per_token
        """Fitted prefill seconds per token (> 0)."""
        self._fresh = 0

    def fresh_samples(self, now: float) -> int:
        """Samples since the fit last started over (count), 0 once its newest is older than
        `FRESH_GAP_S` at `now` (monotonic seconds)."""
        if self.sampled_at is None or now - self.sampled_at > FRESH_GAP_S:
            return 0
        return self._fresh

    def predict(self, x_tokens: float) -> float:
        """Predicted time to first token (seconds) with `x_tokens` of prefill ahead, own included."""
        return self.t0_s + self.s_per_token * max(0.0, x_tokens)

    def add(self, x_tokens: float, ttft_s: float, now: float) -> None:
        """Add one observation: `ttft_s` seconds to first token with `x_tokens` of prefill work
        ahead when routed (tokens), observed at `now` (monotonic seconds). Non-positive or
        non-finite values are ignored."""
        if not (ttft_s > 0 and x_tokens >= 0) or ttft_s == float("inf") or x_tokens == float("inf"):
            return
        if self.sampled_at is not None and now - self.sampled_at > FRESH_GAP_S:
            # Its samples are stale: start over from the prior (robust weights included).
            self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
            self._fresh = 0
            self.t0_s, self.s_per_token = self.prior.t0_s, self.prior.s_per_token
        predicted = self.predict(x_tokens)
        resid = abs(ttft_s - predicted)
        w = 1.0 if self._fresh < ROBUST_AFTER or resid <= 3 * predicted else 3 * predicted / resid
        g = self.prior.forget
        self._w = g * self._w + w
        self._sx = g * self._sx + w * x_tokens
        self._sy = g * self._sy + w * ttft_s
        self._sxx = g * self._sxx + w * x_tokens * x_tokens
        self._sxy = g * self._sxy + w * x_tokens * ttft_s
        self.samples += 1
        self._fresh += 1
        self.sampled_at = now
        self._solve()

    def _solve(self) -> None:
        p = self.prior
        k = p.weight
        ks = k * p.x_ref * p.x_ref
        a11 = self._w + k
        a12 = self._sx
        a22 = self._sxx + ks
        b1 = self._sy + k * p.t0_s
        b2 = self._sxy + ks * p.s_per_token
        det = a11 * a22 - a12 * a12
        if det <= 0:
            return
        t0 = (b1 * a22 - a12 * b2) / det
        s = (a11 * b2 - a12 * b1) / det
        floor_s = p.s_per_token * 1e-3
        if t0 < 0:  # refit the slope alone with t0 = 0
            t0 = 0.0
            s = b2 / a22
        self.t0_s = t0
        self.s_per_token = max(s, floor_s)
