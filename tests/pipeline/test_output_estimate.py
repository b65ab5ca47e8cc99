"""The learned output length (`extproc.pipeline.output_estimate`): its quantile, window and
cap rules."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from extproc.config import load_config
from extproc.config.schema import ModelConfig, OutputEstimateConfig
from extproc.pipeline.output_estimate import OutputEstimates, OutputLengthWindow


def test_quantile_is_the_nearest_rank_of_the_window():
    w = OutputLengthWindow(quantile=0.95, window=1000, min_samples=1)
    values = list(range(1, 101))
    random.Random(3).shuffle(values)
    for v in values:
        w.observe(v)
    assert w.estimate() == 95  # 95 of the 100 lengths are ≤ 95
    for q, expected in ((0.5, 50), (1.0, 100), (0.01, 1), (0.951, 96)):
        w.quantile = q
        assert w.estimate() == expected


def test_no_estimate_before_min_samples():
    w = OutputLengthWindow(quantile=0.95, window=100, min_samples=20)
    for _ in range(19):
        w.observe(200)
        assert w.estimate() is None
    w.observe(200)
    assert w.estimate() == 200


def test_window_forgets_old_lengths_and_stays_bounded():
    """Only the last `window` lengths count, however long the stream: a workload whose outputs
    shrink from ~2000 to ~200 tokens is estimated on the new ones, with memory for 100 lengths."""
    rng = random.Random(7)
    w = OutputLengthWindow(quantile=0.95, window=100, min_samples=20)
    for _ in range(50_000):
        w.observe(rng.randint(1500, 2500))
    assert 2400 <= w.estimate() <= 2500
    for _ in range(100):
        w.observe(rng.randint(150, 250))
    assert 240 <= w.estimate() <= 250  # the long ones are all gone
    assert len(w) == 100 and len(w._order) == 100 and len(w._sorted) == 100
    assert w._sorted == sorted(w._order)
    assert w.seen == 50_100


def test_bad_parameters_and_lengths_are_errors():
    with pytest.raises(ValueError, match="quantile"):
        OutputLengthWindow(quantile=0.0, window=10, min_samples=1)
    with pytest.raises(ValueError, match="quantile"):
        OutputLengthWindow(quantile=float("nan"), window=10, min_samples=1)
    with pytest.raises(ValueError, match="window"):
        OutputLengthWindow(quantile=0.5, window=0, min_samples=1)
    with pytest.raises(ValueError, match="min_samples"):
        OutputLengthWindow(quantile=0.5, window=10, min_samples=11)
    with pytest.raises(ValueError, match="≥ 0 tokens"):
        OutputLengthWindow(quantile=0.5, window=10, min_samples=1).observe(-1)


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"quantile": 0}, "greater than 0"),
        ({"quantile": 1.5}, "less than or equal to 1"),
        ({"window": 0}, "greater than or equal to 1"),
        ({"window": 10_000_000}, "less than or equal to 100000"),  # ~3.5 ms (linear from 351 µs at 1M) per response end
        ({"min_samples": 0}, "greater than or equal to 1"),
        ({"window": 10, "min_samples": 20}, "min_samples \\(20\\) must be at most window \\(10\\)"),
        ({"quantlie": 0.9}, "quantlie"),
    ],
)
def test_config_validation(raw, needle):
    with pytest.raises(ValidationError, match=needle):
        OutputEstimateConfig(**raw)


@pytest.mark.parametrize(("yaml_value", "enabled"), [("off", False), ("false", False), ("on", True), ("true", True)])
def test_config_switch_alone(tmp_path, yaml_value, enabled):
    """`output_estimate: off`, as `truncation: off` reads: was refused as not a mapping."""
    path = tmp_path / "c.yaml"
    path.write_text(f"models: [{{name: m, path: 'builtin:qwen3-8b', output_estimate: {yaml_value}}}]\nendpoints: [{{address: '127.0.0.1:8000', models: [m]}}]\n")
    cfg = load_config(path, env={}).models[0].output_estimate
    assert (cfg.enabled, cfg.quantile, cfg.window, cfg.min_samples) == (enabled, 0.95, 1000, 20)


def test_config_defaults_on_every_model():
    cfg = ModelConfig(name="m", path="builtin:qwen3-8b").output_estimate
    assert (cfg.enabled, cfg.quantile, cfg.window, cfg.min_samples) == (True, 0.95, 1000, 20)


def test_decode_tokens_caps_max_tokens_only_once_learned():
    est = OutputEstimates([("m", OutputEstimateConfig(min_samples=20)), ("off", OutputEstimateConfig(enabled=False))])
    assert est.decode_tokens("m", 32768, 32768) == 32768  # nothing learned: max_tokens, as before
    for i in range(50):
        est.observe("m", 190 + i % 20)
        est.observe("off", 200)
    assert est.cap("m") == 208  # 48th of 50: 190-199 three times each, 200-209 twice
    assert est.decode_tokens("m", 32768, 32768) == 208
    assert est.decode_tokens("m", 100, 100) == 100  # a smaller max_tokens stays the bound
    assert est.decode_tokens("m", None, 512) == 512  # no max_tokens: the model's default estimate
    assert est.decode_tokens("off", 32768, 32768) == 32768  # disabled: never capped
    assert est.cap("unknown") is None and est.observe("unknown", 5) is None
    assert est.summary()["m"]["estimate_tokens"] == 208 and "off" not in est.summary()


def test_n_sequences_count_per_sequence():
    est = OutputEstimates([("m", OutputEstimateConfig(min_samples=1))])
    assert est.observe("m", 800, n=4) == 200  # usage counts the tokens of every choice
