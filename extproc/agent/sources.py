"""`--gpu-source` → a GPU source: the factory above the sources (extproc.agent.devices holds the
types they share; nvml and sim_gpu import those, never this module).
"""

from __future__ import annotations

from extproc.agent.devices import GpuSource, GpuSourceError, NoGpuSource
from extproc.agent.nvml import NvmlSource
from extproc.agent.sim_gpu import SimGpuSource

__all__ = ["gpu_source_from_spec"]


def gpu_source_from_spec(spec: str, *, timeout_s: float = 1.0) -> GpuSource:
    """Build (not start) the source named by `--gpu-source`: `nvml`, `sim:URL` or `none`.

    Args:
        spec: the flag's value.
        timeout_s: per-request timeout of `sim:URL` (seconds).

    Raises:
        GpuSourceError: an unknown spec, or `sim:` without an http(s) URL.
    """
    if spec == "none":
        return NoGpuSource()
    if spec == "nvml":
        return NvmlSource()
    if spec.startswith("sim:"):
        url = spec[len("sim:") :]
        if not url.startswith(("http://", "https://")):
            raise GpuSourceError(f"--gpu-source sim:URL needs an http(s) URL, got {spec!r}")
        # the simulator's base URL; its `/sim/gpu` path spelled out is accepted too
        url = url.rstrip("/").removesuffix("/sim/gpu")
        return SimGpuSource(url, timeout_s=timeout_s)
    raise GpuSourceError(f"unknown --gpu-source {spec!r}; use nvml, sim:URL (a simulator's base URL) or none")
