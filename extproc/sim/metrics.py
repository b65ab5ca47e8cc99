"""vLLM's `/metrics`, rendered from the engine's state at scrape time.

A custom prometheus-client collector registered on an injected `CollectorRegistry`: gauges are
read from the live engine, counters and histograms from `EngineStats` (simulated seconds), so a
scrape costs O(buckets) and the engine pays nothing per token for metrics. Names, types and the
`model_name` label follow vLLM V1 (`vllm/v1/metrics/loggers.py`); `legacy=True` renames the two
metrics older vLLM exposed differently (`vllm:gpu_cache_usage_perc`,
`vllm:time_per_output_token_seconds`), as both kinds run in real fleets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.sim.engine import Engine
from extproc.sim.pd import NixlStats
from extproc.sim.stats import Histogram

__all__ = ["SimMetricsCollector", "register_metrics"]


class SimMetricsCollector(Collector):
    """Collects vLLM-named metrics from an engine.

    Args:
        engine: returns the current engine (it is replaced on restart, so pass a getter).
        model_name: the `model_name` label value (the served model name).
        legacy: emit the pre-V1 names for KV usage and TPOT.
    """

    def __init__(self, engine: Callable[[], Engine], model_name: str, *, legacy: bool = False, nixl: NixlStats | None = None) -> None:
        self._engine = engine
        self._model = model_name
        self._legacy = legacy
        self._nixl = nixl

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._model], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self._model], value)
        return c

    def _histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, doc, labels=["model_name"])
        h.add_metric([self._model], hist.cumulative(), hist.sum)
        return h

    def collect(self) -> Iterator[Metric]:
        eng = self._engine()
        s = eng.stats
        cfg = eng.config
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(eng.running))
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", eng.num_waiting)
        usage_name = "vllm:gpu_cache_usage_perc" if self._legacy else "vllm:kv_cache_usage_perc"
        yield self._gauge(usage_name, "KV-cache usage. 1 means 100 percent usage.", eng.pool.usage)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"],
        )
        info.add_metric(
            [str(cfg.block_size), "auto", str(cfg.enable_prefix_caching), str(cfg.num_gpu_blocks)], 1.0
        )
        yield info
        yield self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_queries
        )
        yield self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_hits
        )
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=["model_name", "finished_reason"]
        )
        for reason, n in sorted(s.finished.items()):
            success.add_metric([self._model, reason], n)
        yield success
        yield self._histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", s.ttft)
        itl_name = "vllm:time_per_output_token_seconds" if self._legacy else "vllm:inter_token_latency_seconds"
        yield self._histogram(itl_name, "Histogram of inter-token latency in seconds.", s.itl)
        yield self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", s.e2e
        )
        yield self._histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", s.queue
        )
        if self._nixl is not None:  # vLLM's NIXL connector (NixlPromMetrics)
            x = self._nixl
            yield self._histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", x.xfer_time)
            yield self._histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.", x.bytes_transferred)
            yield self._counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.", x.failed_transfers)
            yield self._counter("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire.", eng.kv_expired)


def register_metrics(
    registry: CollectorRegistry, engine: Callable[[], Engine], model_name: str, *, legacy: bool = False, nixl: NixlStats | None = None
) -> SimMetricsCollector:
    """Create the collector and register it on `registry` (never the global default); with
    `nixl`, vLLM's NIXL connector metrics too."""
    collector = SimMetricsCollector(engine, model_name, legacy=legacy, nixl=nixl)
    registry.register(collector)
    return collector
