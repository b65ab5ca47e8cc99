"""One sample of the node (devices + engine), its verdict, and its `LoadReport` form.

Health is about faults, never load: the node is unhealthy when a device reports a fault or
the engine's `/health` fails (`EngineSample.healthy`). A busy GPU or a full KV pool lowers the
weight instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc._proto.llm_extproc.v1 import node_load_pb2 as pb
from extproc.agent.devices import DeviceSample
from extproc.agent.engine import EngineSample
from extproc.agent.weight import WeightParams, node_weight

__all__ = ["NodeSample", "assess", "to_proto"]


@dataclass(frozen=True, slots=True)
class NodeSample:
    """The node at one moment.

    Attributes:
        node: the node's name.
        taken_at: when the sample was taken (Unix seconds, wall clock).
        devices: every GPU (empty with `--gpu-source none`).
        engine: the engine reading, or None when the agent watches no engine.
        weight: routing weight in 0..1 (`extproc.agent.weight`); 0 when unhealthy.
        gpu_fault: the devices' faults joined ("GPU 0: ..."), or None.
        engine_fault: why the engine counts as unhealthy, or None.
    """

    node: str
    taken_at: float
    devices: tuple[DeviceSample, ...]
    engine: EngineSample | None
    weight: float
    gpu_fault: str | None
    engine_fault: str | None

    @property
    def healthy(self) -> bool:
        return self.gpu_fault is None and self.engine_fault is None

    @property
    def reason(self) -> str:
        """Why the node is unhealthy ("" when healthy)."""
        return "; ".join(r for r in (self.gpu_fault, self.engine_fault) if r)

    @property
    def gpu_utilization(self) -> float | None:
        """Mean utilisation over the devices that report one (0..1), None if none do."""
        known = [d.gpu_utilization for d in self.devices if d.gpu_utilization is not None]
        return sum(known) / len(known) if known else None


def assess(
    node: str,
    taken_at: float,
    devices: list[DeviceSample],
    engine: EngineSample | None,
    params: WeightParams,
) -> NodeSample:
    """Combine device and engine readings into a `NodeSample` (verdict and weight)."""
    faults = [f"GPU {d.index}: {d.fault}" for d in devices if d.fault]
    gpu_fault = "; ".join(faults) or None
    engine_fault = None
    if engine is not None and not engine.healthy:
        engine_fault = f"engine {engine.url} unhealthy ({engine.health_error or 'recent /health failures'})"
    sample = NodeSample(node, taken_at, tuple(devices), engine, 0.0, gpu_fault, engine_fault)
    if not sample.healthy:
        return sample
    weight = node_weight(
        params,
        ttft_p95_ms=engine.ttft_p95_ms if engine is not None else None,
        kv_free_fraction=engine.kv_free_fraction if engine is not None else None,
        gpu_utilization=sample.gpu_utilization,
    )
    return NodeSample(node, taken_at, tuple(devices), engine, weight, None, None)


def _device_proto(d: DeviceSample) -> pb.DeviceReport:
    msg = pb.DeviceReport(index=d.index, uuid=d.uuid, name=d.name, last_xid=d.last_xid, fault=d.fault or "")
    for field in (
        "memory_used_bytes",
        "memory_total_bytes",
        "gpu_utilization",
        "memory_utilization",
        "temperature_c",
        "power_w",
        "ecc_errors",
        "retired_pages_pending",
        "remapped_rows_pending",
    ):
        value = getattr(d, field)
        if value is not None:
            setattr(msg, field, value)
    return msg


def _engine_proto(e: EngineSample) -> pb.EngineReport:
    msg = pb.EngineReport(
        url=e.url,
        reachable=e.reachable,
        healthy=e.healthy,
        kv_usage=e.kv_usage,
        requests_running=max(0, e.running),
        requests_waiting=max(0, e.waiting),
        error="; ".join(x for x in (e.metrics_error, e.health_error) if x),
    )
    if e.kv_blocks_total is not None:
        msg.kv_blocks_total = e.kv_blocks_total
    if e.kv_blocks_free is not None:
        msg.kv_blocks_free = e.kv_blocks_free
    if e.block_size is not None:
        msg.block_size = e.block_size
    if e.ttft_p95_ms is not None:
        msg.ttft_p95_ms = e.ttft_p95_ms
    return msg


def to_proto(sample: NodeSample) -> pb.LoadReport:
    """The `llm_extproc.v1.LoadReport` for a sample."""
    report = pb.LoadReport(
        devices=[_device_proto(d) for d in sample.devices],
        weight=sample.weight,
        healthy=sample.healthy,
        node=sample.node,
        reason=sample.reason,
    )
    report.time.FromNanoseconds(int(sample.taken_at * 1e9))
    if sample.engine is not None:
        report.engine.CopyFrom(_engine_proto(sample.engine))
    return report
