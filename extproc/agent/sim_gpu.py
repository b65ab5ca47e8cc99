"""`--gpu-source sim:URL`: one simulated GPU read from `GET URL/sim/gpu` of `llm-extproc sim`.

The simulator answers `{"memory_used_bytes": int, "memory_total_bytes": int,
"utilization": float 0..1}`. A failed request or a body of another shape is a device fault,
as an NVML error would be on real hardware: the agent cannot vouch for the device.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from extproc.agent.devices import DeviceSample

__all__ = ["SimGpuSource"]


def _parse(body: Any) -> tuple[int, int, float]:
    """(used bytes, total bytes, utilisation) from a /sim/gpu body.

    Raises:
        ValueError: a field is missing, of the wrong type or out of range.
    """
    if not isinstance(body, dict):
        raise ValueError("body is not a JSON object")
    used, total, util = body.get("memory_used_bytes"), body.get("memory_total_bytes"), body.get("utilization")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (used, total)):
        raise ValueError("memory_used_bytes and memory_total_bytes must be non-negative integers")
    if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0.0 <= util <= 1.0:
        raise ValueError("utilization must be a number in 0..1")
    return used, total, float(util)


class SimGpuSource:
    """One simulated device (index 0, uuid `sim-0`).

    Args:
        base_url: the simulator's base URL (`http://127.0.0.1:8000`).
        timeout_s: per-request timeout (seconds).
    """

    name = "sim"

    def __init__(self, base_url: str, *, timeout_s: float = 1.0) -> None:
        self.url = base_url.rstrip("/") + "/sim/gpu"
        self._timeout = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))

    async def sample(self) -> list[DeviceSample]:
        """Read the simulated GPU; a failure comes back as its `fault`."""
        assert self._session is not None, "start() first"
        try:
            async with self._session.get(self.url) as resp:
                if resp.status != 200:
                    raise ValueError(f"status {resp.status}")
                used, total, util = _parse(await resp.json(content_type=None))
        except TimeoutError:
            return [DeviceSample(0, "sim-0", "simulated", fault=f"{self.url}: timeout", read_errors=1)]
        except (aiohttp.ClientError, ValueError) as exc:
            return [DeviceSample(0, "sim-0", "simulated", fault=f"{self.url}: {exc or type(exc).__name__}", read_errors=1)]
        return [
            DeviceSample(
                0, "sim-0", "simulated", memory_used_bytes=used, memory_total_bytes=total, gpu_utilization=util
            )
        ]

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
