"""The synthetic workload: the design notes' length quantiles, Poisson arrivals, shared prefixes."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from extproc.bench.traces import MOONCAKE_BLOCK_TOKENS
from extproc.bench.workload import (
    DESIGN_PROMPT_LENGTHS,
    LengthDistribution,
    OutputLengths,
    WorkloadSpec,
    synthetic_workload,
)


@pytest.fixture(scope="module")
def big() -> list:
    """100k requests of the default workload (sessions and system prompts on)."""
    return synthetic_workload(WorkloadSpec(requests=100_000, rate=20.0, seed=7))


def test_distribution_passes_through_its_knots() -> None:
    for q, tokens in DESIGN_PROMPT_LENGTHS.knots:
        assert DESIGN_PROMPT_LENGTHS.quantile(q) == pytest.approx(tokens)
    # Halfway between P90 (2,048) and P99 (8,192) in quantile is their geometric mean.
    assert DESIGN_PROMPT_LENGTHS.quantile(0.945) == pytest.approx(4096)


@pytest.mark.parametrize(
    ("q", "expected", "rel"),
    [(90, 2048, 0.05), (99, 8192, 0.08), (99.9, 24576, 0.15)],
    ids=["p90", "p99", "p99.9"],
)
def test_workload_hits_the_design_quantiles(big: list, q: float, expected: int, rel: float) -> None:
    lengths = np.array([r.input_tokens for r in big])
    assert np.percentile(lengths, q) == pytest.approx(expected, rel=rel)


def test_workload_share_and_max(big: list) -> None:
    lengths = np.array([r.input_tokens for r in big])
    assert (lengths <= 512).mean() == pytest.approx(0.68, abs=0.01)
    assert lengths.max() <= 32768
    assert lengths.min() >= 16


def test_output_lengths_are_plausible(big: list) -> None:
    out = np.array([r.output_tokens for r in big])
    assert np.median(out) == pytest.approx(200, rel=0.05)
    assert out.min() >= 1 and out.max() <= 2048


def test_arrivals_are_poisson_at_the_rate(big: list) -> None:
    arrivals = np.array([r.arrival_s for r in big])
    assert arrivals[0] == 0.0
    assert np.all(np.diff(arrivals) >= 0)
    assert len(big) / arrivals[-1] == pytest.approx(20.0, rel=0.02)
    per_second = np.bincount(np.floor(arrivals).astype(int))
    assert per_second.var() / per_second.mean() == pytest.approx(1.0, abs=0.1)  # Poisson: IoD ≈ 1


def test_blocks_cover_each_prompt(big: list) -> None:
    for r in big[:5000]:
        n = len(r.prefix_blocks)
        assert (n - 1) * MOONCAKE_BLOCK_TOKENS < r.input_tokens <= n * MOONCAKE_BLOCK_TOKENS


def test_sessions_resend_their_history(big: list) -> None:
    turns = defaultdict(list)
    for r in big:
        if r.session:
            turns[r.session].append(r)
    in_sessions = sum(len(t) for t in turns.values())
    assert in_sessions / len(big) == pytest.approx(0.3, abs=0.04)
    assert max(len(t) for t in turns.values()) <= 8
    for session in turns.values():
        for earlier, later in zip(session, session[1:]):
            assert later.arrival_s >= earlier.arrival_s
            assert later.input_tokens >= earlier.input_tokens
            assert later.prefix_blocks[: len(earlier.prefix_blocks)] == earlier.prefix_blocks


def test_system_prompts_are_shared(big: list) -> None:
    spec = WorkloadSpec()
    system_ids = spec.system_prompts * spec.system_prompt_blocks
    with_system = [r for r in big if r.prefix_blocks[0] < system_ids]
    assert len({r.prefix_blocks[0] for r in with_system}) == spec.system_prompts
    # Only prompts long enough for a 512-token system prompt plus a user turn get one.
    assert all(r.input_tokens >= MOONCAKE_BLOCK_TOKENS + spec.min_user_tokens for r in with_system)
    assert 0.05 < len(with_system) / len(big) < 0.3
    # Everything else has blocks of its own (or its session's).
    owners = defaultdict(set)
    for r in big:
        for b in r.prefix_blocks:
            if b >= system_ids:
                owners[b].add(r.session or id(r))
    assert all(len(o) == 1 for o in owners.values())


def test_same_seed_same_workload() -> None:
    a = synthetic_workload(WorkloadSpec(requests=500, seed=1))
    b = synthetic_workload(WorkloadSpec(requests=500, seed=1))
    c = synthetic_workload(WorkloadSpec(requests=500, seed=2))
    assert a == b
    assert a != c


def test_no_sessions_no_system_prompts() -> None:
    plain = synthetic_workload(WorkloadSpec(requests=2000, session_share=0.0, system_prompt_share=0.0))
    assert all(r.session is None for r in plain)
    blocks = [b for r in plain for b in r.prefix_blocks]
    assert len(blocks) == len(set(blocks))  # nothing shared


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": 0.0},
        {"requests": -1},
        {"session_share": 1.0},
        {"system_prompt_share": 1.5},
        {"mean_turns": 1.0},
        {"mean_turns": 9.0, "max_turns": 8},
        {"system_prompts": 0},
    ],
    ids=["zero-rate", "negative-requests", "all-sessions", "share-above-1", "one-turn", "mean-above-max", "no-prompts"],
)
def test_bad_specs_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(**kwargs)


@pytest.mark.parametrize(
    "knots",
    [((0.1, 16), (1.0, 32)), ((0.0, 16), (0.5, 8), (1.0, 32)), ((0.0, 16), (0.5, 32), (0.5, 64), (1.0, 128))],
    ids=["no-zero-quantile", "decreasing-length", "repeated-quantile"],
)
def test_bad_knots_are_refused(knots: tuple) -> None:
    with pytest.raises(ValueError):
        LengthDistribution(knots)


def test_output_lengths_clip() -> None:
    rng = np.random.default_rng(0)
    out = OutputLengths(median=5000, sigma=0.1, maximum=100).sample(rng, 100)
    assert out.max() == 100
