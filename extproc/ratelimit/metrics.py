"""The rate limiter's Prometheus metrics (label `tenant` is a configured name or a short hash,
never a key: `tenant.TenantResolver`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from extproc.metrics import Metrics

__all__ = ["RateLimitMetrics"]


class RateLimitMetrics:
    """Registered on the server's registry; label children memoised by the server's `Metrics.child`
    (tenant labels are bounded: configured names, `max_tenant_labels` short hashes, `other`)."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.child = metrics.child
        self.requests = Counter(
            "llm_extproc_ratelimit_requests_total",
            "Rate-limit decisions per tenant: admitted, refused_tokens, refused_requests, refused_concurrency, "
            "refused_pacing, too_large, "
            "backend_error_open (admitted uncounted), backend_error_closed (refused).",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.tokens_charged = Counter(
            "llm_extproc_ratelimit_tokens_charged_total",
            "Tokens reserved at admission (prompt + output budget, or the size cost).",
            ["tenant"],
            registry=registry,
        )
        self.tokens_settled = Counter(
            "llm_extproc_ratelimit_tokens_settled_total",
            "Tokens finally counted for admitted requests once they ended (real usage).",
            ["tenant"],
            registry=registry,
        )
        self.tokens_refused = Counter(
            "llm_extproc_ratelimit_tokens_refused_total",
            "Tokens of requests refused by a rate limit: their cost, or the least they could cost when refused "
            "before counting (a refusal at the request headers, cost unknown, adds none).",
            ["tenant"],
            registry=registry,
        )
        self.window_tokens = Gauge(
            "llm_extproc_ratelimit_window_tokens",
            "Tokens in the tenant's 60 s window at its latest decision.",
            ["tenant"],
            registry=registry,
        )
        self.window_requests = Gauge(
            "llm_extproc_ratelimit_window_requests",
            "Requests in the tenant's 60 s window at its latest decision.",
            ["tenant"],
            registry=registry,
        )
        self.inflight = Gauge(
            "llm_extproc_ratelimit_inflight_requests",
            "The tenant's requests in flight (tenants with max_concurrent_requests): as counted at its latest "
            "decision (all replicas), less those this process saw end since.",
            ["tenant"],
            registry=registry,
        )
        self.backend_errors = Counter(
            "llm_extproc_ratelimit_backend_errors_total",
            "Backend calls that failed (Redis unreachable or timing out), by operation.",
            ["backend", "operation"],
            registry=registry,
        )
        self.settlements_pending = Gauge(
            "llm_extproc_ratelimit_settlements_pending",
            "Settlements the backend could not take (even after a retry on a fresh connection), held "
            "until it answers again; each keeps a concurrency slot and a reservation meanwhile.",
            registry=registry,
        )
        self.settlements_deferred = Counter(
            "llm_extproc_ratelimit_settlements_deferred_total",
            "Deferred settlements: queued (the backend failed), flushed (delivered once it answered again), "
            "dropped (the queue was full: the oldest gives way; its slot waits for its lease).",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("queued", "flushed", "dropped"):
            self.settlements_deferred.labels(outcome)
        self.decision_seconds = Histogram(
            "llm_extproc_ratelimit_decision_seconds",
            "Time for one rate-limit decision (one backend call), in seconds.",
            ["backend"],
            buckets=(0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=registry,
        )
