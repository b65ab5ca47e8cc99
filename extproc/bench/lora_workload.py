"""A multi-LoRA workload: N adapters of one base model with Zipf popularity, each with its own
system prompt, for the LoRA benchmark (`scripts/bench_lora.py`) and `up --fleet lora`.

Request i asks for adapter k (its `model`) with probability p_k ∝ (k + 1)^−s (Zipf, exponent
`zipf_s`; 1.1 in the issue's measurement: over 32 adapters the most popular takes 29 %, the
ten least 1 % each). With `hot_share` set, adapter 0 takes that share and the others split the
rest in Zipf proportions (the hot-adapter scenario). Each adapter has its own system prompt of
`system_tokens` tokens (a customer's or a task's instructions), or, with `shared_system_prompt`,
all use one text (the prefix-per-adapter scenario: the same tokens must still not be shared
across adapters). The user turn is `user_tokens` unique tokens; arrivals are Poisson at `rate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from extproc.bench.prompts import PromptSynthesizer
from extproc.bench.records import TraceRequest
from extproc.stack.fleet import adapter_names

__all__ = ["LoraWorkloadSpec", "adapter_names", "adapter_popularity", "lora_workload"]


def adapter_popularity(n: int, zipf_s: float, hot_share: float | None = None) -> np.ndarray:
    """Each adapter's share of requests (sums to 1): Zipf(`zipf_s`) over ranks 1..n, or with
    `hot_share` adapter 0 at that share and the rest Zipf over the remainder.

    Raises:
        ValueError: n < 1, zipf_s < 0, or hot_share outside (0, 1) (or set with n = 1).
    """
    if n < 1 or zipf_s < 0:
        raise ValueError(f"need n >= 1 adapters and zipf_s >= 0, got {n}, {zipf_s}")
    weights = np.arange(1, n + 1, dtype=float) ** -zipf_s
    p = weights / weights.sum()
    if hot_share is None:
        return p
    if not (0 < hot_share < 1) or n < 2:
        raise ValueError(f"hot_share must be in (0, 1) with at least 2 adapters, got {hot_share}")
    rest = weights[1:] / weights[1:].sum() * (1 - hot_share)
    return np.concatenate([[hot_share], rest])


@dataclass(frozen=True, slots=True)
class LoraWorkloadSpec:
    """The multi-LoRA workload.

    Attributes:
        requests: number of requests.
        rate: mean arrival rate (requests/s, Poisson).
        adapters: distinct adapters (names `adapter_names`).
        zipf_s: Zipf exponent of adapter popularity.
        hot_share: adapter 0's share of requests, or None for pure Zipf.
        system_tokens: each adapter's system prompt (tokens).
        user_tokens: each request's unique user turn (tokens).
        output_tokens: tokens generated per request.
        shared_system_prompt: every adapter uses the same system prompt text.
        seed: adapter draws, arrivals and texts.
    """

    requests: int = 1000
    rate: float = 10.0
    adapters: int = 32
    zipf_s: float = 1.1
    hot_share: float | None = None
    system_tokens: int = 512
    user_tokens: int = 256
    output_tokens: int = 128
    shared_system_prompt: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.requests, self.adapters, self.output_tokens) < 1 or min(self.system_tokens, self.user_tokens) < 0:
            raise ValueError("requests, adapters and output_tokens must be >= 1, token counts >= 0")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")


def lora_workload(prompts: PromptSynthesizer, spec: LoraWorkloadSpec) -> list[TraceRequest]:
    """The requests, sorted by arrival (first at 0 s), each with `model` set to its adapter and
    `messages` (system prompt + unique user turn); `input_tokens` counted with the chat template.

    Raises:
        ValueError: a bad spec (`adapter_popularity`).
    """
    rng = np.random.default_rng(spec.seed)
    names = adapter_names(spec.adapters)
    p = adapter_popularity(spec.adapters, spec.zipf_s, spec.hot_share)
    choice = rng.choice(spec.adapters, size=spec.requests, p=p)
    gaps = rng.exponential(1.0 / spec.rate, size=spec.requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    systems = [prompts.stream_text("lora-system:shared" if spec.shared_system_prompt else f"lora-system:{name}", spec.system_tokens) for name in names]
    out = []
    for i in range(spec.requests):
        k = int(choice[i])
        messages = [
            {"role": "system", "content": systems[k]},
            {"role": "user", "content": prompts.stream_text(f"lora-user:{spec.seed}:{i}", spec.user_tokens)},
        ]
        tokens = prompts.counter.count_chat(messages).count
        out.append(TraceRequest(float(arrivals[i]), tokens, spec.output_tokens, messages=messages, model=names[k]))
    return out
