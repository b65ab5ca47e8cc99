#!/usr/bin/env python3
"""Exercise the node agent's real NVML path on a GPU machine and print what it read.

    .venv/bin/python scripts/check_nvml.py [--samples 3] [--interval 1.0] [--no-agent]

1. NVML through `extproc.agent.nvml.NvmlSource` (the code `llm-extproc agent --gpu-source nvml`
   runs): driver and NVML versions, then `--samples` readings of every device, every field
   (`-` = the GPU answered NotSupported), the time one reading takes, and any fault.
2. Unless `--no-agent`: a whole `NodeAgent` on 127.0.0.1 (free ports, no engine) with that
   source — its `NodeLoad.Get` report, the `grpc.health.v1` statuses and the `gpu_*` lines of
   its `/metrics` — so one run checks the path from NVML to what Envoy and the balancer see.

Exit status: 0 every device read cleanly, 1 a device reports a fault (printed), 2 NVML is
unusable here (the agent's own message is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import fields

import pynvml

from extproc.agent.devices import DeviceSample, GpuSourceError
from extproc.agent.nvml import NvmlSource

_UNITS = {
    "memory_used_bytes": ("GiB", 2**30),
    "memory_total_bytes": ("GiB", 2**30),
    "gpu_utilization": ("%", 0.01),
    "memory_utilization": ("%", 0.01),
    "temperature_c": ("C", 1),
    "power_w": ("W", 1),
}


def _fmt(name: str, value: object) -> str:
    if value is None:
        return "-"
    if name in _UNITS and isinstance(value, (int, float)):
        unit, scale = _UNITS[name]
        return f"{value / scale:.2f} {unit}"
    return str(value)


def _print_sample(devices: list[DeviceSample], took_ms: float) -> None:
    print(f"  one reading of {len(devices)} device(s) took {took_ms:.1f} ms")
    for d in devices:
        print(f"  GPU {d.index}  {d.name}  {d.uuid}")
        for f in fields(DeviceSample):
            if f.name not in ("index", "name", "uuid"):
                print(f"      {f.name:<22} {_fmt(f.name, getattr(d, f.name))}")


def _versions() -> None:
    for label, fn in (("driver", "nvmlSystemGetDriverVersion"), ("NVML", "nvmlSystemGetNVMLVersion")):
        try:
            print(f"{label} version: {getattr(pynvml, fn)()}")
        except (pynvml.NVMLError, AttributeError) as exc:
            print(f"{label} version: unavailable ({exc})")


async def _raw(samples: int, interval: float) -> list[DeviceSample]:
    source = NvmlSource()
    await source.start()
    last: list[DeviceSample] = []
    try:
        _versions()
        print(f"devices: {source.device_count}")
        for i in range(samples):
            if i:
                await asyncio.sleep(interval)
            t0 = time.perf_counter()
            last = await source.sample()
            print(f"\nsample {i + 1}/{samples}")
            _print_sample(last, (time.perf_counter() - t0) * 1000)
    finally:
        await source.aclose()
    return last


async def _agent(interval: float) -> None:
    import aiohttp
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from extproc._proto.llm_extproc.v1 import node_load_pb2 as pb
    from extproc._proto.llm_extproc.v1 import node_load_pb2_grpc as pb_grpc
    from extproc.agent.app import AgentSettings, NodeAgent
    from extproc.agent.service import GPU_SERVICE, NODE_LOAD_SERVICE

    settings = AgentSettings(host="127.0.0.1", grpc_port=0, metrics_port=0, period_s=interval, engine_url=None)
    agent = NodeAgent(settings, NvmlSource())
    await agent.start()
    try:
        await asyncio.sleep(interval * 1.5)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
            report = await pb_grpc.NodeLoadStub(ch).Get(pb.GetLoadRequest(), timeout=5)
            health = health_pb2_grpc.HealthStub(ch)
            statuses = {
                s or '""': health_pb2.HealthCheckResponse.ServingStatus.Name(
                    (await health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5)).status
                )
                for s in ("", NODE_LOAD_SERVICE, GPU_SERVICE)
            }
        print("\nNodeLoad.Get:")
        print("  " + str(report).replace("\n", "\n  ").rstrip())
        print(f"health: {statuses}")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{agent.metrics_port}/metrics") as resp:
                text = await resp.text()
        print("/metrics (gpu_*, inference_latency_p95_ms, llm_extproc_agent_*):")
        for line in text.splitlines():
            if line.startswith(("gpu_", "inference_latency_p95_ms", "llm_extproc_agent_")) and "_created" not in line:
                print(f"  {line}")
    finally:
        await agent.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3, help="raw readings to take (default 3)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings (default 1.0)")
    parser.add_argument("--no-agent", action="store_true", help="skip the whole-agent check")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.interval <= 0:
        parser.error("--samples must be >= 1 and --interval > 0")
    try:
        devices = asyncio.run(_raw(args.samples, args.interval))
        if not args.no_agent:
            asyncio.run(_agent(args.interval))
    except GpuSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    faults = [f"GPU {d.index}: {d.fault}" for d in devices if d.fault]
    for f in faults:
        print(f"FAULT {f}")
    print("\nresult:", "device faults reported" if faults else "all devices read cleanly")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
