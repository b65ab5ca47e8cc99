"""Each scheduling plugin on endpoints in known states (expected values explained inline)."""

from __future__ import annotations

import collections
import dataclasses
import random
import time
from types import SimpleNamespace

import pytest

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.prefill_fit import prefill_work
from extproc.scheduling.framework import Filter, Picker, Scorer
from extproc.scheduling.plugins.filters.kv_fit import blocks_needed, blocks_to_start
from extproc.scheduling.plugins.scorers.ttft_estimate import predicted_ttft_s
from extproc.scheduling.registry import PluginConfigError, build, registered

from .conftest import context, engine


def test_every_registered_plugin_satisfies_its_protocol():
    for type_name, cls in registered().items():
        plugin = build(type_name, {"match": {"a": "b"}} if type_name == "label-filter" else {})
        kinds = [p for p in (Filter, Scorer, Picker) if isinstance(plugin, p)]
        assert len(kinds) == 1, f"{type_name} must implement exactly one of filter/score/pick"
        assert type_name.endswith(("-filter", "-scorer", "-picker"))
        assert cls.__module__.rsplit(".", 2)[-2] == {Filter: "filters", Scorer: "scorers", Picker: "pickers"}[kinds[0]]


def test_unknown_params_are_errors_not_defaults():
    with pytest.raises(PluginConfigError, match="tie_epsilon"):
        build("max-score-picker", {"tie_epsilon": -1})
    with pytest.raises(PluginConfigError, match="unknown plugin type"):
        build("fastest-scorer")


def test_healthy_filter_drops_unhealthy_and_device_faults(store):
    a, b, c = store.all()
    b.healthy = False
    c.node = SimpleNamespace(device_fault="GPU 0: ECC uncorrectable errors", gpu_util=0.1, usable=False)
    assert build("healthy-filter").filter(context(), [a, b, c]) == [a]
    c.node = SimpleNamespace(device_fault=None, gpu_util=0.1, usable=True)
    assert build("healthy-filter").filter(context(), [a, b, c]) == [a, c]


def test_healthy_filter_leaves_out_ejected_endpoints_unless_all_are(store):
    a, b, c = store.all()
    ctx = context()
    b.healthy = False
    a.ejected_until = ctx.now + 10  # outlier detection: five 5xx in a row
    assert build("healthy-filter").filter(ctx, [a, b, c]) == [c]
    c.ejected_until = ctx.now + 10  # every live endpoint ejected: keep them (never the unhealthy b)
    assert build("healthy-filter").filter(ctx, [a, b, c]) == [a, c]
    a.ejected_until = c.ejected_until = ctx.now - 1  # ejections over
    assert build("healthy-filter").filter(ctx, [a, b, c]) == [a, c]


def test_healthy_filter_panics_into_live_endpoints_below_the_threshold(store):
    """Issue 18.2: every probe timing out at once (a starved host) must not refuse everyone."""
    a, b, c = store.all()
    for ep in (a, b, c):
        ep.healthy, ep.last_probe_error = False, "timeout"
    c.last_probe_error = "ClientConnectorError"  # refused: down, not slow
    ctx = context()
    assert build("healthy-filter").filter(ctx, [a, b, c]) == [a, b] and ctx.data["health_panic"]
    a.healthy = True  # 1 of 3 healthy < 50 %: still panic, b (slow) kept
    assert build("healthy-filter").filter(ctx := context(), [a, b, c]) == [a, b] and ctx.data["health_panic"]
    b.healthy = True  # 2 of 3 ≥ 50 %: only the healthy ones, no panic
    assert build("healthy-filter").filter(ctx := context(), [a, b, c]) == [a, b] and "health_panic" not in ctx.data
    a.healthy = b.healthy = False
    off = context()
    off.panic_threshold = 0.0  # panic off: nobody
    assert build("healthy-filter").filter(off, [a, b, c]) == []


def test_stale_metrics_filter(store):
    a, b, c = store.all()
    a.engine = engine(age=0.1)
    b.engine = engine(age=5.0)  # older than stale_after_s = 2 s
    # c was never scraped: not stale (nothing to judge by)
    assert build("stale-metrics-filter").filter(context(), [a, b, c]) == [a, c]
    # All stale: kept by default (serve on old data) or dropped on request.
    a.engine = engine(age=9)
    c.engine = engine(age=9)
    assert build("stale-metrics-filter").filter(context(), [a, b, c]) == [a, b, c]
    assert build("stale-metrics-filter", {"keep_all_if_all_stale": False}).filter(context(), [a, b, c]) == []


def test_kv_fit_filter_counts_engine_usage_and_our_reservations(store):
    a, b, c = store.all()
    # 100-token prompt + 28 output tokens → 6 full prompt blocks + 2 = 8 blocks needed.
    a.engine = engine(kv=0.5, blocks=16)  # 8 free → fits exactly
    b.engine = engine(kv=0.5, blocks=16)
    store.reserve(b, blocks=1)  # our unsettled reservation leaves 7 → does not fit
    c.engine = None  # unknown pool → kept
    assert build("kv-fit-filter").filter(context(), [a, b, c]) == [a, c]
    # headroom_fraction keeps 25 % of 16 = 4 blocks free: a no longer fits.
    assert build("kv-fit-filter", {"headroom_fraction": 0.25}).filter(context(), [a, b, c]) == [c]


def test_kv_fit_reserves_a_batch_whole_and_starts_it_once_its_largest_prompt_fits(store):
    """A batched completion's prompts are each their own engine request: all of them are
    reserved, but an endpoint with room for the largest can start the batch."""
    a, b, _ = store.all()
    ctx = context(prompt=400, output=28)
    ctx.request = dataclasses.replace(ctx.request, prompt_lengths=(100, 100, 100, 100))
    # each prompt: 6 full blocks + ceil((4 + 28) / 16) = 8 blocks; the batch 32.
    assert (blocks_needed(ctx, a), blocks_to_start(ctx, a)) == (32, 8)
    a.engine = engine(kv=0.5, blocks=16)  # 8 free: the largest prompt fits
    b.engine = engine(kv=0.5, blocks=14)  # 7 free: it does not
    assert build("kv-fit-filter").filter(ctx, [a, b]) == [a]


def test_kv_fit_uses_each_endpoints_block_size(store):
    a, b, _ = store.all()
    a.engine = engine(kv=0.0, blocks=4, block_size=32)  # 128 tokens need 4 blocks of 32 (prompt 96 + tail 4+28)
    b.engine = engine(kv=0.0, blocks=4, block_size=16)  # 8 blocks of 16 needed, 4 free
    assert build("kv-fit-filter").filter(context(), [a, b]) == [a]


def test_label_filter(store):
    a, b, c = store.all()
    a.labels.update(gpu="h100", zone="x")
    b.labels.update(gpu="a100")
    assert build("label-filter", {"match": {"gpu": "h100"}}).filter(context(), [a, b, c]) == [a]


@pytest.mark.parametrize(
    ("waiting", "unseen", "expected"),
    [
        ((0, 0, 0), (0, 0, 0), [1.0, 1.0, 1.0]),  # no preference
        ((0, 5, 10), (0, 0, 0), [1.0, 0.5, 0.0]),  # min-max: 0 → 1, 10 → 0
        ((0, 0, 0), (4, 0, 0), [0.0, 1.0, 1.0]),  # requests routed since the last scrape count too
    ],
    ids=["idle", "engine-queues", "unseen-burst"],
)
def test_queue_depth_scorer(store, waiting, unseen, expected):
    eps = store.all()
    for ep, w, u in zip(eps, waiting, unseen):
        ep.engine = engine(waiting=w)
        for _ in range(u):
            store.reserve(ep)
    assert build("queue-depth-scorer").score(context(), eps) == pytest.approx(expected)


def test_kv_utilization_scorer(store):
    a, b, c = store.all()
    a.engine = engine(kv=0.2, blocks=100)
    b.engine = engine(kv=0.2, blocks=100)
    store.reserve(b, blocks=30)  # effective usage 0.5
    c.engine = None  # unknown → neutral 0.5
    assert build("kv-utilization-scorer").score(context(), [a, b, c]) == pytest.approx([0.8, 0.5, 0.5])


def test_flops_load_scorer_weights_prefill_three_times(store):
    a, b, _ = store.all()
    for _ in range(3):
        r = store.reserve(a)
        r.mark_first_token()  # 3 decoding → load 3
    store.reserve(b)  # 1 in prefill → load 3
    store.reserve(b)  # 2 in prefill → load 6
    assert [a.flops_load, b.flops_load] == [3, 6]
    assert build("flops-load-scorer").score(context(), [a, b]) == pytest.approx([1.0, 0.0])


def test_flops_load_token_weighted(store):
    a, b, _ = store.all()
    store.reserve(a, prompt_tokens=8000)  # 3 × 8 = 24
    for _ in range(10):
        store.reserve(b, prompt_tokens=100).mark_first_token()  # 10 decoding = 10
    assert build("flops-load-scorer", {"token_weighted": True}).score(context(), [a, b]) == pytest.approx([0.0, 1.0])


def test_inflight_scorer(store):
    a, b, c = store.all()
    store.reserve(a)
    store.reserve(a)
    store.reserve(b)
    assert build("inflight-scorer").score(context(), [a, b, c]) == pytest.approx([0.0, 0.5, 1.0])


def test_compute_aware_scorer_is_the_seed_formula(store):
    a, b, _ = store.all()
    a.engine = engine(kv=0.2, ttft=0.1)
    b.engine = engine(kv=0.6, ttft=0.4)
    a.node = SimpleNamespace(gpu_util=0.5, device_fault=None)
    b.node = SimpleNamespace(gpu_util=0.9, device_fault=None)
    scorer = build("compute-aware-scorer", {"alpha": 0.5, "beta": 0.3, "gamma": 0.2})
    # a: 0.5·(0.1/0.1) + 0.3·0.8 + 0.2·0.5 = 0.84;  b: 0.5·(0.1/0.4) + 0.3·0.4 + 0.2·0.1 = 0.265
    assert scorer.score(context(), [a, b]) == pytest.approx([0.84, 0.265])
    # Without agents the GPU term is dropped and α, β renormalised (0.625, 0.375).
    a.node = b.node = None
    assert scorer.score(context(), [a, b]) == pytest.approx([0.625 + 0.375 * 0.8, 0.625 * 0.25 + 0.375 * 0.4])


def test_compute_aware_prefers_measured_ttft_over_engine_histogram(store):
    a, b, _ = store.all()
    a.engine = engine(ttft=0.1)
    b.engine = engine(ttft=0.1)
    b.stream_stats = SimpleNamespace(ttft_p95_s=lambda: 1.0)  # what clients actually saw
    scores = build("compute-aware-scorer", {"alpha": 1, "beta": 0, "gamma": 0}).score(context(), [a, b])
    assert scores == pytest.approx([1.0, 0.1])


def test_max_score_picker_breaks_ties_randomly(store):
    from extproc.scheduling.framework import ScoredEndpoint

    a, b, c = store.all()
    scored = [ScoredEndpoint(a, 1.0, {}), ScoredEndpoint(b, 1.0, {}), ScoredEndpoint(c, 0.5, {})]
    picker = build("max-score-picker")
    ctx = context()
    chosen = {picker.pick(ctx, scored).primary.endpoint.address for _ in range(50)}
    assert chosen == {a.address, b.address}
    result = picker.pick(ctx, scored)
    assert result.fallbacks[-1].endpoint is c


def _stats(pressure: int, latency: float = 1.0, cap: float = 1.0):
    return SimpleNamespace(pressure=lambda: pressure, latency_score=lambda: latency, inflight_cap_factor=lambda: cap)


def test_backpressure_scorer_by_level(store):
    a, b, c = store.all()
    a.stream_stats, b.stream_stats, c.stream_stats = _stats(0), _stats(1), _stats(2)
    assert build("backpressure-scorer").score(context(), [a, b, c]) == [1.0, 0.5, 0.0]
    a.stream_stats = None  # no evidence: no penalty
    assert build("backpressure-scorer", {"light_score": 0.8}).score(context(), [a, b]) == [1.0, 0.8]


def test_stream_latency_scorer_reads_the_bucket(store):
    a, b, c = store.all()
    a.stream_stats, b.stream_stats = _stats(0, latency=0.6), _stats(0, latency=0.1)
    assert build("stream-latency-scorer").score(context(), [a, b, c]) == [0.6, 0.1, 1.0]


def test_backpressure_cap_filter(store):
    a, b, c = store.all()
    for ep in (a, b):
        for _ in range(3):
            store.reserve(ep)
    a.stream_stats = _stats(2, cap=0.5)  # heavy: cap 4 × 0.5 = 2 < 3 in flight → dropped
    b.stream_stats = _stats(0, cap=1.0)  # cap 4 > 3 → kept
    f = build("backpressure-cap-filter", {"max_inflight": 4})
    assert f.filter(context(), [a, b, c]) == [b, c]
    assert f.filter(context(), [a]) == [a]  # everyone capped: keep all rather than refuse


def _observe(store, ep, samples):
    """Feed (prefill tokens, TTFT seconds) samples into `ep`'s fit through real reservations."""
    for tokens, ttft in samples:
        r = store.reserve(ep, prompt_tokens=tokens)
        r.mark_first_token(r.created_at + ttft)
        r.release()


def test_ttft_estimate_learns_each_endpoints_prefill_speed(store):
    a, b, c = store.all()
    # a: TTFT = 1e-4 s/token, no fixed cost; b: 10 ms + 3e-5 s/token; c unseen.
    _observe(store, a, [(x, 1e-4 * x) for x in (500, 1000, 4000, 2000) * 8])
    _observe(store, b, [(x, 0.01 + 3e-5 * x) for x in (500, 1000, 4000, 2000) * 8])
    assert a.prefill_s_per_token == pytest.approx(1e-4, rel=0.1) and b.prefill_s_per_token == pytest.approx(3e-5, rel=0.1)
    assert b.prefill_fit.t0_s == pytest.approx(0.01, abs=0.003)
    store.reserve(b, prompt_tokens=3000)  # b is busy: 3,000 tokens of backlog
    # 1,000-token prompt: a ≈ 0.1 s; b ≈ 0.01 + 4,000 × 3e-5 = 0.13 s; c, not observed yet, is
    # predicted with the fastest fit for its own (empty) backlog: ≈ b's 0.04 s, so it is tried
    predicted = dict(zip("abc", predicted_ttft_s([a, b, c], [1000] * 3)))
    assert predicted["a"] == pytest.approx(0.1, rel=0.1) and predicted["b"] == pytest.approx(0.13, rel=0.1)
    assert predicted["c"] == pytest.approx(0.04, rel=0.15)
    scores = build("ttft-estimate-scorer").score(context(prompt=1000), [a, b, c])
    assert scores[2] == 1.0 and max(scores[:2]) < 1.0


def test_ttft_estimate_short_prompts_teach_the_fixed_cost_not_the_speed(store):
    """Four identical engines seeing only short prompts with a fixed ~20 ms first-token cost and
    noise: a ratio model learned speeds 3x apart from this; the fit agrees within a few percent
    on what a long prompt costs."""
    import random

    rng = random.Random(7)
    eps = store.all()
    for ep in eps:
        _observe(store, ep, [(n, 0.02 + 4e-5 * n + rng.uniform(-0.008, 0.008)) for n in (rng.randint(10, 60) for _ in range(30))])
    long_prompt = [ep.prefill_fit.predict(4000) for ep in eps]
    assert max(long_prompt) / min(long_prompt) < 1.15
    scores = build("ttft-estimate-scorer").score(context(prompt=4000), eps)
    assert min(scores) > 0.85


def test_prefill_fit_down_weights_an_outlier_once_established(store):
    a, _, _ = store.all()
    _observe(store, a, [(x, 0.01 + 5e-5 * x) for x in (200, 1000, 3000) * 4])
    before = a.prefill_fit.predict(2000)
    _observe(store, a, [(1000, 30.0)])  # one request stuck behind a preemption
    assert a.prefill_fit.predict(2000) < 3 * before


def test_prefill_fit_ignores_bad_samples():
    from extproc.datastore.prefill_fit import PrefillFit

    fit = PrefillFit()
    for x, y in ((100, 0.0), (100, -1.0), (-5, 0.1), (float("inf"), 0.1), (100, float("inf")), (100, float("nan"))):
        fit.add(x, y, 0.0)
    assert fit.samples == 0 and fit.t0_s == fit.prior.t0_s


def test_ttft_estimate_learns_only_from_real_first_tokens(store):
    a, _, _ = store.all()
    r = store.reserve(a, prompt_tokens=1000)
    r.mark_first_token(r.created_at + 5.0, learn=False)  # a non-streamed answer's headers: its end
    assert a.prefill_s_per_token is None and not r.in_prefill and a.decode_inflight == 1
    r = store.reserve(a, prompt_tokens=1000)
    r.mark_first_token(r.created_at - 0.5)  # a clock that went backwards teaches nothing
    assert a.prefill_s_per_token is None


def test_ttft_estimate_forgets_an_idle_endpoints_old_value(store):
    """One slow first token must not keep an endpoint idle forever: with nothing in flight and
    its fit older than relearn_after_s, it is tried again like an unobserved endpoint."""
    a, b, _ = store.all()
    _observe(store, a, [(1000, 0.05)])
    _observe(store, b, [(1000, 5.0)])  # b's one sample: a 100x slow cold start
    scorer = build("ttft-estimate-scorer", {"relearn_after_s": 10, "decode_weight": 0})  # TTFT alone
    ctx = context(prompt=1000)
    assert scorer.score(ctx, [a, b])[1] < 0.1
    ctx.now = b.prefill_sampled_at + 11
    a.prefill_fit.sampled_at = ctx.now  # a keeps being observed
    assert scorer.score(ctx, [a, b]) == pytest.approx([1.0, 1.0])  # b: as fast as the fastest, until re-measured
    decoding = store.reserve(b, prompt_tokens=10)
    decoding.mark_first_token(learn=False)  # a long decode still running there changes nothing
    assert scorer.score(ctx, [a, b]) == pytest.approx([1.0, 1.0])
    store.reserve(b, prompt_tokens=1000)  # b has a request in prefill: its own fit counts again
    assert scorer.score(ctx, [a, b])[1] < 0.1


def test_ttft_estimate_counts_only_uncached_tokens(store):
    """A prefix believed cached on an endpoint is not prefill work there."""
    from extproc.prefix.match import PrefixMatch

    a, b, _ = store.all()
    for ep in (a, b):
        _observe(store, ep, [(x, 0.01 + 5e-5 * x) for x in (500, 4000) * 5])
    ctx = context(prompt=8000)
    ctx.prefix = PrefixMatch(prompt_tokens=8000, matched={a.address: 400}, block_size={a.address: 16})
    scores = build("ttft-estimate-scorer").score(ctx, [a, b])
    # a prefills 8,000 − 6,400 = 1,600 tokens after 6,400 cached, b all 8,000, each with its
    # attention at the default ratio (2,061 and 9,280 tokens of work); each also delays what
    # follows it by its own prefill (work_weight 1)
    work_a, work_b = prefill_work(1600, 6400), prefill_work(8000)
    assert scores[0] == 1.0 and scores[1] == pytest.approx((0.01 + 2 * 5e-5 * work_a) / (0.01 + 2 * 5e-5 * work_b), rel=0.1)
    assert ctx.data["predicted_ttft_s"][a.address] == pytest.approx(0.01 + 5e-5 * work_a, rel=0.1)
    store.reserve(a, prompt_tokens=9000)  # a's queue is longer but it still saves more: a stays
    assert build("ttft-estimate-scorer").score(ctx, [a, b])[0] == 1.0
    store.reserve(a, prompt_tokens=6000)  # past ~2 × the 7,219 tokens of work it saves: b wins by itself
    scores = build("ttft-estimate-scorer").score(ctx, [a, b])
    assert scores[1] == 1.0 and scores[0] < 1.0


def test_prefix_and_session_scorers(store):
    from extproc.prefix.match import PrefixMatch

    a, b, c = store.all()
    ctx = context(prompt=320)
    assert build("prefix-scorer").score(ctx, [a, b]) == [0.0, 0.0]
    ctx.prefix = PrefixMatch(prompt_tokens=320, matched={b.address: 10}, block_size={b.address: 16})
    assert build("prefix-scorer").score(ctx, [a, b]) == [0.0, 0.5]
    assert build("session-affinity-scorer").score(ctx, [a, b]) == [0.0, 0.0]
    ctx.session_endpoint = c.address
    assert build("session-affinity-scorer").score(ctx, [a, b, c]) == [0.0, 0.0, 1.0]


def test_ttft_estimate_scores_cost_differences_not_ratios_of_whole_costs(store):
    """A decode slowdown every endpoint would charge says nothing about where to go: adding the
    same decode context everywhere leaves the scores as they were. (Ratios of whole costs
    squeezed them towards 1 — a warm endpoint 0.3 s cheaper scored 1.0 against 0.73 with 150k
    tokens decoding everywhere — and the count balancers then moved requests off warm
    endpoints; decision 0180.)"""
    from extproc.prefix.match import PrefixMatch

    a, b, _ = store.all()
    for ep in (a, b):
        _observe(store, ep, [(x, 0.01 + 5e-5 * x) for x in (500, 4000) * 5])
    ctx = context(prompt=7200, output=1000)
    ctx.prefix = PrefixMatch(prompt_tokens=7200, matched={a.address: 375}, block_size={a.address: 16})  # 6,000 tokens warm on a
    scorer = build("ttft-estimate-scorer")
    idle = scorer.score(ctx, [a, b])
    assert idle[0] == 1.0 and idle[1] < 0.3  # a prefills 1,200 tokens, b 7,200
    for ep in (a, b):
        store.reserve(ep, prompt_tokens=0, context_tokens=150_000)
    assert scorer.score(ctx, [a, b]) == pytest.approx(idle, rel=1e-6)
    store.reserve(a, prompt_tokens=0, context_tokens=20_000)  # a decodes more: it costs more, in seconds
    busier = scorer.score(ctx, [a, b])
    assert busier[0] == pytest.approx(1.0) and idle[1] < busier[1] < 1.0


def test_cost_scores_are_the_ratio_of_costs_without_decode_load():
    from extproc.scheduling.plugins.scorers.ttft_estimate import cost_scores

    assert cost_scores([0.1, 0.2, 0.4], [0.1, 0.2, 0.4]) == pytest.approx([1.0, 0.5, 0.25])
    # decode seconds count like prefill seconds: 0.1 s of prefill saved, 0.3 s more decode
    assert cost_scores([0.1, 0.2], [0.5, 0.3]) == pytest.approx([0.1 / 0.3, 1.0])
    assert cost_scores([], []) == []
    assert cost_scores([0.0, 0.1], [0.0, 0.1]) == [1.0, 0.0]


def _load_aware():
    from extproc.config.schema import BUILTIN_PROFILES
    from extproc.pipeline.request import build_profile

    return build_profile("load-aware", BUILTIN_PROFILES["load-aware"])


def test_balancers_do_not_overturn_a_clear_ttft_lead_on_a_prefix_match(store):
    """The shared-system duplicates of decision 0180: the endpoint holding the prompt's prefix is
    clearly the cheaper by the TTFT cost (b costs ~0.4 × the best prefill cost more, scoring
    ~0.72 < 0.8) but busier by count (3 requests in flight, an engine queue, fuller KV). The count balancers' points
    for the idle b outweighed the cost's lead and the fleet prefilled the prefix again; now they
    choose only among endpoints the cost rates near-best. Without a prefix match, or with a
    near-tie, they decide as before (decision 0240)."""
    from extproc.prefix.match import PrefixMatch

    a, b, _ = store.all()
    for ep in (a, b):
        _observe(store, ep, [(x, 0.01 + 5e-5 * x) for x in (500, 4000) * 5])
    for _ in range(3):
        store.reserve(a, prompt_tokens=100)  # three short requests just sent to a
    a.engine, b.engine = engine(waiting=2, running=3, kv=0.5, blocks=50_000), engine(kv=0.1, blocks=50_000)
    profile = _load_aware()

    def pick(ctx):
        result = profile.run(ctx, [a, b])
        assert result.pick is not None
        return result.pick

    ctx = context(prompt=7200, output=1000)
    ctx.prefix = PrefixMatch(prompt_tokens=7200, matched={a.address: 125}, block_size={a.address: 16})  # 2,000 tokens warm
    chosen = pick(ctx)
    runner_up = chosen.fallbacks[0]
    assert chosen.primary.endpoint is a and runner_up.endpoint is b
    assert runner_up.total > chosen.primary.total  # the balancers alone would have sent it to b
    assert 0.6 < runner_up.parts["ttft-estimate-scorer"] < 0.8
    cold = context(prompt=7200, output=1000)  # no prefix anywhere: the total decides, as before
    assert pick(cold).primary.endpoint is b
    near = context(prompt=7200, output=1000)  # a holds 1 block (≥ min match is the index's job): a near-tie
    near.prefix = PrefixMatch(prompt_tokens=7200, matched={a.address: 8}, block_size={a.address: 16})
    assert pick(near).primary.endpoint is b


def test_max_score_picker_lead_keeps_every_candidate_in_the_fallbacks(store):
    from extproc.prefix.match import PrefixMatch
    from extproc.scheduling.framework import ScoredEndpoint

    a, b, c = store.all()
    picker = build("max-score-picker", {"lead_scorer": "cost"})
    scored = [ScoredEndpoint(a, 5.0, {"cost": 0.5}), ScoredEndpoint(b, 4.0, {"cost": 1.0}), ScoredEndpoint(c, 3.0, {"cost": 0.9})]
    ctx = context(prompt=320)
    assert picker.pick(ctx, scored).primary.endpoint is a  # no prefix: the total
    ctx.prefix = PrefixMatch(prompt_tokens=320, matched={b.address: 10}, block_size={b.address: 16})
    result = picker.pick(ctx, scored)
    assert result.primary.endpoint is b and [s.endpoint for s in result.fallbacks] == [a, c]
    # an endpoint an operator override zeroes is never kept for its lead
    zeroed = [ScoredEndpoint(a, 5.0, {"cost": 0.5}), ScoredEndpoint(b, 0.0, {"cost": 1.0})]
    assert picker.pick(ctx, zeroed).primary.endpoint is a
    with pytest.raises(PluginConfigError, match="lead_min_score"):
        build("max-score-picker", {"lead_min_score": 0})


def test_max_score_picker_floor_for_prefix_free_requests(store):
    """`lead_min_score_unmatched`: on a request no endpoint holds a prefix of, the balancers choose
    among the endpoints the cost rates at least that floor; a near-tie is still theirs, and
    without the setting the total alone decides (decision 0265)."""
    from extproc.scheduling.framework import ScoredEndpoint

    a, b, c = store.all()
    scored = [ScoredEndpoint(a, 5.0, {"cost": 0.4}), ScoredEndpoint(b, 4.0, {"cost": 1.0}), ScoredEndpoint(c, 4.5, {"cost": 0.6})]
    ctx = context(prompt=7200)
    assert build("max-score-picker", {"lead_scorer": "cost"}).pick(ctx, scored).primary.endpoint is a
    picker = build("max-score-picker", {"lead_scorer": "cost", "lead_min_score_unmatched": 0.5})
    result = picker.pick(ctx, scored)
    assert result.primary.endpoint is c  # a is more than a whole prefill behind; c within it, and ahead by total
    assert [s.endpoint for s in result.fallbacks] == [a, b]  # every candidate stays a fallback, by total
    assert picker.pick(ctx, scored[:1]).primary.endpoint is a  # nothing above the floor: every candidate counts
    with pytest.raises(PluginConfigError, match="lead_min_score_unmatched"):
        build("max-score-picker", {"lead_min_score_unmatched": 1.5})
    with pytest.raises(PluginConfigError, match="lead_min_score_unmatched needs lead_scorer"):  # it would bound nothing
        build("max-score-picker", {"lead_min_score_unmatched": 0.5})
    assert build("max-score-picker", {"lead_min_score_unmatched": None}).params.lead_min_score_unmatched is None  # YAML null: the default


def test_ttft_estimate_charges_decode_per_gpu():
    """An A100 reads KV ~1.6× slower than an H100 (72 against 44 ns per context token): an H100
    decoding 1.5× the A100's context is the cheaper decode, which the one constant for every GPU
    got the wrong way round (decision 0240)."""
    from extproc.config.schema import EndpointConfig
    from extproc.datastore.endpoints import Datastore

    gpus = {"10.0.0.1:8000": "h100", "10.0.0.2:8000": "NVIDIA-A100-SXM4-80GB", "10.0.0.3:8000": ""}
    store = Datastore([EndpointConfig(address=addr, models=["m"], labels={"gpu": g} if g else {}) for addr, g in gpus.items()])
    h100, a100, unlabelled = store.all()
    scorer = build("ttft-estimate-scorer")
    assert scorer.decode_model(h100)[0] == 4.4e-8
    assert scorer.decode_model(a100)[0] == 7.2e-8
    assert scorer.decode_model(unlabelled)[0] == 4.4e-8  # the parameter's default
    for ep in (h100, a100):
        _observe(store, ep, [(x, 0.01 + 5e-5 * x) for x in (500, 4000) * 5])
    store.reserve(h100, prompt_tokens=0, context_tokens=150_000)
    store.reserve(a100, prompt_tokens=0, context_tokens=100_000)
    scores = scorer.score(context(prompt=2000, output=1000), [h100, a100])
    assert scores[0] == pytest.approx(1.0) and scores[1] < 0.99
    flat = build("ttft-estimate-scorer", {"decode_s_per_context_token_by_gpu": {}, "decode_step_s_by_gpu": {}})
    assert flat.score(context(prompt=2000, output=1000), [h100, a100])[0] < 0.99  # one d: the A100 looked cheaper
    with pytest.raises(PluginConfigError, match="finite number >= 0"):
        build("ttft-estimate-scorer", {"decode_s_per_context_token_by_gpu": {"h100": -1.0}})


def test_ttft_estimate_charges_each_gpus_decode_step_floor():
    """A decode step reads the weights once whatever the batch: 6.4 ms on an H100, 10.5 on an
    A100 (8B model). An H100 decoding 60k tokens more context than an idle A100 still decodes a
    long answer faster (6.4 + 0.044 × 60 = 9.0 ms a step against 10.5); charged per context token
    alone, the A100 looked 2.6 ms a step cheaper and took the request (decision 0265)."""
    from extproc.config.schema import EndpointConfig
    from extproc.datastore.endpoints import Datastore

    gpus = {"10.0.0.1:8000": "h100", "10.0.0.2:8000": "NVIDIA-A100-SXM4-80GB", "10.0.0.3:8000": ""}
    store = Datastore([EndpointConfig(address=addr, models=["m"], labels={"gpu": g} if g else {}) for addr, g in gpus.items()])
    h100, a100, unlabelled = store.all()
    scorer = build("ttft-estimate-scorer")
    assert [scorer.decode_model(ep)[1] for ep in (h100, a100, unlabelled)] == [6.4e-3, 10.5e-3, 6.4e-3]
    for ep in (h100, a100):  # the same prefill speed: only the decode side differs
        _observe(store, ep, [(x, 0.01 + 5e-5 * x) for x in (500, 4000) * 5])
    store.reserve(h100, prompt_tokens=0, context_tokens=60_000)
    ask = context(prompt=500, output=1000)
    scores = scorer.score(ask, [h100, a100])
    assert scores[0] == 1.0 and scores[1] < 0.99
    no_floor = build("ttft-estimate-scorer", {"decode_step_s_by_gpu": {}})
    assert no_floor.score(ask, [h100, a100])[1] == 1.0  # the context read alone favoured the A100
    with pytest.raises(PluginConfigError, match="finite number >= 0"):
        build("ttft-estimate-scorer", {"decode_step_s_by_gpu": {"a100": float("nan")}})
    with pytest.raises(PluginConfigError, match="prefill_model.gpu_label"):  # one setting names the GPU label
        build("ttft-estimate-scorer", {"gpu_label": "accelerator"})


def test_ttft_estimate_counts_a_long_prompts_attention():
    """Prefill attention grows with the square of the prompt: a 41k-token prompt costs an engine
    ~75k tokens' worth of work. Counted in tokens alone, an idle A100 (67 µs/token) looked faster
    than an H100 (23.5 µs/token) with 200k tokens queued, and took 5.6 s (Mooncake conversation,
    decision 0265); counted with its attention, the H100 is the faster choice."""
    from extproc.config.schema import EndpointConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.datastore.prefill_fit import PREFILL_S_PER_TOKEN_BY_GPU

    gpus = {"10.0.0.1:8000": "h100", "10.0.0.2:8000": "a100"}
    store = Datastore(
        [EndpointConfig(address=addr, models=["m"], labels={"gpu": g}) for addr, g in gpus.items()],
        prefill_s_per_token_by_gpu=PREFILL_S_PER_TOKEN_BY_GPU,
    )
    h100, a100 = store.all()
    store.reserve(h100, prompt_tokens=200_000)  # long prompts queued, their work in the same units
    scorer = build("ttft-estimate-scorer", {"decode_weight": 0})
    ask = context(prompt=41_000, output=3)
    ask.attention_ratio = 0.0
    assert scorer.score(ask, [h100, a100])[1] == 1.0  # tokens alone: the idle A100
    ask.attention_ratio = 2e-5
    scores = scorer.score(ask, [h100, a100])
    assert scores[0] == 1.0 and scores[1] < 0.9
    assert ask.data["predicted_ttft_s"][a100.address] == pytest.approx(0.02 + 6.73e-5 * 74_620, rel=0.01)


@pytest.mark.parametrize("param", ["work_weight", "decode_s_per_context_token", "decode_step_s", "decode_weight"])
def test_ttft_estimate_refuses_an_infinite_weight_or_figure(param):
    """The GPU tables refused inf, the plain settings took it: `decode_step_s: .inf` on a fleet
    without GPU labels made every cost inf, every score NaN (zero once clamped) and the TTFT
    scorer silently nothing. Refused like the tables' entries."""
    with pytest.raises(PluginConfigError, match=param):
        build("ttft-estimate-scorer", {param: float("inf")})
    assert build("ttft-estimate-scorer", {param: 0.5}).params.model_dump()[param] == 0.5


@pytest.mark.parametrize("param", ["alpha", "beta", "gamma"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_compute_aware_weights_must_be_finite(param, value):
    """An infinite weight was taken and every score was inf / inf = NaN."""
    with pytest.raises(PluginConfigError, match=param):
        build("compute-aware-scorer", {param: value})


def test_one_gpu_label_setting_names_the_gpu_for_every_table():
    """`scheduling.prefill_model.gpu_label` picks the label for the fit's prior and for the
    scorer's decode model alike: two settings could name two labels and disagree about a GPU."""
    from extproc.config.schema import EndpointConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.datastore.prefill_fit import PREFILL_S_PER_TOKEN_BY_GPU

    cfgs = [EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"accelerator": "NVIDIA-A100-SXM4-80GB", "gpu": "h100"})]
    store = Datastore(cfgs, prefill_s_per_token_by_gpu=PREFILL_S_PER_TOKEN_BY_GPU, gpu_label="accelerator")
    (ep,) = store.all()
    assert ep.gpu == "NVIDIA-A100-SXM4-80GB" and ep.prefill_fit.s_per_token == 6.73e-5
    assert build("ttft-estimate-scorer").decode_model(ep) == (7.2e-8, 10.5e-3)
    store.add_endpoint(EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"accelerator": "H100"}))
    assert ep.gpu == "H100" and build("ttft-estimate-scorer").decode_model(ep) == (4.4e-8, 6.4e-3)


def test_ttft_estimate_charges_the_decodes_a_prefill_stalls(store):
    """Every step of a chunked prefill is also a step of every sequence decoding on the engine:
    a prefill of w tokens at s seconds each stalls n running decodes by about s·w each. Ten
    decodes on a and none on b make a cold 4k prefill there 0.25 × 10 × 0.2 s = 0.5 s dearer
    (decode_weight 0.25); the same request with 3,600 tokens cached on a stalls them for 400
    tokens only, and a wins (decision 0240)."""
    from extproc.prefix.match import PrefixMatch

    a, b, _ = store.all()
    for ep in (a, b):
        _observe(store, ep, [(x, 0.01 + 5e-5 * x) for x in (500, 4000) * 5])
    for _ in range(10):
        store.reserve(a, prompt_tokens=10).mark_first_token(learn=False)
    scorer = build("ttft-estimate-scorer")
    cold = scorer.score(context(prompt=4000, output=0), [a, b])  # no output: no decode-context term
    p = 0.01 + 2 * 5e-5 * 4000  # the best prefill cost: predicted TTFT + the work term
    assert cold[1] == pytest.approx(1.0) and cold[0] == pytest.approx(p / (p + 0.25 * 10 * 5e-5 * 4000), rel=0.05)
    warm = context(prompt=4000, output=0)
    warm.prefix = PrefixMatch(prompt_tokens=4000, matched={a.address: 225}, block_size={a.address: 16})
    assert scorer.score(warm, [a, b])[0] == pytest.approx(1.0)


def test_ttft_estimate_predicts_an_unobserved_endpoint_at_its_own_gpus_speed():
    """An idle A100 not yet observed was predicted with the fastest fit observed elsewhere (an
    H100's, 7k tokens in 0.22 s) and took the next cold 7k-token prompt, which it prefilled in
    0.64 s. With the GPU's own prior speed (67.3 µs/token for an A100) the H100 wins; an
    unlabelled endpoint is still predicted optimistically (decision 0255)."""
    from extproc.config.schema import EndpointConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.datastore.prefill_fit import PREFILL_S_PER_TOKEN_BY_GPU

    gpus = {"10.0.0.1:8000": "h100", "10.0.0.2:8000": "NVIDIA-A100-SXM4-80GB", "10.0.0.3:8000": ""}
    configs = [EndpointConfig(address=addr, models=["m"], labels={"gpu": g} if g else {}) for addr, g in gpus.items()]
    store = Datastore(configs, prefill_s_per_token_by_gpu=PREFILL_S_PER_TOKEN_BY_GPU)
    h100, a100, unlabelled = store.all()
    assert (h100.prefill_fit.s_per_token, a100.prefill_fit.s_per_token) == (2.35e-5, 6.73e-5)
    assert unlabelled.prefill_fit.s_per_token == 5e-5 and not unlabelled.prefill_fit.prior.known
    _observe(store, h100, [(7213, 0.22)])
    predicted = predicted_ttft_s([h100, a100, unlabelled], [7213] * 3)
    assert predicted[1] == pytest.approx(0.02 + 6.73e-5 * 7213)  # its prior: ~0.51 s, not the H100's 0.22
    assert predicted[2] == pytest.approx(predicted[0])  # no GPU known: the fastest observed fit
    scores = build("ttft-estimate-scorer").score(context(prompt=7213), [h100, a100])
    assert scores[0] == 1.0 and scores[1] < 0.6
    blind = Datastore(configs)  # no table: every endpoint starts from the one prior, as before
    assert not any(ep.prefill_fit.prior.known for ep in blind.all())


def _starved_fleet(store, explore_share: float):
    """Decision 0270's starvation: three identical endpoints (13 ms first tokens for a 100-token
    prompt), b measured three times while the host was busy (22 ms), the prefix-free floor at
    0.8. Picks one request at a time (light load), each answered in 13 ms wherever it goes.
    Returns (picks per endpoint, b's fit's prediction at the end)."""
    from extproc.config.schema import BUILTIN_PROFILES
    from extproc.pipeline.request import build_profile

    cfg = BUILTIN_PROFILES["load-aware"]
    picker = cfg.picker.model_copy(update={"params": {**cfg.picker.params, "lead_min_score_unmatched": 0.8, "explore_share": explore_share}})
    profile = build_profile("starved", cfg.model_copy(update={"picker": picker}))
    a, b, c = store.all()
    for ep in (a, c):
        _observe(store, ep, [(100, 0.013)] * 30)
    _observe(store, b, [(100, 0.022)] * 3)
    counts = collections.Counter()
    for i in range(3000):
        ctx = context(prompt=100)
        ctx.rng = random.Random(i)
        chosen = profile.run(ctx, [a, b, c]).pick.primary.endpoint
        counts[chosen.address] += 1
        _observe(store, chosen, [(100, 0.013)])
    return counts, b.prefill_fit.predict(100)


def test_an_endpoint_with_a_pessimistic_fit_is_explored_until_its_fit_converges(store):
    """Without exploration the pessimistic endpoint gets none of 3,000 picks and keeps its 22 ms
    (the fleet's cheapest endpoint takes every pick at light load); with the default share it is
    sent a few requests, at most the 1 % share, until its fit holds `explore_min_samples` fresh
    samples, and its prediction comes back to within 15 % of the 13 ms it really takes."""
    _, b, _ = store.all()
    counts, predicted = _starved_fleet(store, 0.0)
    assert counts[b.address] == 0 and predicted > 0.02
    fresh = Datastore([EndpointConfig(address=f"10.0.0.{i}:8000", models=["m"]) for i in (1, 2, 3)])
    counts, predicted = _starved_fleet(fresh, 0.01)
    assert 17 <= counts["10.0.0.2:8000"] <= 30, counts  # 20 fresh samples less its 3 slow ones, and the odd win
    assert predicted == pytest.approx(0.013, rel=0.15)
    assert fresh.get("10.0.0.2:8000").prefill_fit.fresh_samples(time.monotonic()) >= 20


def test_exploration_never_picks_an_endpoint_the_filters_removed_or_an_override_zeroed(store):
    from extproc.scheduling.framework import ScoredEndpoint

    a, b, c = store.all()
    _observe(store, a, [(100, 0.013)] * 30)
    picker = build("max-score-picker", {"explore_share": 0.05})
    zeroed = [ScoredEndpoint(a, 5.0, {}), ScoredEndpoint(b, 0.0, {})]  # b unlearned but zeroed
    picks = set()
    for i in range(400):
        ctx = context()
        ctx.rng = random.Random(i)
        picks.add(picker.pick(ctx, zeroed).primary.endpoint.address)
        picks.add(picker.pick(ctx, [ScoredEndpoint(a, 5.0, {})]).primary.endpoint.address)  # c filtered out
    assert picks == {a.address}
    explored = 0
    for i in range(400):
        ctx = context()
        ctx.rng = random.Random(i)
        explored += picker.pick(ctx, [ScoredEndpoint(a, 5.0, {}), ScoredEndpoint(c, 1.0, {})]).primary.endpoint is c
    assert 5 <= explored <= 40  # ~5 % of 400
    with pytest.raises(PluginConfigError):
        build("max-score-picker", {"explore_share": 0.2})  # bounded


def test_a_fit_starts_over_from_its_prior_after_a_minute_without_samples():
    from extproc.datastore.prefill_fit import FRESH_GAP_S, PrefillFit

    fit = PrefillFit()
    for _ in range(3):
        fit.add(100, 0.5, 0.0)  # a cold start, 40x slow
    assert fit.fresh_samples(1.0) == 3 and fit.fresh_samples(FRESH_GAP_S + 1) == 0
    fit.add(100, 0.013, FRESH_GAP_S + 1)
    assert fit.samples == 4 and fit.fresh_samples(FRESH_GAP_S + 1) == 1
    assert fit.predict(100) < 0.03  # the prior and the new sample only, not 0.5 s
