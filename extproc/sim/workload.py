"""Output lengths and synthetic prompts.

* `choose_output_len`: how many tokens a request generates, from its `max_tokens`, `min_tokens`
  and `ignore_eos` (exact when a trace replay pins them), else a log-normal draw whose median
  (150 tokens) and spread (σ = 0.9, p90 ≈ 480) sit near ShareGPT and Azure-conversation output
  lengths (median 129–180 tokens, p99 ≈ 600–1,000; shared/data/traces/PROVENANCE.md).
* `synthetic_prompt_ids` / `synthetic_text`: prompts of a chosen token length for traces that
  give only lengths (Azure 2023); ids for driving the engine directly, text for HTTP clients.
"""

from __future__ import annotations

import math
import random

from extproc.pipeline.tokens import TokenCounter

__all__ = ["choose_output_len", "synthetic_prompt_ids", "synthetic_text", "OUTPUT_MEDIAN", "OUTPUT_SIGMA"]

OUTPUT_MEDIAN = 150
OUTPUT_SIGMA = 0.9
_VOCAB = 151_000  # below Qwen3's special tokens


def choose_output_len(
    rng: random.Random,
    *,
    cap: int,
    max_tokens: int | None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[int, str]:
    """Output length (tokens) and the finish reason vLLM would report.

    Args:
        rng: the random source (seeded per request for reproducibility).
        cap: the most the request may generate: `max_tokens`, or `max_model_len − prompt`.
        max_tokens: the client's `max_tokens` (None if unset).
        min_tokens, ignore_eos: vLLM's extensions.

    Returns:
        (tokens, "length" if the cap was reached else "stop"); tokens is at least 1.
    """
    cap = max(1, cap)
    if ignore_eos or (max_tokens is not None and min_tokens >= max_tokens):
        return cap, "length"
    drawn = int(math.exp(rng.gauss(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA)))
    n = max(1, min_tokens, drawn)
    if n >= cap:
        return cap, "length"
    return n, "stop"


def synthetic_prompt_ids(tokens: int, rng: random.Random) -> list[int]:
    """`tokens` random token ids (no two prompts share a prefix, as a length-only trace implies)."""
    return [rng.randrange(_VOCAB) for _ in range(tokens)]


def synthetic_text(counter: TokenCounter, tokens: int, seed: int = 0) -> str:
    """Plain text that tokenizes to `tokens` tokens (±1 at the cut) with `counter`.

    The text starts with the seed, so texts with different seeds share no prefix block.
    """
    rng = random.Random(seed)
    words = [f"{seed}:"]
    while len(words) < tokens:
        words.append(rng.choice(_FILLER))
    ids = counter.encode(" ".join(words))
    while len(ids) < tokens:
        words.extend(rng.choice(_FILLER) for _ in range(tokens - len(ids)))
        ids = counter.encode(" ".join(words))
    return counter.tokenizer.decode(ids[:tokens])


_FILLER = (
    "river stone garden window market silver winter summer paper engine bridge mountain "
    "harbor signal lantern forest castle valley pencil orange violet planet rocket canvas "
    "meadow thunder whisper candle anchor compass feather glacier island jungle kettle"
).split()
