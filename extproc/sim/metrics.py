"""vLLM's `/metrics`, rendered from the engine's state at scrape time.

A custom prometheus-client collector registered on an injected `CollectorRegistry`: gauges are
read from the live engine, counters and histograms from `EngineStats` (simulated seconds), so a
scrape costs O(buckets) and the engine pays nothing per token for metrics. Names, types and the
`model_name` label follow vLLM V1 (`vllm/v1/metrics/loggers.py`); `legacy=True` renames the two
metrics older vLLM exposed differently (`vllm:gpu_cache_usage_perc`,
`vllm:time_per_output_token_seconds`), as both kinds run in real fleets.

With LoRA on (`max_loras` > 0), `lora_metrics` picks the generation: `activity` exports only
`vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}` (one series
per change of its labels, its value the wall time of the change; the older series stay, as in
vLLM); `residency` exports that too and the newer `vllm:lora_adapter_loaded{adapter_name,
level="gpu"|"cpu", pinned, rank}`, `vllm:num_gpu_loaded_lora_adapters`, `vllm:max_gpu_lora_adapters`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
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

    def __init__(
        self, engine: Callable[[], Engine], model_name: str, *, legacy: bool = False, nixl: NixlStats | None = None, lora_metrics: str = "residency"
    ) -> None:
        if lora_metrics not in ("residency", "activity"):
            raise ValueError(f"lora_metrics must be residency or activity, got {lora_metrics!r}")
        self._engine = engine
        self._model = model_name
        self._legacy = legacy
        self._nixl = nixl
        self._lora_metrics = lora_metrics
        self._lora_series: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        """lora_requests_info label values → the wall time they were first seen (at most 16 kept)."""

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
        if eng.lora is not None:
            yield from self._lora(eng)

    def _lora(self, eng: Engine) -> Iterator[Metric]:
        slots = eng.lora
        assert slots is not None
        running = ",".join(sorted({r.lora for r in eng.running if r.lora is not None}))
        waiting = ",".join(sorted({r.lora for r in eng.waiting if r.lora is not None}))
        key = (str(slots.max_loras), running, waiting)
        if key not in self._lora_series:
            self._lora_series[key] = time.time()
            while len(self._lora_series) > 16:
                self._lora_series.popitem(last=False)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        for labels, stamp in self._lora_series.items():
            info.add_metric(list(labels), stamp)
        yield info
        if self._lora_metrics != "residency":
            return
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded", "LoRA adapters loaded, by level (gpu slot or host cache).",
            labels=["adapter_name", "level", "pinned", "rank"],
        )
        rank = str(slots.load.rank)
        for name in slots.gpu:
            loaded.add_metric([name, "gpu", "false", rank], 1.0)
        for name in slots.host_only():
            loaded.add_metric([name, "cpu", "false", rank], 1.0)
        yield loaded
        yield self._gauge("vllm:num_gpu_loaded_lora_adapters", "LoRA adapters in GPU slots.", len(slots.gpu))
        yield self._gauge("vllm:max_gpu_lora_adapters", "GPU LoRA slots (max_loras).", slots.max_loras)


def register_metrics(
    registry: CollectorRegistry,
    engine: Callable[[], Engine],
    model_name: str,
    *,
    legacy: bool = False,
    nixl: NixlStats | None = None,
    lora_metrics: str = "residency",
) -> SimMetricsCollector:
    """Create the collector and register it on `registry` (never the global default); with
    `nixl`, vLLM's NIXL connector metrics too."""
    collector = SimMetricsCollector(engine, model_name, legacy=legacy, nixl=nixl, lora_metrics=lora_metrics)
    registry.register(collector)
    return collector
