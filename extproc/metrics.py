"""Every Prometheus metric of the ext_proc server, on an injected registry.

Names follow `llm_extproc_<subsystem>_<what>_<unit>`; label values are bounded (endpoints
come from configuration, reasons from the error tree, phases from a fixed list). No request
content, user id, API key or authorization header ever becomes a label.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics", "DECISION_PHASES", "ENDPOINT_LABELS", "remove_label_value"]

ENDPOINT_LABELS = ("endpoint", "server_address")
"""Label names whose value is an endpoint address (`server_address`: the telemetry metrics)."""

DECISION_PHASES = ("parse", "tokenize", "truncate", "schedule", "total")

# Decisions are sub-millisecond to tens of milliseconds (tokenizing long prompts).
_DECISION_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
# A scrape and a predicted KV transfer: a millisecond to a second.
_MILLIS_TO_SECOND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class Metrics:
    """The server's metrics.

    Args:
        registry: where to register (tests pass a fresh `CollectorRegistry`).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._children: dict[int, dict[str | tuple[str, ...], Any]] = {}
        """Memoised children per metric (`id`), keyed by the label value (one label) or the
        tuple of values (several)."""
        self.requests = Counter(
            "llm_extproc_requests_total",
            "Requests seen by the ext_proc server, by outcome (routed, rejected, passthrough) and reason.",
            ["outcome", "reason"],
            registry=registry,
        )
        self.epp_served = Counter(
            "llm_extproc_epp_served",
            "Endpoint Picker Protocol mode: routed generation requests by what the gateway reported at the "
            "response: served on the primary, on another endpoint (a retry down the fallback list), or not "
            "reported (the gateway sends no x-gateway-destination-endpoint-served)",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_inflight = Gauge(
            "llm_extproc_endpoint_inflight_requests",
            "Requests routed to an endpoint whose ext_proc stream has not ended yet.",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_healthy = Gauge(
            "llm_extproc_endpoint_healthy",
            "1 when the endpoint's health probes pass, else 0.",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_routed = Counter(
            "llm_extproc_endpoint_routed_requests_total",
            "Requests routed to each endpoint.",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_ejections = Counter(
            "llm_extproc_endpoint_ejections_total",
            "Times outlier detection ejected the endpoint for answering 5xx in a row.",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_reserved_blocks = Gauge(
            "llm_extproc_endpoint_reserved_kv_blocks",
            "KV blocks reserved by requests routed to the endpoint that its metrics do not show yet.",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_weight = Gauge(
            "llm_extproc_endpoint_weight",
            "The endpoint's current weighted score under the active profile (as in /api/v1/weights).",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_score = Gauge(
            "llm_extproc_endpoint_score_component",
            "Each scorer's value (0..1, before weighting) for the endpoint under the active profile, for the "
            "reference request of /api/v1/weights; updated on every scrape.",
            ["endpoint", "scorer"],
            registry=registry,
        )
        self.endpoint_override_factor = Gauge(
            "llm_extproc_endpoint_weight_override_factor",
            "An operator's override on the endpoint's score (0 drained, <1 lowered, 1 none); set by "
            "the admin webhook or POST /api/v1/weights/override, expires by itself.",
            ["endpoint"],
            registry=registry,
        )
        self.weight_overrides = Counter(
            "llm_extproc_weight_overrides_total",
            "Weight overrides applied, by source (alertmanager, api) and action (lower, drain, clear).",
            ["source", "action"],
            registry=registry,
        )
        self.scrape_seconds = Histogram(
            "llm_extproc_endpoint_scrape_duration_seconds",
            "Time to scrape and parse an endpoint's engine metrics, in seconds.",
            ["endpoint"],
            buckets=_MILLIS_TO_SECOND_BUCKETS,
            registry=registry,
        )
        self.scrape_errors = Counter(
            "llm_extproc_endpoint_scrape_errors_total",
            "Failed or timed-out scrapes of an endpoint's engine metrics.",
            ["endpoint"],
            registry=registry,
        )
        self.endpoint_metrics_age = Gauge(
            "llm_extproc_endpoint_metrics_age_seconds",
            "Seconds since the endpoint's engine metrics were last scraped successfully.",
            ["endpoint"],
            registry=registry,
        )
        self.decision_seconds = Histogram(
            "llm_extproc_decision_duration_seconds",
            "Time to decide a request, by phase (parse, tokenize, truncate, schedule, total), in seconds.",
            ["phase"],
            buckets=_DECISION_BUCKETS,
            registry=registry,
        )
        self.plugin_seconds = Histogram(
            "llm_extproc_scheduler_plugin_duration_seconds",
            "Time spent in each scheduling plugin per cycle, in seconds.",
            ["plugin"],
            buckets=(0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.005),
            registry=registry,
        )
        self.prompt_tokens = Histogram(
            "llm_extproc_prompt_tokens",
            "Prompt tokens per routed generation request (chat template applied).",
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.streams_active = Gauge(
            "llm_extproc_grpc_streams_active",
            "ext_proc gRPC streams currently open.",
            registry=registry,
        )
        self.lora_routed = Counter(
            "llm_extproc_lora_requests_total",
            "Requests for a LoRA adapter routed, by base model, adapter (a configured adapter's name, "
            "else `other`: names learned from engines are unbounded) and the adapter's residency on the "
            "chosen endpoint as the router believed it (gpu, cpu, free, evictable, full): anything but gpu "
            "is an adapter load the routing caused.",
            ["model", "adapter", "residency"],
            registry=registry,
        )
        self.token_estimates = Counter(
            "llm_extproc_tokenizer_estimates_total",
            "Requests routed on a character estimate of their prompt tokens because exact counting "
            "exceeded its share of the decision budget (the context check is then left to the engine).",
            ["model"],
            registry=registry,
        )
        self.tokenizer_cache_hits = Counter(
            "llm_extproc_tokenizer_cache_hits_total",
            "Prompt segments found in the token cache.",
            ["model"],
            registry=registry,
        )
        self.tokenizer_cache_misses = Counter(
            "llm_extproc_tokenizer_cache_misses_total",
            "Prompt segments tokenized afresh.",
            ["model"],
            registry=registry,
        )
        self.priority_claims_bounded = Counter(
            "llm_extproc_priority_claims_bounded_total",
            "Priority claims above what the request may claim (admission.priority.claimable), "
            "by claimed class and action (downgraded, rejected).",
            ["claimed", "action"],
            registry=registry,
        )
        self.health_panic = Gauge(
            "llm_extproc_health_panic",
            "1 while fewer than scheduling.health_check.panic_threshold of some model's endpoints pass their "
            "probes and routing uses every live endpoint instead (Envoy's panic mode), else 0.",
            registry=registry,
        )
        self.disagg_decisions = Counter(
            "llm_extproc_disagg_decision_total",
            "P/D disaggregation decisions (prefill-decode or decode-only) and why "
            "(long_prompt, short_prompt, no_prefill_endpoint, disabled, no_decode_endpoint).",
            ["decision", "reason"],
            registry=registry,
        )
        self.disagg_transfer_seconds = Histogram(
            "llm_extproc_disagg_kv_transfer_seconds",
            "Predicted KV transfer time of disaggregated requests (prompt KV bytes / link bandwidth), per model, in seconds.",
            ["model"],
            buckets=_MILLIS_TO_SECOND_BUCKETS,
            registry=registry,
        )
        self.health_panic_entered = Counter(
            "llm_extproc_health_panic_entered_total",
            "Times routing for a model entered health panic mode.",
            registry=registry,
        )

        self.output_tokens_estimate = Gauge(
            "llm_extproc_output_tokens_estimate",
            "Per model, the learned output length (tokens per sequence: a high quantile of recent completed "
            "responses, models[].output_estimate) that caps max_tokens in the scheduler's decode cost; absent "
            "until min_samples completions were observed.",
            ["model"],
            registry=registry,
        )
        self.truncations = Counter(
            "llm_extproc_truncation_requests_total",
            "Requests whose over-long prompt was cut by head + tail truncation, per model.",
            ["model"],
            registry=registry,
        )
        self.truncated_tokens = Counter(
            "llm_extproc_truncation_dropped_tokens_total",
            "Prompt tokens removed by head + tail truncation, per model.",
            ["model"],
            registry=registry,
        )

        self.decision_log_dropped = Counter(
            "llm_extproc_decision_log_dropped_total",
            "Decision log lines dropped because the writer thread's queue was full or the write failed (disk full).",
            registry=registry,
        )

    def _children_of(self, metric: Any) -> dict[str | tuple[str, ...], Any]:
        children = self._children.get(id(metric))
        if children is None:
            children = self._children[id(metric)] = {}
        return children

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, memoised. prometheus_client validates and locks on every
        `labels()` call (a few microseconds; a decision touches ~15 children), and every label
        value here comes from a bounded set (phases, plugins, endpoints, models, reasons)."""
        children = self._children_of(metric)
        key = values[0] if len(values) == 1 else values
        found = children.get(key)
        if found is None:
            found = children[key] = metric.labels(*values)
        return found

    def observe_each(self, metric: Any, values: Mapping[str, float]) -> None:
        """`child(metric, label).observe(value)` for each (label, value) of `values`, on a
        histogram with one label (the decision's phases, the scheduling plugins: a decision
        observes ~20), with one lookup of the metric's children for all of them."""
        children = self._children_of(metric)
        for label, value in values.items():
            found = children.get(label)
            if found is None:
                found = children[label] = metric.labels(label)
            found.observe(value)

    def forget_endpoint(self, address: str) -> int:
        """An endpoint left the fleet: every series of every metric on this registry whose
        endpoint label (`endpoint`, or the OpenTelemetry GenAI `server_address` of the telemetry
        histograms) is `address` goes, and so do the memoised children. Returns how many series
        were removed."""
        for children in self._children.values():
            for key in [k for k in children if k == address or (isinstance(k, tuple) and address in k)]:
                del children[key]
        return sum(remove_label_value(self.registry, label, address) for label in ENDPOINT_LABELS)


def remove_label_value(registry: CollectorRegistry, label: str, value: str) -> int:
    """Remove from every labelled metric on `registry` the children whose `label` is `value`
    (an endpoint that left: its series must not linger at their last value). Returns how many.

    Walks the registry rather than a list of metrics, so a metric added later with an
    `endpoint` label is covered without touching this; it reads prometheus_client's
    `_labelnames` / `_metrics` (stable since 0.4), and removes through the public `remove()`.
    """
    removed = 0
    collectors = list(getattr(registry, "_collector_to_names", {}))
    for metric in collectors:
        names = getattr(metric, "_labelnames", ())
        if label not in names:
            continue
        i = names.index(label)
        with metric._lock:
            keys = [k for k in metric._metrics if k[i] == value]
        for k in keys:
            try:
                metric.remove(*k)
                removed += 1
            except KeyError:  # removed concurrently
                pass
    return removed
