"""Streaming telemetry: watch each response (TTFT, ITL, usage, latency decomposition), keep
per-endpoint latency windows and backpressure, export the GenAI latency metrics.

* `observer.StreamObserver` — one per response, fed from the ext_proc response phases;
* `stats.EndpointStreamStats` — per endpoint (`endpoint.stream_stats`), read by scorers;
* `metrics.TelemetryMetrics` — the Prometheus side, on an injected registry.
"""
