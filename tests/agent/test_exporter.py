"""The agent's Prometheus exporter: the design notes' names exactly, on an injected registry,
served on the metrics port."""

from __future__ import annotations

import math

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extproc.agent.devices import DeviceSample
from extproc.agent.engine import EngineSample
from extproc.agent.exporter import AgentMetrics
from extproc.agent.report import assess
from extproc.agent.weight import WeightParams
from tests.agent.agent_helpers import FakeEngine, eventually

GiB = 2**30


def test_names_and_values_from_a_sample() -> None:
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry)
    devices = [
        DeviceSample(0, "GPU-a", "NVIDIA H200", 70 * GiB, 141 * GiB, 0.9, 0.5, 61.0, 650.0, 0, False, False),
        DeviceSample(1, "GPU-b", "NVIDIA H200", 1 * GiB, 141 * GiB, None, None, 40.0, None, 2, None, None,
                     fault="2 uncorrected ECC errors since the driver loaded"),
    ]
    engine = EngineSample("http://e", True, True, 1000, 400, 16, 0.6, 12, 3, 183.5)
    metrics.observe(assess("n", 1_700_000_000.0, devices, engine, WeightParams()))

    def v(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert v("gpu_memory_used_bytes", gpu="0") == 70 * GiB
    assert v("gpu_memory_total_bytes", gpu="1") == 141 * GiB
    assert v("gpu_utilization_ratio", gpu="0") == 0.9
    assert math.isnan(v("gpu_utilization_ratio", gpu="1"))  # NotSupported → NaN, not 0
    assert v("gpu_temperature_celsius", gpu="0") == 61.0 and v("gpu_power_watts", gpu="0") == 650.0
    assert v("gpu_ecc_uncorrected_errors", gpu="1") == 2
    assert (v("gpu_fault", gpu="0"), v("gpu_fault", gpu="1")) == (0, 1)
    assert v("inference_latency_p95_ms") == 183.5
    assert (v("inference_kv_blocks_free"), v("inference_kv_blocks_total"), v("inference_kv_cache_usage_ratio")) == (400, 1000, 0.6)
    assert (v("inference_requests_running"), v("inference_requests_waiting")) == (12, 3)
    assert (v("llm_extproc_agent_healthy"), v("llm_extproc_agent_gpu_healthy"), v("llm_extproc_agent_engine_healthy")) == (0, 0, 1)
    assert v("llm_extproc_agent_weight") == 0.0  # unhealthy node
    assert v("llm_extproc_agent_last_sample_timestamp_seconds") == 1_700_000_000.0
    # An ECC count is a reading, not a failed read: no sample error.
    assert v("llm_extproc_agent_sample_errors_total", source="gpu") == 0


def test_two_agents_in_one_process_do_not_collide() -> None:
    # Each registry is injected; the global default registry is never touched.
    AgentMetrics(CollectorRegistry())
    AgentMetrics(CollectorRegistry())


async def test_metrics_port_serves_the_names_and_counts_errors(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}")
    engine.health_status = 503
    engine.metrics_status = 500
    await eventually(
        lambda: (agent.metrics.registry.get_sample_value("llm_extproc_agent_sample_errors_total", {"source": "engine_health"}) or 0) >= 2,
        what="health errors counted",
    )
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{agent.metrics_port}/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "gpu_memory_used_bytes",
        "gpu_memory_total_bytes",
        "gpu_utilization_ratio",
        "inference_latency_p95_ms",
        "llm_extproc_agent_healthy",
        "llm_extproc_agent_sample_errors",
    ):
        assert name in families, name
    used = {s.labels["gpu"]: s.value for s in families["gpu_memory_used_bytes"].samples}
    assert used == {"0": 10 * GiB}
    errors = {s.labels["source"]: s.value for s in families["llm_extproc_agent_sample_errors"].samples if s.name.endswith("_total")}
    assert errors["engine_health"] >= 2 and errors["engine_metrics"] >= 1 and errors["gpu"] == 0
    assert families["llm_extproc_agent_healthy"].samples[0].value == 0


def test_an_agent_without_an_engine_exports_nan_not_zero() -> None:
    registry = CollectorRegistry()
    AgentMetrics(registry).observe(assess("n", 0.0, [DeviceSample(0, memory_used_bytes=1)], None, WeightParams()))
    for name in ("inference_latency_p95_ms", "inference_kv_cache_usage_ratio", "inference_requests_waiting",
                 "llm_extproc_agent_engine_healthy"):  # fmt: skip
        assert math.isnan(registry.get_sample_value(name)), name
    assert registry.get_sample_value("llm_extproc_agent_healthy") == 1
