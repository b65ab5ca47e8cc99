"""The window's arithmetic (pure), OpenAI's duration strings and headers."""

from __future__ import annotations

import pytest

from extproc.ratelimit.replies import duration, ratelimit_headers
from extproc.ratelimit.window import ScopeLimit, ScopeUse, WindowState, decide, settle

N, MS = 60, 1000  # 60 one-second buckets


def _decide(states, limits, cost, now):
    return decide(states, limits, cost, now, N, MS)


def test_a_charge_counts_until_its_bucket_leaves_the_window():
    st = WindowState()
    lim = [ScopeLimit("a", tokens=100)]
    assert _decide([st], lim, 100, 999).admitted  # bucket 0, its last millisecond
    # Bucket 0 stays in the window through bucket 59 (t = 59.999 s) ...
    assert not _decide([st], lim, 1, 59_999).admitted
    # ... and leaves it when bucket 60 starts (t = 60.000 s): 59.001 s after this charge.
    assert _decide([st], lim, 100, 60_000).admitted


def test_a_charge_at_a_buckets_first_millisecond_counts_almost_60_s():
    st = WindowState()
    lim = [ScopeLimit("a", tokens=10)]
    assert _decide([st], lim, 10, 5_000).admitted  # bucket 5 starts
    assert not _decide([st], lim, 1, 64_999).admitted
    assert _decide([st], lim, 10, 65_000).admitted


def test_the_window_slides_bucket_by_bucket():
    st = WindowState()
    lim = [ScopeLimit("a", tokens=30)]
    for t in (0, 1_000, 2_000):  # 10 tokens in each of buckets 0, 1, 2
        assert _decide([st], lim, 10, t).admitted
    assert not _decide([st], lim, 10, 59_500).admitted
    d = _decide([st], lim, 10, 60_000)  # bucket 0 left: room for exactly 10
    assert d.admitted and d.uses[0].tokens == 30
    assert not _decide([st], lim, 1, 60_999).admitted
    d = _decide([st], lim, 10, 61_000)  # bucket 1 left
    assert d.admitted and d.uses[0].tokens == 30
    assert sorted(st.buckets) == [2, 60, 61]  # pruned as it slides


def test_retry_after_is_when_enough_has_left_the_window():
    st = WindowState()
    lim = [ScopeLimit("a", tokens=100)]
    _decide([st], lim, 40, 0)
    _decide([st], lim, 40, 10_000)
    d = _decide([st], lim, 50, 20_500)  # needs 30 more to leave: bucket 0 leaves at 60 s
    assert not d.admitted and d.refused_limit == "tokens"
    assert d.retry_after_ms == 60_000 - 20_500
    d = _decide([st], lim, 90, 20_500)  # needs 70: bucket 10 must leave too, at 70 s
    assert d.retry_after_ms == 70_000 - 20_500
    # Resets: until the newest charge leaves.
    assert d.uses[0].reset_tokens_ms == 70_000 - 20_500


def test_requests_are_checked_and_counted():
    st = WindowState()
    lim = [ScopeLimit("a", requests=2)]
    assert _decide([st], lim, 0, 0).admitted
    assert _decide([st], lim, 0, 100).admitted
    d = _decide([st], lim, 0, 200)
    assert not d.admitted and d.refused_limit == "requests" and d.retry_after_ms == 59_800


def test_all_scopes_are_charged_or_none():
    tenant, model = WindowState(), WindowState()
    lim = [ScopeLimit("t", tokens=100), ScopeLimit("t:m", tokens=30)]
    assert decide([tenant, model], lim, 30, 0, N, MS).admitted
    d = decide([tenant, model], lim, 10, 0, N, MS)
    assert not d.admitted and d.refused_scope == 1
    assert tenant.buckets[0] == [30, 1], "the tenant scope must not be charged when the model scope refuses"


def test_settle_returns_unused_tokens_to_the_charged_bucket():
    st = WindowState()
    lim = [ScopeLimit("a", tokens=100)]
    d = _decide([st], lim, 100, 0)
    settle([st], d.bucket, -70, 5_000, N, MS)
    assert _decide([st], lim, 70, 5_000).admitted
    assert not _decide([st], lim, 1, 5_000).admitted
    # The refund went to bucket 0, so 30 leave at 60 s and 70 at 65 s.
    assert _decide([st], lim, 30, 60_000).admitted


def test_settle_after_the_bucket_left_only_charges_extra_use():
    st = WindowState()
    d = _decide([st], [ScopeLimit("a")], 10, 0)
    settle([st], d.bucket, -10, 61_000, N, MS)  # bucket 0 is gone: nothing to give back
    assert st.buckets[0] == [10, 1]
    settle([st], d.bucket, +5, 61_000, N, MS)  # used more than reserved: charged now
    assert st.buckets[61][0] == 5


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, "0s"), (20, "20ms"), (999, "999ms"), (1000, "1s"), (1500, "1.5s"), (1250, "1.25s"), (59_001, "59.001s"),
     (60_000, "1m0s"), (360_000, "6m0s"), (90_500, "1m30.5s"), (3_723_000, "1h2m3s")],
)
def test_durations_are_openai_strings(ms, text):
    assert duration(ms) == text


def test_headers_come_from_the_tightest_scope():
    limits = [ScopeLimit("t", tokens=1000, requests=10), ScopeLimit("t:m", tokens=100)]
    uses = [ScopeUse(500, 3, 30_000, 40_000), ScopeUse(90, 3, 6_000, 6_000)]
    h = ratelimit_headers(limits, uses)
    assert h == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "40s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "10",
        "x-ratelimit-reset-tokens": "6s",
    }
