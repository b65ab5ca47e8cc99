"""Telemetry Prometheus metrics, on an injected registry.

Latency and usage follow the OpenTelemetry GenAI semantic conventions in Prometheus form
(STYLE.md habit 8: dashboards expect these names): `gen_ai.server.time_to_first_token` →
`gen_ai_server_time_to_first_token_seconds`, `gen_ai.server.time_per_output_token` →
`gen_ai_server_time_per_output_token_seconds`, `gen_ai.server.request.duration` →
`gen_ai_server_request_duration_seconds`, `gen_ai.client.token.usage` →
`gen_ai_client_token_usage`; attributes `gen_ai.request.model`, `server.address`,
`gen_ai.token.type` become labels with dots turned into underscores. Our own:
`llm_extproc_stream_latency_seconds{component}`, `llm_extproc_stream_errors_total{reason}`,
`llm_extproc_endpoint_backpressure_level{endpoint}`.

Label values must be bounded: the caller passes the canonical configured model name (never the
client's raw `model` string) and the configured endpoint address.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = [
    "ERROR_REASONS",
    "LATENCY_COMPONENTS",
    "TOKEN_TYPES",
    "TelemetryMetrics",
]

LATENCY_COMPONENTS = ("queue_prefill", "decode", "post_processing", "network")
ERROR_REASONS = ("client_abort", "client_error", "backend_error", "stream_error", "sse_limit")
"""`sse_limit`: the response broke the SSE parser's bounds (telemetry stopped; bytes passed)."""
TOKEN_TYPES = ("input", "output")

# TTFT from 10 ms (short prompt, idle engine) to 60 s (long prompt behind a queue).
TTFT_BUCKETS = (
    0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)
# Time per output token from 1 ms (small model, speculative decoding) to 2.5 s (preempted).
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)
# Request duration: the OpenTelemetry GenAI advice (0.01 · 2^k s up to 81.92 s), extended to 10 min.
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92, 163.84,
    327.68, 600.0,
)
# Token usage: the OpenTelemetry GenAI advice (powers of 4 from 1 to 4^13 tokens).
TOKEN_BUCKETS = tuple(float(4**k) for k in range(14))
# Decomposition components range from sub-millisecond (network tail) to minutes (decode).
COMPONENT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
)


class TelemetryMetrics:
    """The streaming telemetry metrics.

    Args:
        registry: where to register (tests pass a fresh `CollectorRegistry`).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        labels = ["gen_ai_request_model", "server_address"]
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Time from the request reaching the balancer to the first content event of a streamed response (seconds).",
            labels,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Mean time per output token after the first content event of a completed streamed response (seconds).",
            labels,
            buckets=TPOT_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "Time from the request reaching the balancer to the end of a completed response (seconds).",
            labels,
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.token_usage = Histogram(
            "gen_ai_client_token_usage",
            "Tokens per completed response, by type (input = prompt, output = completion).",
            ["gen_ai_token_type", *labels],
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.stream_latency = Histogram(
            "llm_extproc_stream_latency_seconds",
            "Latency decomposition of completed streamed responses by component "
            "(queue_prefill, decode, post_processing, network), in seconds.",
            ["component"],
            buckets=COMPONENT_BUCKETS,
            registry=registry,
        )
        self.stream_errors = Counter(
            "llm_extproc_stream_errors_total",
            "Responses that did not complete cleanly, by reason (client_abort, client_error, backend_error, stream_error, sse_limit).",
            ["reason"],
            registry=registry,
        )
        self.backpressure = Gauge(
            "llm_extproc_endpoint_backpressure_level",
            "Backpressure level of an endpoint from inter-token jitter: 0 none, 1 light, 2 heavy.",
            ["endpoint"],
            registry=registry,
        )
        # Children exist from the start so the series are visible at zero.
        for component in LATENCY_COMPONENTS:
            self.stream_latency.labels(component)
        for reason in ERROR_REASONS:
            self.stream_errors.labels(reason)
