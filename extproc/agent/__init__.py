"""The node agent (`llm-extproc agent`): one per GPU node.

Reads the GPUs (NVML, or a simulator's `/sim/gpu`) and the local engine's `/metrics` and
`/health`; serves `grpc.health.v1.Health` and `llm_extproc.v1.NodeLoad` (proto/) on one gRPC
port and Prometheus metrics on another.

    devices.py   DeviceSample, the GpuSource protocol, `--gpu-source` parsing
    nvml.py      NVML through pynvml          sim_gpu.py  a simulator's /sim/gpu
    engine.py    the engine's /metrics and /health, TTFT P95 over a window
    weight.py    the node's routing weight    report.py   verdict + LoadReport
    service.py   NodeLoad servicer, health service names
    exporter.py  Prometheus metrics and the /metrics server
    app.py       NodeAgent (start/aclose)     cli.py      the command

Nothing is imported here, so `llm-extproc --help` stays light; import the modules.
"""

from __future__ import annotations

__all__: list[str] = []
