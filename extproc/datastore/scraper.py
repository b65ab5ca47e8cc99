"""Scrape each endpoint's vLLM `/metrics` on a short period; keep the latest snapshot.

Understood names (both vLLM generations, DESIGN section 4):

* `vllm:num_requests_running`, `vllm:num_requests_waiting` (summed over `model_name`);
* `vllm:kv_cache_usage_perc`, or the older `vllm:gpu_cache_usage_perc` (fraction 0..1);
* `vllm:cache_config_info{block_size, num_gpu_blocks}` (an info-style gauge);
* `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (tokens, cumulative);
* `vllm:num_preemptions_total`;
* `vllm:time_to_first_token_seconds` histogram (cumulative buckets; P95 over the window between
  two scrapes is derived from bucket deltas);
* LoRA, both generations (`extproc.datastore.lora`): `vllm:lora_adapter_loaded{adapter_name,
  level}`, `vllm:max_gpu_lora_adapters` where exported, else the newest series (by its value, a
  timestamp) of `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`.

Only lines of those families are handed to prometheus_client's parser: a vLLM exposition is
tens of KB of histograms we do not need, and parsing is pure Python.

An endpoint whose last successful scrape is older than `stale_after_s` is stale; scrapes that
time out or fail count as errors and leave the previous snapshot (which then ages into
staleness).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.aio import cancel_and_wait, read_at_most
from extproc.datastore.endpoints import Datastore, Endpoint
from extproc.datastore.lora import LoraMetrics, adapter_list

__all__ = ["EngineMetrics", "MAX_METRICS_BYTES", "MetricsScraper", "parse_vllm_metrics", "histogram_quantile"]

log = logging.getLogger(__name__)

_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:lora_adapter_loaded",
    "vllm:num_gpu_loaded_lora_adapters",
    "vllm:max_gpu_lora_adapters",
    "vllm:lora_requests_info",
)


@dataclass(slots=True)
class EngineMetrics:
    """One scrape of an engine.

    Attributes:
        running / waiting: requests running / waiting in the engine (count).
        kv_usage: fraction of the KV block pool in use (0..1).
        num_gpu_blocks / block_size: the pool (blocks, tokens per block); None if not exported.
        prefix_queries / prefix_hits: cumulative prefix-cache lookups / hits (tokens).
        preemptions: cumulative preemptions (count).
        ttft_buckets: cumulative TTFT histogram, upper bound (seconds) → count.
        ttft_p95_s: P95 TTFT over the interval since the previous scrape (seconds), or None
            when no request finished its prefill in that interval.
        scraped_at: `time.monotonic()` when the scrape completed (seconds).
        lora: the engine's LoRA state (`extproc.datastore.lora.LoraMetrics`), None when it
            exports neither generation of LoRA metrics.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    ttft_buckets: dict[float, float] = field(default_factory=dict)
    ttft_p95_s: float | None = None
    scraped_at: float = 0.0
    lora: LoraMetrics | None = None

    @property
    def free_blocks(self) -> int | None:
        """Free KV blocks by the engine's own count: num_gpu_blocks × (1 − kv_usage)."""
        if self.num_gpu_blocks is None:
            return None
        return int(self.num_gpu_blocks * (1.0 - min(1.0, max(0.0, self.kv_usage))))


def _filter_lines(text: str) -> str:
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2].startswith(_FAMILIES):
                keep.append(line)
        elif line.startswith(_FAMILIES):
            keep.append(line)
    return "\n".join(keep) + "\n"


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Quantile from cumulative buckets (upper bound → count), interpolating linearly inside the
    bucket as Prometheus' `histogram_quantile` does. None when the histogram is empty."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if math.isinf(b):
                return prev_bound
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return bounds[-1]


def _count_label(labels: dict[str, str], name: str, current: int | None) -> int | None:
    """A label holding a positive count (`num_gpu_blocks`, `block_size`), else `current`: a
    value that is not one (0, negative, fractional, inf, nan, text) says nothing we can use —
    taken as a count it would make every request "never fit" or break block arithmetic."""
    try:
        value = float(labels.get(name, ""))
    except ValueError:
        return current
    if not (1 <= value < 2**63) or not value.is_integer():
        return current
    return int(value)


def _request_count(name: str, value: float) -> int:
    """A request-count gauge as an int (requests).

    Raises:
        ValueError: the value is negative, inf or nan — a broken exposition; the scrape then
            fails like any unreadable one (the endpoint goes stale) instead of raising
            OverflowError out of `int(inf)`.
    """
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} is {value!r}, not a request count")
    return int(value)


def _fraction(name: str, value: float) -> float:
    """A usage gauge as a fraction, clamped to at most 1 (float rounding can put a full cache a
    hair above it).

    Raises:
        ValueError: the value is negative, inf or nan.
    """
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} is {value!r}, not a fraction")
    return min(value, 1.0)


def parse_vllm_metrics(text: str, previous: EngineMetrics | None = None) -> EngineMetrics:
    """Parse a vLLM exposition into `EngineMetrics` (`scraped_at` left for the caller).

    Raises:
        ValueError: the text is not valid Prometheus exposition format.
    """
    m = EngineMetrics()
    legacy_usage: float | None = None
    have_usage = False
    lora = _LoraParse()
    for fam in text_string_to_metric_families(_filter_lines(text)):
        for s in fam.samples:
            name = s.name
            if name.startswith("vllm:lora_") or name.endswith("_lora_adapters"):
                lora.add(name, s.labels, s.value)
            elif name == "vllm:num_requests_running":
                m.running += _request_count(name, s.value)
            elif name == "vllm:num_requests_waiting":
                m.waiting += _request_count(name, s.value)
            elif name == "vllm:kv_cache_usage_perc":
                m.kv_usage = max(m.kv_usage, _fraction(name, s.value))
                have_usage = True
            elif name == "vllm:gpu_cache_usage_perc":
                legacy_usage = max(legacy_usage or 0.0, _fraction(name, s.value))
            elif name == "vllm:cache_config_info":
                m.num_gpu_blocks = _count_label(s.labels, "num_gpu_blocks", m.num_gpu_blocks)
                m.block_size = _count_label(s.labels, "block_size", m.block_size)
            elif name == "vllm:prefix_cache_queries_total":
                m.prefix_queries += s.value
            elif name == "vllm:prefix_cache_hits_total":
                m.prefix_hits += s.value
            elif name == "vllm:num_preemptions_total":
                m.preemptions += s.value
            elif name == "vllm:time_to_first_token_seconds_bucket":
                le = float(s.labels["le"])
                m.ttft_buckets[le] = m.ttft_buckets.get(le, 0.0) + s.value
    if not have_usage and legacy_usage is not None:
        m.kv_usage = legacy_usage
    m.lora = lora.result()
    if previous is not None and previous.ttft_buckets:
        delta = {le: c - previous.ttft_buckets.get(le, 0.0) for le, c in m.ttft_buckets.items()}
        if all(v >= 0 for v in delta.values()):  # a counter reset (engine restart) gives negatives
            m.ttft_p95_s = histogram_quantile(0.95, delta)
    return m


class _LoraParse:
    """Collects one exposition's LoRA samples (both generations) into a `LoraMetrics`."""

    def __init__(self) -> None:
        self.residency = False
        self.gpu: set[str] = set()
        self.cpu: set[str] = set()
        self.max_gpu: int | None = None
        self.info: tuple[float, dict[str, str]] | None = None  # newest lora_requests_info series

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        if name == "vllm:lora_adapter_loaded":
            self.residency = True
            adapter = labels.get("adapter_name", "")
            if adapter and value > 0:
                (self.cpu if labels.get("level") == "cpu" else self.gpu).add(adapter)
        elif name == "vllm:max_gpu_lora_adapters":
            if math.isfinite(value) and value >= 1:
                self.max_gpu = int(value)
        elif name == "vllm:num_gpu_loaded_lora_adapters":
            self.residency = True  # an engine with none loaded exports the count and no series
        elif name == "vllm:lora_requests_info" and math.isfinite(value):
            # One series per change, its value the time it was set: the newest is current.
            if self.info is None or value > self.info[0]:
                self.info = (value, labels)

    def result(self) -> LoraMetrics | None:
        running = waiting = frozenset[str]()
        max_lora = self.max_gpu
        if self.info is not None:
            labels = self.info[1]
            running = adapter_list(labels.get("running_lora_adapters", ""))
            waiting = adapter_list(labels.get("waiting_lora_adapters", ""))
            if max_lora is None:
                max_lora = _count_label(labels, "max_lora", None)
        if self.residency:
            return LoraMetrics("residency", frozenset(self.gpu), frozenset(self.cpu), running, waiting, max_lora)
        if self.info is not None:
            return LoraMetrics("activity", running=running, waiting=waiting, max_gpu=max_lora)
        return None


MAX_METRICS_BYTES = 16 * 1024 * 1024
"""The largest exposition `MetricsScraper` reads (bytes): an engine's is tens of KB."""


class MetricsScraper:
    """Scrapes every endpoint of a datastore concurrently every `interval_s` seconds.

    Args:
        store: endpoints to scrape; `endpoint.engine` receives each snapshot.
        path: metrics path (`/metrics`).
        interval_s: period (seconds). timeout_s: per-scrape timeout (seconds).
        on_scrape: optional callback(endpoint, ok: bool, seconds: float) for metrics.
        max_bytes: the largest exposition read (bytes); a longer one fails the scrape (vLLM's
            is tens of KB, a series per LoRA adapter included).
    """

    def __init__(
        self,
        store: Datastore,
        *,
        path: str = "/metrics",
        interval_s: float = 0.1,
        timeout_s: float = 0.5,
        on_scrape: Callable[[Endpoint, bool, float], None] | None = None,
        max_bytes: int = MAX_METRICS_BYTES,
    ) -> None:
        self._store = store
        self._max_bytes = max_bytes
        self._path = path
        self._interval = interval_s
        self._timeout = timeout_s
        self._on_scrape = on_scrape
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """One scrape of every endpoint (so first decisions see data), then one loop per endpoint."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
        )
        await asyncio.gather(*(self.scrape(ep) for ep in self._store.all()))
        # One loop per endpoint: a hanging endpoint never delays the others.
        for ep in self._store.all():
            self.add(ep)

    def add(self, ep: Endpoint) -> None:
        """Start scraping an endpoint that joined (no-op before `start` or when already scraped)."""
        if self._session is None or ep.address in self._tasks:
            return
        self._tasks[ep.address] = asyncio.create_task(self._loop(ep), name=f"scrape-{ep.address}")

    def remove(self, ep: Endpoint) -> None:
        """Stop scraping an endpoint that left (its loop is cancelled; nothing to wait for)."""
        task = self._tasks.pop(ep.address, None)
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        await cancel_and_wait(self._tasks.values())
        self._tasks = {}
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self, ep: Endpoint) -> None:
        while True:
            started = time.monotonic()
            await self.scrape(ep)
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    async def scrape(self, ep: Endpoint) -> bool:
        """Scrape one endpoint now; True on success (the snapshot is then on `ep.engine`)."""
        assert self._session is not None
        t0 = time.monotonic()
        mark = ep.routed_total
        ok = False
        try:
            async with self._session.get(f"http://{ep.address}{self._path}") as resp:
                raw = await read_at_most(resp.content, self._max_bytes) if resp.status == 200 else None
                if raw is None:
                    log.debug("scrape of %s: status %d or over %d bytes", ep.address, resp.status, self._max_bytes)
                else:
                    ep.engine = parse_vllm_metrics(raw.decode(), ep.engine)  # the text format is UTF-8
                    ep.engine.scraped_at = time.monotonic()
                    ep.routed_at_scrape = mark
                    ok = True
        except (TimeoutError, aiohttp.ClientError, ValueError, UnicodeDecodeError) as exc:
            log.debug("scrape of %s failed: %s", ep.address, exc)
        except Exception:  # a parser bug must not kill the loop
            log.exception("scrape of %s failed", ep.address)
        if self._on_scrape is not None:
            self._on_scrape(ep, ok, time.monotonic() - t0)
        return ok
