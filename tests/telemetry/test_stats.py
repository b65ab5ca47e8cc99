"""EndpointStreamStats: pressure from synthetic gap sequences, the latency bucket, the cap factor,
window bounds, P95 TTFT, ITL means, snapshot caching and parameter validation."""

from __future__ import annotations

import pydantic
import pytest

from extproc.telemetry.stats import EndpointStreamStats, Pressure, StreamStatsParams

S = 1_000_000_000  # ns
T0 = 100 * S


def with_gaps(gaps_ms: list[float], **params) -> EndpointStreamStats:
    st = EndpointStreamStats(StreamStatsParams(snapshot_ttl_s=0, **params), clock_ns=lambda: T0)
    for i, g in enumerate(gaps_ms):
        st.record_gap(g / 1e3, T0 - (len(gaps_ms) - i) * 1_000_000)
    return st


@pytest.mark.parametrize(
    ("gaps_ms", "params", "expected"),
    [
        ([20.0] * 32, {}, Pressure.NONE),  # steady decode: σ = 0
        ([10.0, 36.0] * 16, {}, Pressure.NONE),  # σ = 13 ms
        ([5.0, 40.0] * 16, {}, Pressure.LIGHT),  # σ = 17.5 ms
        ([0.0, 60.0] * 16, {}, Pressure.HEAVY),  # σ = 30 ms
        ([20.0] * 28 + [120.0] * 4, {}, Pressure.HEAVY),  # a stall: σ ≈ 33 ms
        ([0.0, 60.0] * 3, {}, Pressure.NONE),  # σ = 30 ms but only 6 < 8 samples
        ([10.0, 36.0] * 16, {"light_stddev_ms": 10, "heavy_stddev_ms": 12}, Pressure.HEAVY),
        ([10.0, 36.0] * 16, {"light_stddev_ms": 10, "heavy_stddev_ms": 14}, Pressure.LIGHT),
    ],
    ids=["steady", "sigma-13", "sigma-17.5", "sigma-30", "stall", "too-few", "custom-heavy", "custom-light"],
)
def test_pressure_from_gap_jitter(gaps_ms, params, expected):
    assert with_gaps(gaps_ms, **params).pressure() is expected


@pytest.mark.parametrize(
    ("gaps_ms", "score"),
    [([], 1.0), ([30.0] * 4, 1.0), ([49.9] * 4, 1.0), ([50.0] * 4, 0.6), ([120.0] * 4, 0.6), ([200.0] * 4, 0.6), ([250.0] * 4, 0.1)],
    ids=["idle", "fast", "just-fast", "50ms", "medium", "200ms", "slow"],
)
def test_latency_bucket_score(gaps_ms, score):
    # The design notes' buckets on the mean recent gap: < 50 ms → 1.0, 50–200 ms → 0.6, > 200 ms → 0.1.
    st = with_gaps(gaps_ms)
    assert st.snapshot().latency_score == st.latency_score() == score


@pytest.mark.parametrize(
    ("gaps_ms", "factor"),
    [([20.0] * 16, 1.0), ([5.0, 40.0] * 8, 0.75), ([0.0, 60.0] * 8, 0.5)],
    ids=["none", "light", "heavy"],
)
def test_inflight_cap_factor_follows_pressure(gaps_ms, factor):
    st = with_gaps(gaps_ms)
    assert st.snapshot().inflight_cap_factor == st.inflight_cap_factor() == factor


def test_custom_cap_factors():
    st = with_gaps([0.0, 60.0] * 8, light_cap_factor=0.9, heavy_cap_factor=0.3)
    assert st.snapshot().inflight_cap_factor == 0.3


def test_gap_window_forgets_old_jitter():
    # A burst of jitter 20 s ago has left the 10 s window; only the steady recent gaps count.
    now = [T0]
    st = EndpointStreamStats(StreamStatsParams(snapshot_ttl_s=0), clock_ns=lambda: now[0])
    for i in range(16):
        st.record_gap((0.0, 0.060)[i % 2], T0 - 20 * S)
    for _ in range(16):
        st.record_gap(0.020, T0)
    snap = st.snapshot()
    assert (snap.gap_samples, snap.pressure) == (16, Pressure.NONE)
    assert snap.gap_mean_s == pytest.approx(0.020)


def test_gap_window_is_count_bounded():
    st = with_gaps([0.0, 60.0] * 200 + [20.0] * 16, gap_max_samples=16)
    snap = st.snapshot()
    assert (snap.gap_samples, snap.pressure, snap.gap_stddev_s) == (16, Pressure.NONE, pytest.approx(0.0))


def test_ttft_p95_itl_and_counts():
    st = EndpointStreamStats(StreamStatsParams(snapshot_ttl_s=0), clock_ns=lambda: T0)
    for ms in range(100, 0, -1):  # 1..100 ms, in any order
        st.record_end(ok=True, ttft_s=ms / 1e3, itl_s=0.010, now_ns=T0)
    for itl in (0.020, 0.030):
        st.record_end(ok=True, ttft_s=None, itl_s=itl, now_ns=T0)
    st.record_end(ok=False, ttft_s=None, itl_s=None, now_ns=T0)
    snap = st.snapshot()
    assert snap.ttft_p95_s == pytest.approx(0.095)  # nearest rank: the 95th of 100
    assert snap.ttft_samples == 100 and snap.itl_samples == 102
    assert snap.itl_mean_s == pytest.approx((100 * 0.010 + 0.020 + 0.030) / 102)
    assert snap.itl_recent_s == pytest.approx((6 * 0.010 + 0.020 + 0.030) / 8)  # the newest 8
    assert (snap.completed, snap.failed) == (102, 1)
    assert st.ttft_p95_s() == snap.ttft_p95_s  # the accessor the compute-aware scorer calls


def test_tokens_per_event_is_a_moving_average():
    st = EndpointStreamStats(clock_ns=lambda: T0)
    assert st.tokens_per_event == 1.0  # nothing learned yet
    st.record_end(ok=True, ttft_s=None, itl_s=None, tokens_per_event=4.0)
    assert st.tokens_per_event == 4.0
    st.record_end(ok=True, ttft_s=None, itl_s=None, tokens_per_event=1.0)
    assert st.tokens_per_event == pytest.approx(0.8 * 4.0 + 0.2 * 1.0)


def test_empty_stats():
    snap = EndpointStreamStats(clock_ns=lambda: T0).snapshot()
    assert (snap.ttft_p95_s, snap.itl_mean_s, snap.itl_recent_s, snap.gap_mean_s, snap.gap_stddev_s) == (None,) * 5
    assert (snap.pressure, snap.latency_score, snap.inflight_cap_factor) == (Pressure.NONE, 1.0, 1.0)


def test_ttft_window_expires():
    now = [T0]
    st = EndpointStreamStats(StreamStatsParams(window_s=60, snapshot_ttl_s=0), clock_ns=lambda: now[0])
    st.record_end(ok=True, ttft_s=2.0, itl_s=None)
    now[0] += 61 * S
    st.record_end(ok=True, ttft_s=0.1, itl_s=None)
    assert st.snapshot().ttft_p95_s == 0.1


def test_snapshot_is_reused_within_its_ttl():
    now = [T0]
    st = EndpointStreamStats(StreamStatsParams(snapshot_ttl_s=0.1), clock_ns=lambda: now[0])
    first = st.snapshot()
    st.record_end(ok=True, ttft_s=0.5, itl_s=None)
    assert st.snapshot() is first  # cheap: no recomputation within 100 ms
    now[0] += 100_000_000
    assert st.snapshot().ttft_p95_s == 0.5


@pytest.mark.parametrize(
    "params",
    [
        {"light_stddev_ms": 30, "heavy_stddev_ms": 25},
        {"fast_gap_ms": 300},
        {"light_cap_factor": 0},
        {"heavy_cap_factor": 1.5},
        {"min_gap_samples": 1},
        {"gap_max_samples": 4, "min_gap_samples": 8},
        {"window": 60},
    ],
    ids=["light-above-heavy", "fast-above-slow", "zero-cap", "cap-above-one", "one-sample", "min-above-max", "unknown-key"],
)
def test_invalid_params_are_errors(params):
    with pytest.raises(pydantic.ValidationError):
        StreamStatsParams(**params)
