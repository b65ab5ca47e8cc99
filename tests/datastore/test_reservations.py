"""Reservation accounting: phases, KV blocks, settling on scrapes, idempotent release."""

from __future__ import annotations

import time

import pytest

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.prefill_fit import PREFILL_S_PER_TOKEN_BY_GPU, PrefillPrior, gpu_table, gpu_value, prefill_work, request_prefill_work


def make():
    store = Datastore([EndpointConfig(address="10.0.0.1:8000", models=["m"])])
    return store, store.all()[0]


def test_reserve_then_first_token_then_release():
    store, ep = make()
    r = store.reserve(ep, 10, prompt_tokens=500)
    assert (ep.inflight, ep.prefill_inflight, ep.decode_inflight, ep.reserved_blocks, ep.prefill_tokens) == (1, 1, 0, 10, 500)
    r.mark_first_token()
    r.mark_first_token()  # idempotent
    assert (ep.prefill_inflight, ep.decode_inflight, ep.prefill_tokens) == (0, 1, 0)
    r.release()
    r.release()  # idempotent
    assert (ep.inflight, ep.decode_inflight, ep.reserved_blocks, store.open_reservations) == (0, 0, 0, 0)


def test_blocks_settle_on_a_scrape_after_the_first_token():
    store, ep = make()
    r = store.reserve(ep, 10, settle_after_s=60)
    before = time.monotonic()
    assert store.settle_scraped(ep, before) == 0  # no first token yet: the engine may not show it
    r.mark_first_token(before + 0.01)
    assert store.settle_scraped(ep, before) == 0  # that scrape predates the first token
    assert store.settle_scraped(ep, before + 0.02) == 1
    assert ep.reserved_blocks == 0 and ep.inflight == 1  # still in flight, blocks now the engine's
    r.release()
    assert ep.reserved_blocks == 0 and ep.inflight == 0


def test_blocks_settle_after_the_deadline_without_a_first_token():
    store, ep = make()
    store.reserve(ep, 7, settle_after_s=0.5)
    assert store.settle_scraped(ep, time.monotonic()) == 0
    assert store.settle_scraped(ep, time.monotonic() + 1.0) == 1
    assert ep.reserved_blocks == 0


def test_release_before_settling_returns_the_blocks():
    store, ep = make()
    r = store.reserve(ep, 7)
    r.release()
    assert ep.reserved_blocks == 0 and not ep.unsettled


def test_unseen_counts_requests_since_the_last_scrape_started():
    store, ep = make()
    rs = [store.reserve(ep) for _ in range(3)]
    assert ep.unseen == 3
    ep.routed_at_scrape = ep.routed_total  # a scrape started now and succeeded
    store.reserve(ep)
    assert ep.unseen == 1
    for r in rs:
        r.release()
    assert ep.unseen == 1  # bounded by what is still in flight


def _a100_like() -> tuple[Datastore, object]:
    """One endpoint whose learned prefill speed starts at an A100's ~77 µs per token."""
    store = Datastore([EndpointConfig(address="10.0.0.1:8000", models=["m"])], PrefillPrior(t0_s=0.04, s_per_token=77e-6))
    return store, store.all()[0]


def test_prefill_already_computed_is_not_ahead():
    """A request routed 0.5 s into a cold 7,213-token prefill waits for what is left of it,
    not for all of it (the shared-system benchmark: predicted 685 ms, observed 259 ms)."""
    store, ep = _a100_like()
    t = time.monotonic()
    cold = store.reserve(ep, prompt_tokens=7213, now=t)
    assert cold.backlog_tokens == 7213 and ep.prefill_ahead(t) == 7213
    left = 7213 - 0.5 / 77e-6  # ~719 tokens
    assert ep.prefill_ahead(t + 0.5) == pytest.approx(left)
    warm = store.reserve(ep, prompt_tokens=1213, now=t + 0.5)
    assert warm.backlog_tokens == pytest.approx(left + 1213)  # was 8,426: the whole cold prompt
    assert ep.prefill_tokens == 8426  # the count of work routed and not past its first token is unchanged
    cold.mark_first_token(t + 0.6)  # its tokens leave the count; the warm one is computed from now on
    assert ep.prefill_tokens == 1213 and ep.prefill_ahead(t + 0.6) == 1213
    assert ep.prefill_ahead(t + 0.65) == pytest.approx(1213 - 0.05 / ep.prefill_fit.s_per_token)  # s as just learned
    assert ep.prefill_ahead(t + 5) == 0
    warm.release()  # ended in prefill: nothing left ahead, and a later request starts from zero
    assert ep.prefill_ahead(t + 5) == 0 and not ep.in_prefill
    later = store.reserve(ep, prompt_tokens=500, now=t + 6)
    assert later.backlog_tokens == 500 and ep.prefill_ahead(t + 6) == 500
    queued = store.reserve(ep, prompt_tokens=300, now=t + 6)  # behind it: only the oldest is credited
    assert queued.backlog_tokens == 800 and ep.prefill_ahead(t + 60) == 300


def test_prefill_fit_learns_an_engines_speed_from_overlapping_requests():
    """An engine prefilling 77 µs/token, first come first served, gets a cold 7,213-token prompt
    and then warm 1,213-token ones 0.2 s apart, each arriving while the previous is still in
    prefill: the fit learns 77 µs/token. Counting every routed prompt in full until its first
    token, it learned ~40 µs/token (the A100 of the shared-system benchmark) and predicted a
    cold prefill there at 372 ms that took 659."""
    store, ep = _a100_like()
    s, t0 = 77e-6, 0.04
    t = time.monotonic()
    arrivals = [(t + 0.2 * i, 7213 if i % 4 == 0 else 1213) for i in range(40)]
    free_at = t
    events = []  # (time, order, reservation index or None, tokens)
    done_at = []
    for at, tokens in arrivals:
        free_at = max(free_at, at) + s * tokens
        done_at.append(free_at + t0)
    reservations = []
    for i, (at, tokens) in enumerate(arrivals):
        events.append((at, 0, i, tokens))
        events.append((done_at[i], 1, i, tokens))
    for when, kind, i, tokens in sorted(events):
        if kind == 0:
            reservations.append(store.reserve(ep, prompt_tokens=tokens, now=when))
        else:
            reservations[i].mark_first_token(when)
    assert ep.prefill_fit.s_per_token == pytest.approx(s, rel=0.2)
    assert ep.prefill_fit.predict(7213) == pytest.approx(t0 + s * 7213, rel=0.15)


def test_only_the_oldest_leaving_prefill_restarts_the_credit():
    """A later request that ends, or gets its first token, before the oldest one (a client
    abort; a short prompt beside a long one under chunked prefill) takes only its own tokens out
    of the backlog: the oldest keeps the credit for the work done on it so far."""
    store, ep = _a100_like()
    t = 1000.0
    store.reserve(ep, prompt_tokens=10_000, now=t)
    short = store.reserve(ep, prompt_tokens=50, now=t + 0.01)
    aborted = store.reserve(ep, prompt_tokens=100, now=t + 0.02)
    before = ep.prefill_ahead(t + 0.4)
    short.mark_first_token(t + 0.4, learn=False)
    assert ep.prefill_ahead(t + 0.4) == pytest.approx(before - 50)
    aborted.release(t + 0.4)
    assert ep.prefill_ahead(t + 0.4) == pytest.approx(before - 150)


def test_the_oldest_released_in_prefill_restarts_the_credit_at_its_release_time():
    """An aborted oldest request leaves prefill when it is released: the next one is credited
    from then, on the caller's clock (a synthetic one in replays and tests)."""
    store, ep = _a100_like()
    t = 1000.0
    oldest = store.reserve(ep, prompt_tokens=10_000, now=t)
    store.reserve(ep, prompt_tokens=5_000, now=t + 0.1)
    oldest.release(t + 0.3)
    assert ep.prefill_ahead(t + 0.5) == pytest.approx(5_000 - 0.2 / 77e-6)


def test_a_leave_time_in_the_future_does_not_stop_the_credit():
    """A leave stamped on another clock (seconds since the epoch, not monotonic) is far in the
    future: it stuck under `max` and nothing ahead was ever credited again."""
    store, ep = _a100_like()
    t = 1000.0
    wrong = store.reserve(ep, prompt_tokens=2_000, now=t)
    store.reserve(ep, prompt_tokens=10_000, now=t)
    wrong.release(1.7e9)  # time.time() instead of time.monotonic()
    assert ep.prefill_ahead(t + 0.5) == pytest.approx(10_000 - 0.5 / 77e-6)  # credited since it was routed
    store.reserve(ep, prompt_tokens=1_000, now=t + 0.5)
    next(iter(ep.in_prefill)).release(t + 1.0)  # the next leave, on the right clock, restarts the credit
    assert ep.prefill_ahead(t + 1.05) == pytest.approx(1_000 - 0.05 / 77e-6)


def test_a_request_with_no_prefill_work_is_never_the_oldest_in_prefill():
    """A passthrough (GET /v1/models through the gateway) or a fully cached prompt reserves no
    prefill tokens: at the head of the queue it blocked every credit, and leaving it reset it."""
    store, ep = _a100_like()
    t = 1000.0
    passthrough = store.reserve(ep, now=t)
    store.reserve(ep, prompt_tokens=10_000, now=t)
    assert ep.prefill_ahead(t + 0.5) == pytest.approx(10_000 - 0.5 / 77e-6)
    passthrough.release()
    assert ep.prefill_ahead(t + 0.5) == pytest.approx(10_000 - 0.5 / 77e-6)


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("NVIDIA-A100-SXM4-80GB", 6.73e-5),  # GPU feature discovery's form
        ("NVIDIA H100 80GB HBM3", 2.35e-5),
        ("a100", 6.73e-5),
        ("NVIDIA RTX A1000", None),  # a workstation card, not an A100
        ("GA100", None),
        ("", None),
    ],
)
def test_a_gpu_label_names_a_table_entry_as_a_whole_word(label, expected):
    assert gpu_value(label, PREFILL_S_PER_TOKEN_BY_GPU) == expected


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"a100": float("inf")}, "finite"),  # an endpoint predicted at inf forever, never learning
        ({"a100": float("nan")}, "finite"),
        ({"a100": 0.0}, "> 0"),
        ({" ": 1e-5}, "non-empty"),  # matched every label with a space
        ({"H100": 1e-5, "h100": 9e-5}, "listed twice"),  # silently merged
        ({"a100": True}, "must be a number > 0, got True"),  # YAML `yes`: was 1.0 s per token
        ({"a100": "6.7e-5"}, "must be a number > 0, got '6.7e-5'"),  # was coerced to a number
        ({"a100": None}, "must be a number > 0, got None"),
        ({1: 1e-5}, "GPU names must be strings"),
        ([("a100", 1e-5)], "must be a mapping"),
    ],
)
def test_a_gpu_table_refuses_what_would_mislead_the_fit(table, message):
    with pytest.raises(ValueError, match=message):
        gpu_table(table, "prefill seconds per token")
    assert gpu_table({" A100 ": 1e-5}, "x") == {"a100": 1e-5}


def test_a_gpu_table_takes_an_int_as_a_float():
    table = gpu_table({"a100": 1}, "x")
    assert table == {"a100": 1.0} and type(table["a100"]) is float


def test_a_changed_gpu_label_restarts_the_prefill_fit_at_that_gpus_speed():
    """A reload that fixes a mislabelled endpoint (or a new GPU behind the address) starts its
    fit again from the new GPU's prior; other label changes keep what was learned."""
    store = Datastore([EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"gpu": "A10O"})], prefill_s_per_token_by_gpu=PREFILL_S_PER_TOKEN_BY_GPU)
    (ep,) = store.all()
    assert not ep.prefill_fit.prior.known
    store.add_endpoint(EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"gpu": "A100"}))
    assert ep.prefill_fit.prior.known and ep.prefill_fit.s_per_token == 6.73e-5
    ep.prefill_fit.add(1000, 0.2, 1.0)
    store.add_endpoint(EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"gpu": "A100", "zone": "b"}))
    assert ep.prefill_fit.samples == 1


def test_a_gpu_label_changed_only_in_case_keeps_the_prefill_fit():
    """The per-GPU tables match labels in any case, so "H100" → "h100" on a reload names the
    same GPU: the fit it had learned was thrown away."""
    store = Datastore([EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"gpu": "H100"})], prefill_s_per_token_by_gpu=PREFILL_S_PER_TOKEN_BY_GPU)
    (ep,) = store.all()
    ep.prefill_fit.add(1000, 0.2, 1.0)
    store.add_endpoint(EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"gpu": "h100"}))
    assert ep.prefill_fit.samples == 1 and ep.gpu == "h100"
    store.add_endpoint(EndpointConfig(address="10.0.0.1:8000", models=["m"], labels={"gpu": "a100"}))
    assert ep.prefill_fit.samples == 0 and ep.prefill_fit.s_per_token == 6.73e-5  # another GPU: learned again


def test_an_ipv6_endpoint_is_found_in_any_spelling_of_its_address():
    store = Datastore([EndpointConfig(address="[2001:db8::1]:8000", models=["m"])])
    (ep,) = store.all()
    assert store.get("[2001:DB8:0::1]:8000") is ep and store.get("[2001:db8::1]:8001") is None


def test_prefill_work_counts_attention_over_the_cached_prefix_and_the_new_tokens():
    """m new tokens after p cached cost m + r·m·(2p + m) linear-token equivalents (the
    simulator's calibrated q·m·(2p + m) over its b): 2 % more at 1k tokens, 82 % at 41k."""
    assert prefill_work(1000) == 1020
    assert prefill_work(41_000) == 41_000 + 33_620
    assert prefill_work(1000, cached=6000) == 1000 + 260  # the new tokens attend to the cached prefix
    assert prefill_work(1000, 0, attention_ratio=0.0) == 1000
    assert prefill_work(-5, -3) == 0


def test_a_batched_completions_prompts_attend_each_within_itself():
    """100 prompts of 1,000 tokens in one completion are 100 × 1,020 of work, not the square of
    their 100k-token sum (300k); one prompt is `prefill_work` of its uncached tokens."""
    assert request_prefill_work(100_000, 100_000, 2e-5, (1000,) * 100) == 102_000
    assert request_prefill_work(100_000, 99_000, 2e-5, (1000,) * 100) == 101_000  # 1k cached: linear
    assert request_prefill_work(7000, 1000, 2e-5) == prefill_work(1000, 6000) == 1260
