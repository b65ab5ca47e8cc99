"""`--gpu-source nvml`: the machine's GPUs through pynvml (the `nvidia-ml-py` distribution).

Per device and sample: memory used/total, GPU and memory utilisation, temperature, power, and
the errors NVML can report — volatile uncorrected ECC errors, retired pages pending a reset
(pre-Ampere), row remapping pending or failed (Ampere and later, where page retirement is
NotSupported) and critical Xid events (`nvmlEventTypeXidCriticalError`, polled without
blocking each sample).

Each field is read on its own: NotSupported, NoPermission, FunctionNotFound and NoData leave
that field None (a MIG slice has no utilisation, a consumer card no ECC); any other NVML
error (GpuIsLost, Unknown, ...) is a device fault. NVML calls block, so a sample runs in a
worker thread with a deadline; while a call is still stuck every device reports a fault.

What counts as a fault (the device should take no traffic until an operator acts):
uncorrected ECC errors > 0, retired pages pending, remapped rows pending or failed, an Xid in
`FATAL_XIDS`, and any NVML error other than the "not available" ones. Xid faults are sticky
until the agent restarts: they need a GPU reset, which restarts the agent's view anyway.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

import pynvml

from extproc.agent.devices import DeviceSample, GpuSourceError

__all__ = ["FATAL_XIDS", "MISSING_LIBRARY_MESSAGE", "NvmlSource"]

log = logging.getLogger(__name__)

FATAL_XIDS: frozenset[int] = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 140})
"""Xids that NVIDIA's Xid catalogue says need a GPU reset or a reboot: 48 double-bit ECC,
62 internal micro-controller halt, 64 row-remapper failure, 74 NVLink error, 79 fallen off the
bus, 95 uncontained ECC, 119/120 GSP timeout/error, 140 unrecovered ECC. Others (13, 31, 43:
application faults; 94: contained ECC, the process dies, the GPU is fine) are reported as
`last_xid` without a fault."""

MISSING_LIBRARY_MESSAGE = (
    "--gpu-source nvml: the NVML library (libnvidia-ml.so.1, installed with the NVIDIA driver) "
    "was not found on this machine. Run the agent on a GPU node with the driver installed, or "
    "use --gpu-source sim:URL (a simulator's /sim/gpu) or --gpu-source none (no GPU data)."
)

_XID_DRAIN_MAX = 64  # events read per sample at most (bounded loop)


def _unavailable() -> tuple[type[BaseException], ...]:
    return (
        pynvml.NVMLError_NotSupported,
        pynvml.NVMLError_NoPermission,
        pynvml.NVMLError_FunctionNotFound,
        pynvml.NVMLError_NoData,
    )


@dataclass(slots=True)
class _Device:
    index: int
    handle: Any
    uuid: str = ""
    name: str = ""
    last_xid: int = 0
    fatal_xid: int = 0


class NvmlSource:
    """All GPUs NVML sees.

    Args:
        call_timeout_s: deadline for one sample's NVML calls (seconds); past it every device
            reports a fault until the stuck call returns.

    Nothing is loaded until `start()`.
    """

    name = "nvml"

    def __init__(self, *, call_timeout_s: float = 5.0) -> None:
        self._timeout = call_timeout_s
        self._devices: list[_Device] = []
        self._events: Any = None
        self._started = False
        self._busy = threading.Event()

    async def start(self) -> None:
        """Initialise NVML and enumerate devices.

        Raises:
            GpuSourceError: the NVML library is missing (`MISSING_LIBRARY_MESSAGE`), the driver
                is not loaded, or NVML fails to initialise.
        """
        await asyncio.to_thread(self._open)

    def _open(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise GpuSourceError(MISSING_LIBRARY_MESSAGE) from None
        except pynvml.NVMLError as exc:
            raise GpuSourceError(
                f"--gpu-source nvml: NVML failed to initialise ({exc}); is the NVIDIA driver loaded? "
                "Alternatives: --gpu-source sim:URL or --gpu-source none"
            ) from None
        self._started = True
        try:
            count = pynvml.nvmlDeviceGetCount()
            for i in range(count):
                dev = _Device(i, pynvml.nvmlDeviceGetHandleByIndex(i))
                dev.uuid = str(self._quiet(pynvml.nvmlDeviceGetUUID, dev.handle) or "")
                dev.name = str(self._quiet(pynvml.nvmlDeviceGetName, dev.handle) or "")
                self._devices.append(dev)
        except pynvml.NVMLError as exc:
            self._close()
            raise GpuSourceError(f"--gpu-source nvml: cannot enumerate GPUs: {exc}") from None
        if not self._devices:
            log.warning("NVML reports no GPUs on this machine")
        self._register_xid_events()

    @staticmethod
    def _quiet(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError:
            return None

    def _register_xid_events(self) -> None:
        try:
            self._events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.info("NVML events unavailable (%s): Xid events will not be reported", exc)
            return
        for dev in self._devices:
            try:
                pynvml.nvmlDeviceRegisterEvents(dev.handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
            except pynvml.NVMLError as exc:
                log.info("GPU %d: Xid events unavailable (%s)", dev.index, exc)

    @property
    def device_count(self) -> int:
        return len(self._devices)

    async def sample(self) -> list[DeviceSample]:
        """Read every device (in a worker thread, bounded by `call_timeout_s`)."""
        if self._busy.is_set():
            return self._all_faulty("an NVML call from an earlier sample has not returned")
        self._busy.set()
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._sample_and_clear), self._timeout)
        except TimeoutError:
            return self._all_faulty(f"NVML calls did not return within {self._timeout:g} s")

    def _sample_and_clear(self) -> list[DeviceSample]:
        try:
            return self.sample_sync()
        finally:
            self._busy.clear()

    def _all_faulty(self, why: str) -> list[DeviceSample]:
        return [
            DeviceSample(d.index, d.uuid, d.name, last_xid=d.last_xid, fault=why, read_errors=1) for d in self._devices
        ]

    def sample_sync(self) -> list[DeviceSample]:
        """Read every device now, on the calling thread (blocking NVML calls)."""
        self._drain_xid_events()
        return [self._read(d) for d in self._devices]

    def _drain_xid_events(self) -> None:
        if self._events is None:
            return
        by_index = {d.index: d for d in self._devices}
        for _ in range(_XID_DRAIN_MAX):
            try:
                data = pynvml.nvmlEventSetWait_v2(self._events, 0)
            except pynvml.NVMLError_Timeout:
                return
            except pynvml.NVMLError as exc:
                log.debug("NVML event wait failed: %s", exc)
                return
            try:
                dev = by_index.get(pynvml.nvmlDeviceGetIndex(data.device))
            except pynvml.NVMLError:
                dev = None
            if dev is None:
                continue
            xid = int(data.eventData)
            dev.last_xid = xid
            if xid in FATAL_XIDS:
                dev.fatal_xid = xid
            log.warning("GPU %d: Xid %d%s", dev.index, xid, " (needs a GPU reset)" if xid in FATAL_XIDS else "")

    def _read(self, dev: _Device) -> DeviceSample:
        faults: list[str] = []
        errors = 0
        unavailable = _unavailable()

        def read(what: str, fn: Any, *args: Any) -> Any:
            nonlocal errors
            try:
                return fn(dev.handle, *args)
            except unavailable:
                return None
            except pynvml.NVMLError as exc:
                errors += 1
                faults.append(f"NVML {what}: {exc}")
                return None

        mem = read("memory", pynvml.nvmlDeviceGetMemoryInfo)
        util = read("utilization", pynvml.nvmlDeviceGetUtilizationRates)
        temp = read("temperature", pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU)
        power_mw = read("power", pynvml.nvmlDeviceGetPowerUsage)
        ecc = read(
            "ECC errors",
            pynvml.nvmlDeviceGetTotalEccErrors,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
        pages = read("retired pages", pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
        rows = read("remapped rows", pynvml.nvmlDeviceGetRemappedRows)

        pages_pending = None if pages is None else pages == pynvml.NVML_FEATURE_ENABLED
        rows_pending = None if rows is None else bool(rows[2] or rows[3])
        if ecc:
            faults.append(f"{ecc} uncorrected ECC errors since the driver loaded")
        if pages_pending:
            faults.append("retired pages pending a GPU reset")
        if rows is not None and rows[3]:
            faults.append("row remapping failed")
        elif rows_pending:
            faults.append("row remapping pending a GPU reset")
        if dev.fatal_xid:
            faults.append(f"Xid {dev.fatal_xid} (needs a GPU reset)")
        return DeviceSample(
            index=dev.index,
            uuid=dev.uuid,
            name=dev.name,
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            gpu_utilization=None if util is None else util.gpu / 100.0,
            memory_utilization=None if util is None else util.memory / 100.0,
            temperature_c=None if temp is None else float(temp),
            power_w=None if power_mw is None else power_mw / 1000.0,
            ecc_errors=None if ecc is None else int(ecc),
            retired_pages_pending=pages_pending,
            remapped_rows_pending=rows_pending,
            last_xid=dev.last_xid,
            fault="; ".join(faults) or None,
            read_errors=errors,
        )

    async def aclose(self) -> None:
        """Free the event set and shut NVML down; safe to call twice."""
        if self._started:
            await asyncio.to_thread(self._close)

    def _close(self) -> None:
        if self._events is not None:
            self._quiet(pynvml.nvmlEventSetFree, self._events)
            self._events = None
        if self._started:
            self._started = False
            self._devices = []
            self._quiet(pynvml.nvmlShutdown)
