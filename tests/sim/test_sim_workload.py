"""Output-length choice (how a trace replay pins lengths) and synthetic prompts."""

from __future__ import annotations

import random

import pytest

from extproc.pipeline.tokens import TokenCounter
from extproc.sim.workload import OUTPUT_MEDIAN, choose_output_len, synthetic_text


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"cap": 100, "max_tokens": 100, "ignore_eos": True}, (100, "length")),
        ({"cap": 40, "max_tokens": 40, "min_tokens": 40}, (40, "length")),
        ({"cap": 5000, "max_tokens": None, "ignore_eos": True}, (5000, "length")),  # runs to max_model_len
        ({"cap": 3, "max_tokens": 3}, (3, "length")),  # the draw is capped
    ],
    ids=["ignore-eos", "min-equals-max", "ignore-eos-no-max", "tiny-cap"],
)
def test_exact_lengths(kw: dict, expected: tuple[int, str]) -> None:
    assert choose_output_len(random.Random(0), **kw) == expected


def test_drawn_lengths_are_plausible_and_respect_min_tokens() -> None:
    rng = random.Random(1)
    draws = [choose_output_len(rng, cap=100_000, max_tokens=None)[0] for _ in range(4000)]
    median = sorted(draws)[len(draws) // 2]
    assert 0.8 * OUTPUT_MEDIAN < median < 1.2 * OUTPUT_MEDIAN
    assert all(n >= 200 for n, _ in (choose_output_len(rng, cap=1000, max_tokens=1000, min_tokens=200) for _ in range(200)))


def test_synthetic_text_has_the_asked_length(qwen_counter: TokenCounter) -> None:
    text = synthetic_text(qwen_counter, 1000, seed=3)
    assert abs(qwen_counter.count_text(text).count - 1000) <= 2
    assert synthetic_text(qwen_counter, 50, seed=4)[:8] != synthetic_text(qwen_counter, 50, seed=5)[:8]
