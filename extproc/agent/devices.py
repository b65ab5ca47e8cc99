"""What the agent knows about one GPU, and where it reads it from (`--gpu-source`).

Sources (each `async start()` / `async sample()` / `async aclose()`):

* `nvml` — the GPUs of this machine through pynvml (`extproc.agent.nvml.NvmlSource`);
* `sim:URL` — one simulated GPU, `GET URL/sim/gpu` of `llm-extproc sim`
  (`extproc.agent.sim_gpu.SimGpuSource`);
* `none` — no GPU data (a CPU engine, or a node whose GPUs another agent reports).

This module holds only the shared types; `extproc.agent.sources.gpu_source_from_spec` builds a
source from the flag (the sources import these types, so the factory sits above them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["DeviceSample", "GpuSource", "GpuSourceError", "NoGpuSource"]


class GpuSourceError(RuntimeError):
    """A GPU source cannot be used at all (raised by `start()`, or for a bad `--gpu-source`)."""


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One GPU at one moment. Fields a source cannot read are None.

    Attributes:
        index: device index as the driver numbers it. uuid, name: as NVML reports them.
        memory_used_bytes / memory_total_bytes: device memory (bytes).
        gpu_utilization: fraction of the last sample period a kernel ran (0..1).
        memory_utilization: fraction of it device memory was read or written (0..1).
        temperature_c: core temperature (degrees Celsius). power_w: board power draw (watts).
        ecc_errors: volatile (since driver load) uncorrected ECC errors (count).
        retired_pages_pending: pages retired but awaiting a reset (pre-Ampere GPUs).
        remapped_rows_pending: row remapping pending or failed (Ampere and later).
        last_xid: the last critical Xid event seen since the agent started (0: none).
        fault: why the device is unusable, or None when it is fine.
        read_errors: readings that failed this sample (NVML errors other than NotSupported,
            a failed `/sim/gpu` request); counted in `llm_extproc_agent_sample_errors_total`.
    """

    index: int
    uuid: str = ""
    name: str = ""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    gpu_utilization: float | None = None
    memory_utilization: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_errors: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    last_xid: int = 0
    fault: str | None = None
    read_errors: int = 0


class GpuSource(Protocol):
    """Reads the node's GPUs. `sample()` never raises for a device problem: it reports it as
    that device's `fault` (or, when the source itself failed, one sample with a fault)."""

    name: str

    async def start(self) -> None:
        """Open the source.

        Raises:
            GpuSourceError: the source cannot be used (library missing, no driver, bad URL).
        """

    async def sample(self) -> list[DeviceSample]:
        """One reading of every device (may be empty for `none`)."""

    async def aclose(self) -> None:
        """Release the source; safe to call twice or without `start()`."""


class NoGpuSource:
    """`--gpu-source none`: no devices, never a fault."""

    name = "none"

    async def start(self) -> None:
        return None

    async def sample(self) -> list[DeviceSample]:
        return []

    async def aclose(self) -> None:
        return None
