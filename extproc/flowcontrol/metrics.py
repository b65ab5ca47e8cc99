"""Flow control's Prometheus metrics. Label `tenant` is a bounded set (configured names, the
rate limiter's labels — themselves bounded — short hashes of trusted fairness ids up to
`flow_control.max_tenant_labels`, then `other`); `band` is a priority class."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from extproc.metrics import Metrics

__all__ = ["FlowMetrics"]

_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_CYCLE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class FlowMetrics:
    """Registered on the server's registry; children memoised by `Metrics.child`."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.child = metrics.child
        self.queue_seconds = Histogram(
            "llm_extproc_flow_queue_seconds",
            "Seconds a request waited in a flow-control queue, by band and outcome "
            "(dispatched, expired, cancelled, failed, shutdown).",
            ["band", "outcome"],
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "llm_extproc_flow_requests_total",
            "Generation requests through flow control by outcome: immediate (no queue), queued, dispatched, "
            "queue_full (429), expired (503), cancelled (client left while queued), failed, shutdown (503), "
            "displaced (a streaming sheddable request evicted for a waiting critical one).",
            ["band", "outcome"],
            registry=registry,
        )
        self.queued = Gauge(
            "llm_extproc_flow_queued_requests", "Requests waiting in flow control, by band and tenant.", ["band", "tenant"], registry=registry
        )
        self.queued_bytes = Gauge(
            "llm_extproc_flow_queued_bytes", "Request-body bytes waiting in flow control, by band and tenant.", ["band", "tenant"], registry=registry
        )
        self.dispatch_cycle_seconds = Histogram(
            "llm_extproc_flow_dispatch_cycle_seconds",
            "Seconds one dispatch cycle took (every pool with waiting requests visited once).",
            buckets=_CYCLE_BUCKETS,
            registry=registry,
        )
        self.pool_saturated = Gauge(
            "llm_extproc_flow_pool_saturated",
            "1 while the model pool's gate refused its next queued request at the latest dispatch cycle.",
            ["model"],
            registry=registry,
        )
