"""The profile runner: filter order, clamping, weights, rejection, explanations."""

from __future__ import annotations

from extproc.scheduling.framework import Profile, WeightedScorer, min_max_inverted
from extproc.scheduling.registry import build

from .conftest import context


class Fixed:
    """A scorer returning fixed values (to test the runner, not a plugin)."""

    def __init__(self, name, values):
        self.name = name
        self.values = values

    def score(self, ctx, endpoints):
        return self.values[: len(endpoints)]


def test_runner_clamps_weights_and_explains(store):
    a, b, c = store.all()
    profile = Profile(
        "t",
        [build("healthy-filter")],
        [WeightedScorer(Fixed("x", [2.0, 0.5, -1.0]), 2.0), WeightedScorer(Fixed("y", [0.0, 1.0, float("nan")]), 1.0)],
        build("max-score-picker"),
    )
    result = profile.run(context(), [a, b, c])
    # totals: a = 2·1.0 (clamped) + 0 = 2.0; b = 2·0.5 + 1 = 2.0; c = 2·0 + 0 (NaN → 0) = 0
    totals = {s.endpoint.address: s.total for s in [result.pick.primary, *result.pick.fallbacks]}
    assert totals == {a.address: 2.0, b.address: 2.0, c.address: 0.0}
    assert "runner-up" in result.explain() and "x=" in result.explain()
    assert set(result.timings_s) == {"healthy-filter", "x", "y", "max-score-picker"}


def test_runner_reports_the_filter_that_rejected(store):
    for ep in store.all():
        ep.healthy = False
    result = Profile("t", [build("healthy-filter")], [], build("max-score-picker")).run(context(), store.all())
    assert result.pick is None and result.rejected_by == "healthy-filter"
    assert result.filtered_by == {"healthy-filter": 3}
    assert result.explain() == "rejected by healthy-filter"


def test_min_max_inverted():
    assert min_max_inverted([]) == []
    assert min_max_inverted([3, 3]) == [1.0, 1.0]
    assert min_max_inverted([0, 5, 10]) == [1.0, 0.5, 0.0]


def test_contexts_and_routes_default_to_the_configs_attention_ratio(store):
    """A scheduling context or a routed request built without the ratio counts prefill work as
    a configured server does (`scheduling.prefill_model.attention_ratio`'s default), not in
    tokens alone: at 0.0 an 8k-token prompt was 8,000 tokens of work instead of 9,280."""
    from dataclasses import fields

    from extproc.config.schema import PrefillModelConfig
    from extproc.pipeline.request import Routed
    from extproc.scheduling.framework import SchedulingContext

    configured = PrefillModelConfig().attention_ratio
    for cls in (SchedulingContext, Routed):
        (field,) = (f for f in fields(cls) if f.name == "attention_ratio")
        assert field.default == configured, cls.__name__
    assert context(prompt=8000).prefill_work(store.all()[0]) == 9280  # no prefix: every token is uncached
