"""The default synthetic workload: no files needed, long-tailed prompts, shared prefixes.

Prompt lengths follow the design notes' production sample (DESIGN section 9 item 5, from the
seed's 12,847 sampled API requests): 68 % ≤ 512 tokens, P90 2,048, P99 8,192, P99.9 24,576,
max 32,768. We fit a piecewise log-uniform distribution through those quantiles (log length is
linear in the quantile between knots, i.e. a power-law density ∝ 1/x on each piece). The notes
give nothing below 512, so two knots there are ours: minimum 16 tokens and P30 128 tokens (a
short chat turn), which puts the median near 300 tokens, between BurstGPT's and Azure conv's.

Output lengths are lognormal (median 200 tokens, σ 0.8, clipped to [1, 2048]): Azure 2023 conv
has median 129 / P99 601, Mooncake conversation median 350, ShareGPT answers ~300 tokens.

Arrivals are Poisson at `rate` requests/s. Prefix sharing, in Mooncake's representation
(`prefix_blocks` of 512 tokens; `extproc.bench.prompts` turns each block id into fixed text):
  - a fraction of conversations start with one of a few shared system prompts (whole blocks),
    when the prompt is long enough to hold one plus a user turn;
  - a fraction of requests belong to multi-turn sessions. A session's turns arrive a random
    think time apart (exponential, mean `think_time_s`) and resend the previous turn's whole
    prompt as their prefix. Their lengths are i.i.d. draws from the distribution above, sorted,
    so the lengths of all requests together still follow it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from extproc.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["DESIGN_PROMPT_LENGTHS", "LengthDistribution", "OutputLengths", "WorkloadSpec", "synthetic_workload"]


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Piecewise log-uniform lengths through quantile knots.

    Attributes:
        knots: `(quantile, tokens)` pairs, quantiles strictly increasing from 0.0 to 1.0,
            tokens increasing; between knots `log(tokens)` is linear in the quantile.
    """

    knots: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        qs = [q for q, _ in self.knots]
        xs = [x for _, x in self.knots]
        if len(self.knots) < 2 or qs[0] != 0.0 or qs[-1] != 1.0:
            raise ValueError("knots must start at quantile 0.0 and end at 1.0")
        if any(b <= a for a, b in zip(qs, qs[1:])) or any(b < a for a, b in zip(xs, xs[1:])) or xs[0] < 1:
            raise ValueError("knot quantiles must increase strictly and lengths (>= 1) must not decrease")

    def quantile(self, q: np.ndarray | float) -> np.ndarray:
        """Length at quantile(s) `q` in [0, 1] (tokens, not rounded)."""
        qs = np.array([k[0] for k in self.knots])
        logs = np.log(np.array([k[1] for k in self.knots], dtype=float))
        return np.exp(np.interp(q, qs, logs))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64 tokens, >= 1) by inverse-CDF sampling."""
        return np.maximum(1, np.rint(self.quantile(rng.random(n)))).astype(np.int64)


DESIGN_PROMPT_LENGTHS = LengthDistribution(
    ((0.0, 16), (0.30, 128), (0.68, 512), (0.90, 2048), (0.99, 8192), (0.999, 24576), (1.0, 32768))
)
"""The design notes' prompt-length quantiles (tokens); the two knots below 512 are ours."""


@dataclass(frozen=True, slots=True)
class OutputLengths:
    """Lognormal output lengths, clipped.

    Attributes:
        median: median output length (tokens).
        sigma: σ of log length.
        maximum: upper clip (tokens); the lower clip is 1.
    """

    median: float = 200.0
    sigma: float = 0.8
    maximum: int = 2048

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths (int64 tokens in [1, maximum])."""
        raw = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), 1, self.maximum).astype(np.int64)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Parameters of the synthetic workload.

    Attributes:
        requests: number of requests.
        rate: mean arrival rate (requests/s, Poisson).
        seed: RNG seed; the same spec gives the same workload.
        prompt_lengths: prompt-length distribution (tokens, chat template included).
        output_lengths: output-length distribution.
        system_prompt_share: probability that a conversation (a single request or a session's
            first turn) starts with a shared system prompt, when it is long enough to hold one
            plus `min_user_tokens`.
        system_prompts: how many distinct shared system prompts exist (chosen uniformly).
        system_prompt_blocks: length of each system prompt (512-token blocks).
        min_user_tokens: tokens a prompt must have beyond the system prompt to get one.
        session_share: target fraction of requests that are turns of multi-turn sessions.
        mean_turns: mean turns per session (>= 2; 1 + geometric, clipped at `max_turns`).
        max_turns: most turns in one session.
        think_time_s: mean time between a session's turns (seconds, exponential).
    """

    requests: int = 1000
    rate: float = 10.0
    seed: int = 0
    prompt_lengths: LengthDistribution = DESIGN_PROMPT_LENGTHS
    output_lengths: OutputLengths = field(default_factory=OutputLengths)
    system_prompt_share: float = 0.5
    system_prompts: int = 4
    system_prompt_blocks: int = 1
    min_user_tokens: int = 64
    session_share: float = 0.3
    mean_turns: float = 4.0
    max_turns: int = 8
    think_time_s: float = 20.0

    def __post_init__(self) -> None:
        checks = [
            (self.requests >= 0, "requests must be >= 0"),
            (self.rate > 0 and math.isfinite(self.rate), "rate must be a positive number of requests/s"),
            (0.0 <= self.system_prompt_share <= 1.0, "system_prompt_share must be in [0, 1]"),
            (self.system_prompts >= 1 and self.system_prompt_blocks >= 1, "need >= 1 system prompt of >= 1 block"),
            (0.0 <= self.session_share < 1.0, "session_share must be in [0, 1)"),
            (2 <= self.mean_turns <= self.max_turns, "mean_turns must be in [2, max_turns]"),
            (self.think_time_s >= 0, "think_time_s must be >= 0"),
            (self.min_user_tokens >= 0, "min_user_tokens must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(slots=True)
class _Session:
    name: str
    lengths: list[int]
    blocks: list[int]
    turn: int = 0


class _LengthPool:
    """Prompt lengths drawn in bulk (one `np.interp` per chunk, not per request)."""

    def __init__(self, dist: LengthDistribution, rng: np.random.Generator, chunk: int) -> None:
        self._dist, self._rng, self._chunk = dist, rng, max(1, chunk)
        self._values: list[int] = []
        self._pos = 0

    def take(self, k: int) -> list[int]:
        while self._pos + k > len(self._values):
            self._values = self._values[self._pos :] + self._dist.sample(self._rng, self._chunk).tolist()
            self._pos = 0
        out = self._values[self._pos : self._pos + k]
        self._pos += k
        return out


class _BlockIds:
    """Fresh block ids; ids below `first` are the system prompts'."""

    def __init__(self, first: int) -> None:
        self.next = first

    def extend(self, blocks: list[int], tokens: int) -> list[int]:
        """`blocks` plus fresh ids until they cover `tokens` tokens (512 each)."""
        out = list(blocks)
        while len(out) * MOONCAKE_BLOCK_TOKENS < tokens:
            out.append(self.next)
            self.next += 1
        return out


def synthetic_workload(spec: WorkloadSpec | None = None) -> list[TraceRequest]:
    """Generate the synthetic workload (sorted by arrival; first arrival at 0 s).

    Returns:
        `spec.requests` requests with `prefix_blocks` set (512-token blocks) and `session` set for
        session turns (`"s<n>"`); `messages` is None (text comes from `PromptSynthesizer`).
    """
    spec = spec or WorkloadSpec()
    rng = np.random.default_rng(spec.seed)
    n = spec.requests
    gaps = rng.exponential(1.0 / spec.rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else np.zeros(0)
    outputs = spec.output_lengths.sample(rng, n)
    pool = _LengthPool(spec.prompt_lengths, rng, n)
    sys_blocks = spec.system_prompt_blocks
    ids = _BlockIds(spec.system_prompts * sys_blocks)
    # P(a new conversation is a session) so that ~session_share of requests are session turns.
    f, t = spec.session_share, spec.mean_turns
    p_session = f / (t * (1 - f) + f)
    due: list[tuple[float, int, _Session]] = []  # (time the next turn is due, tiebreak, session)
    sessions = 0
    out: list[TraceRequest] = []

    def opening_blocks(first_len: int) -> list[int]:
        if rng.random() < spec.system_prompt_share and first_len >= (
            sys_blocks * MOONCAKE_BLOCK_TOKENS + spec.min_user_tokens
        ):
            k = int(rng.integers(spec.system_prompts))
            return list(range(k * sys_blocks, (k + 1) * sys_blocks))
        return []

    for i in range(n):
        now = float(arrivals[i])
        if due and due[0][0] <= now:
            _, _, session = heapq.heappop(due)
        elif rng.random() < p_session:
            turns = min(spec.max_turns, 1 + int(rng.geometric(1.0 / (spec.mean_turns - 1))))
            lengths = sorted(pool.take(turns))
            session = _Session(f"s{sessions}", lengths, opening_blocks(lengths[0]))
            sessions += 1
        else:
            (length,) = pool.take(1)
            blocks = ids.extend(opening_blocks(length), length)
            out.append(TraceRequest(now, length, int(outputs[i]), tuple(blocks)))
            continue
        length = session.lengths[session.turn]
        session.blocks = ids.extend(session.blocks, length)
        out.append(TraceRequest(now, length, int(outputs[i]), tuple(session.blocks), session=session.name))
        session.turn += 1
        if session.turn < len(session.lengths):
            heapq.heappush(due, (now + float(rng.exponential(spec.think_time_s)), i, session))
    return out
