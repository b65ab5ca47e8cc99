"""NVML sampling with pynvml faked at its boundary: the functions `NvmlSource` calls are
monkeypatched on the `pynvml` module; everything above them (field handling, faults, Xid
events, the thread deadline) is the real code."""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from extproc.agent.devices import GpuSourceError
from extproc.agent.nvml import FATAL_XIDS, MISSING_LIBRARY_MESSAGE, NvmlSource
from tests.agent.agent_helpers import eventually

GiB = 2**30


def nvml_error(code: int) -> pynvml.NVMLError:
    """pynvml's own error class for a return code (NVMLError(code) picks the subclass)."""
    return pynvml.NVMLError(code)


NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


@dataclass
class FakeGpu:
    """What one faked device answers; an int in `errors[field]` makes that call raise."""

    used: int = 60 * GiB
    total: int = 141 * GiB
    util_gpu: int = 73
    util_mem: int = 41
    temp: int = 55
    power_mw: int = 412_000
    ecc: int = 0
    pages_pending: int = pynvml.NVML_FEATURE_DISABLED
    rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    errors: dict[str, int] = field(default_factory=dict)


class FakeNvml:
    """Installs fakes for every pynvml function the sampler calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu], *, events: bool = True) -> None:
        self.gpus = gpus
        self.events: list[tuple[int, int]] = []  # (device index, xid) waiting to be read
        self.init_error: int | None = None
        self.shutdowns = 0

        def answer(field_name: str, index: int, value: Any) -> Any:
            code = self.gpus[index].errors.get(field_name)
            if code is not None:
                raise nvml_error(code)
            return value

        def init() -> None:
            if self.init_error is not None:
                raise nvml_error(self.init_error)

        def wait(evset: Any, timeout_ms: int) -> Any:
            if not self.events:
                raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
            index, xid = self.events.pop(0)
            return types.SimpleNamespace(device=index, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)

        def event_set_create() -> str:
            if not events:
                raise nvml_error(NOT_SUPPORTED)
            return "evset"

        g = lambda h: self.gpus[h]  # noqa: E731 - handles are device indices here
        patches = {
            "nvmlInit": init,
            "nvmlShutdown": lambda: setattr(self, "shutdowns", self.shutdowns + 1),
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": lambda i: i,
            "nvmlDeviceGetIndex": lambda h: h,
            "nvmlDeviceGetUUID": lambda h: f"GPU-{h:04d}",
            "nvmlDeviceGetName": lambda h: "NVIDIA H200",
            "nvmlEventSetCreate": event_set_create,
            "nvmlDeviceRegisterEvents": lambda h, types_, evset: None,
            "nvmlEventSetWait_v2": wait,
            "nvmlEventSetFree": lambda evset: None,
            "nvmlDeviceGetMemoryInfo": lambda h: answer(
                "memory", h, types.SimpleNamespace(used=g(h).used, total=g(h).total, free=g(h).total - g(h).used)
            ),
            "nvmlDeviceGetUtilizationRates": lambda h: answer(
                "utilization", h, types.SimpleNamespace(gpu=g(h).util_gpu, memory=g(h).util_mem)
            ),
            "nvmlDeviceGetTemperature": lambda h, sensor: answer("temperature", h, g(h).temp),
            "nvmlDeviceGetPowerUsage": lambda h: answer("power", h, g(h).power_mw),
            "nvmlDeviceGetTotalEccErrors": lambda h, kind, counter: answer("ecc", h, g(h).ecc),
            "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: answer("pages", h, g(h).pages_pending),
            "nvmlDeviceGetRemappedRows": lambda h: answer("rows", h, g(h).rows),
        }
        for name, fn in patches.items():
            monkeypatch.setattr(pynvml, name, fn)


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Two healthy H200s."""
    return FakeNvml(monkeypatch, [FakeGpu(), FakeGpu(used=10 * GiB, util_gpu=5)])


async def started(source: NvmlSource) -> NvmlSource:
    await source.start()
    return source


async def test_healthy_devices_report_every_field_in_our_units(fake_nvml: FakeNvml) -> None:
    source = await started(NvmlSource())
    try:
        d0, d1 = await source.sample()
    finally:
        await source.aclose()
    assert (d0.index, d0.uuid, d0.name) == (0, "GPU-0000", "NVIDIA H200")
    assert (d0.memory_used_bytes, d0.memory_total_bytes) == (60 * GiB, 141 * GiB)
    assert d0.gpu_utilization == pytest.approx(0.73)  # NVML percent → fraction
    assert d0.memory_utilization == pytest.approx(0.41)
    assert d0.temperature_c == 55.0
    assert d0.power_w == pytest.approx(412.0)  # NVML milliwatts → watts
    assert (d0.ecc_errors, d0.retired_pages_pending, d0.remapped_rows_pending) == (0, False, False)
    assert d0.fault is None and d0.read_errors == 0 and d0.last_xid == 0
    assert (d1.index, d1.memory_used_bytes, d1.gpu_utilization) == (1, 10 * GiB, pytest.approx(0.05))
    assert fake_nvml.shutdowns == 1


async def test_not_supported_fields_are_absent_not_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    # A MIG slice or an H200 without page retirement: NVML answers NotSupported for these.
    unsupported = {name: NOT_SUPPORTED for name in ("utilization", "power", "ecc", "pages", "rows")}
    FakeNvml(monkeypatch, [FakeGpu(errors=unsupported)], events=False)
    source = await started(NvmlSource())
    try:
        (d,) = await source.sample()
    finally:
        await source.aclose()
    assert d.fault is None and d.read_errors == 0
    assert d.memory_used_bytes == 60 * GiB and d.temperature_c == 55.0
    assert (d.gpu_utilization, d.memory_utilization, d.power_w) == (None, None, None)
    assert (d.ecc_errors, d.retired_pages_pending, d.remapped_rows_pending) == (None, None, None)


@pytest.mark.parametrize(
    ("gpu", "fault_part"),
    [
        (FakeGpu(ecc=3), "3 uncorrected ECC errors"),
        (FakeGpu(pages_pending=pynvml.NVML_FEATURE_ENABLED), "retired pages pending"),
        (FakeGpu(rows=(0, 1, 1, 0)), "row remapping pending"),
        (FakeGpu(rows=(0, 1, 0, 1)), "row remapping failed"),
        (FakeGpu(errors={"memory": pynvml.NVML_ERROR_GPU_IS_LOST}), "NVML memory"),
    ],
    ids=["ecc-uncorrected", "retired-pages-pending", "rows-pending", "rows-failed", "gpu-is-lost"],
)
async def test_hardware_errors_are_device_faults(monkeypatch: pytest.MonkeyPatch, gpu: FakeGpu, fault_part: str) -> None:
    FakeNvml(monkeypatch, [FakeGpu(), gpu])
    source = await started(NvmlSource())
    try:
        ok, bad = await source.sample()
    finally:
        await source.aclose()
    assert ok.fault is None
    assert bad.fault is not None and fault_part in bad.fault
    # Only a failed NVML call is a read error (counted in sample_errors_total); ECC counts are readings.
    assert bad.read_errors == (1 if "NVML" in fault_part else 0)


async def test_a_stuck_nvml_call_faults_every_device_until_it_returns(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = pynvml.nvmlDeviceGetMemoryInfo

    def stuck(handle: int) -> Any:
        release.wait(10)  # bounded: the test releases it
        return real(handle)

    source = await started(NvmlSource(call_timeout_s=0.2))
    try:
        monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", stuck)
        first = await source.sample()
        assert all("did not return within 0.2 s" in (d.fault or "") for d in first)
        second = await source.sample()  # the first call is still blocked: no second thread
        assert all("has not returned" in (d.fault or "") for d in second)
        release.set()
        await eventually(lambda: not source._busy.is_set(), what="the stuck call returned")
        assert [d.fault for d in await source.sample()] == [None, None]
    finally:
        release.set()
        await source.aclose()


async def test_fatal_xid_is_a_sticky_fault_and_other_xids_are_only_reported(fake_nvml: FakeNvml) -> None:
    assert 79 in FATAL_XIDS and 13 not in FATAL_XIDS
    source = await started(NvmlSource())
    try:
        fake_nvml.events = [(1, 13)]  # application error on GPU 1: reported, not a fault
        d0, d1 = await source.sample()
        assert (d0.last_xid, d1.last_xid, d1.fault) == (0, 13, None)
        fake_nvml.events = [(0, 79)]  # GPU 0 fell off the bus
        d0, _ = await source.sample()
        assert d0.last_xid == 79 and "Xid 79" in (d0.fault or "")
        d0, _ = await source.sample()  # no new event: the fault stays until a reset
        assert "Xid 79" in (d0.fault or "")
    finally:
        await source.aclose()


async def test_missing_library_is_a_clear_source_error(fake_nvml: FakeNvml) -> None:
    fake_nvml.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    with pytest.raises(GpuSourceError) as err:
        await NvmlSource().start()
    assert str(err.value) == MISSING_LIBRARY_MESSAGE
    assert "libnvidia-ml.so.1" in MISSING_LIBRARY_MESSAGE and "sim:URL" in MISSING_LIBRARY_MESSAGE


async def test_driver_not_loaded_is_a_source_error_naming_the_alternatives(fake_nvml: FakeNvml) -> None:
    fake_nvml.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(GpuSourceError, match="--gpu-source none"):
        await NvmlSource().start()
