"""Telemetry metrics: names, labels and buckets, and what one observed response records."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from extproc.telemetry.metrics import ERROR_REASONS, LATENCY_COMPONENTS, TelemetryMetrics
from tests.telemetry.telemetry_helpers import ENDPOINT, MODEL, MS, START, events_of, play, recorded

LABELS = {"gen_ai_request_model": MODEL, "server_address": ENDPOINT}


def buckets(registry: CollectorRegistry, name: str) -> list[float]:
    for family in registry.collect():
        if family.name == name:
            return sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")})
    raise AssertionError(f"no metric {name}")


def test_latency_buckets_cover_llm_ranges(metrics, registry):
    for hist in (metrics.ttft, metrics.tpot):
        hist.labels(MODEL, ENDPOINT)
    ttft = buckets(registry, "gen_ai_server_time_to_first_token_seconds")
    tpot = buckets(registry, "gen_ai_server_time_per_output_token_seconds")
    assert (ttft[0], ttft[-1]) == (0.01, 60.0)
    assert (tpot[0], tpot[-1]) == (0.001, 2.5)


def test_series_exist_at_zero(registry, metrics):
    for component in LATENCY_COMPONENTS:
        assert registry.get_sample_value("llm_extproc_stream_latency_seconds_count", {"component": component}) == 0
    for reason in ERROR_REASONS:
        assert registry.get_sample_value("llm_extproc_stream_errors_total", {"reason": reason}) == 0


def test_two_instances_on_separate_registries():
    TelemetryMetrics(CollectorRegistry())
    TelemetryMetrics(CollectorRegistry())  # no clash: nothing on the global registry


def test_a_completed_stream_records_everything(make_observer, registry):
    chunks = events_of(recorded("chat_reasoning.sse"))
    obs = make_observer()
    play(obs, chunks, [40 + 10 * i for i in range(len(chunks))])
    obs.on_end("complete", START + 304 * MS)
    value = registry.get_sample_value
    assert value("gen_ai_server_time_to_first_token_seconds_sum", LABELS) == pytest.approx(0.050)
    assert value("gen_ai_server_time_per_output_token_seconds_sum", LABELS) == pytest.approx(0.010)
    assert value("gen_ai_server_request_duration_seconds_sum", LABELS) == pytest.approx(0.304)
    assert value("gen_ai_client_token_usage_sum", {"gen_ai_token_type": "input", **LABELS}) == 24
    assert value("gen_ai_client_token_usage_sum", {"gen_ai_token_type": "output", **LABELS}) == 23
    for component, seconds in [("queue_prefill", 0.050), ("decode", 0.220), ("post_processing", 0.030), ("network", 0.004)]:
        assert value("llm_extproc_stream_latency_seconds_sum", {"component": component}) == pytest.approx(seconds)
    assert value("llm_extproc_endpoint_backpressure_level", {"endpoint": ENDPOINT}) == 0
    assert sum(value("llm_extproc_stream_errors_total", {"reason": r}) for r in ERROR_REASONS) == 0


def test_jittery_endpoint_sets_the_backpressure_gauge(make_observer, registry):
    # Content every 0 / 60 ms alternately: σ of the gaps = 30 ms ≥ 25 ms → heavy (2).
    chunks = events_of(recorded("completion.sse"))
    times = [50 + 30 * i + (30 if i % 2 else 0) for i in range(len(chunks))]
    obs = make_observer()
    play(obs, chunks, times)
    obs.on_end("complete")
    assert registry.get_sample_value("llm_extproc_endpoint_backpressure_level", {"endpoint": ENDPOINT}) == 2


def test_estimated_output_tokens_are_not_exported_as_usage(make_observer, registry):
    # Without usage the output count is an estimate from events: kept in the result, not exported.
    body = b"".join(e for e in events_of(recorded("completion.sse")) if b'"choices":[]' not in e)
    obs = make_observer()
    play(obs, [body], [30])
    assert obs.on_end("complete").tokens_source == "events"
    assert registry.get_sample_value("gen_ai_client_token_usage_count", {"gen_ai_token_type": "output", **LABELS}) is None


def test_our_prompt_count_fills_in_when_usage_is_missing(make_observer, registry):
    body = b'{"id":"x","object":"chat.completion","choices":[]}'
    obs = make_observer(prompt_tokens=321)
    play(obs, [body], [30], content_type="application/json")
    obs.on_end("complete")
    assert registry.get_sample_value("gen_ai_client_token_usage_sum", {"gen_ai_token_type": "input", **LABELS}) == 321
    assert registry.get_sample_value("gen_ai_client_token_usage_count", {"gen_ai_token_type": "output", **LABELS}) is None
