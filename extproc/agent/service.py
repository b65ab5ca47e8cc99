"""`llm_extproc.v1.NodeLoad` (Get, Watch) over the agent's latest report, and the health
service names the agent maintains on `grpc.health.v1.Health`.

Health services (all on the agent's gRPC port):

    ""                        the node: SERVING unless a device fault or a failing engine
    "llm_extproc.v1.NodeLoad" the same verdict, under a name that says what it is about;
                              use it as Envoy's `grpc_health_check.service_name`
    "gpu"                     devices only: NOT_SERVING on any device fault
    "engine"                  the engine's /health only (absent when no engine is watched)

Load never flips health: a busy node stays SERVING and reports a lower weight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from extproc._proto.llm_extproc.v1 import node_load_pb2 as pb
from extproc._proto.llm_extproc.v1 import node_load_pb2_grpc as pb_grpc

__all__ = ["ENGINE_SERVICE", "GPU_SERVICE", "NODE_LOAD_SERVICE", "NodeLoadServicer", "ReportBoard"]

NODE_LOAD_SERVICE: str = pb.DESCRIPTOR.services_by_name["NodeLoad"].full_name
GPU_SERVICE = "gpu"
ENGINE_SERVICE = "engine"


class ReportBoard:
    """The latest `LoadReport` and a way to wait for the next one (event-loop thread only)."""

    def __init__(self) -> None:
        self._latest: pb.LoadReport | None = None
        self._seq = 0
        self._changed: asyncio.Event | None = None
        self._closed = False

    @property
    def latest(self) -> pb.LoadReport | None:
        return self._latest

    @property
    def seq(self) -> int:
        """Number of reports published so far."""
        return self._seq

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def publish(self, report: pb.LoadReport) -> None:
        """Make `report` the latest and wake every waiter."""
        self._latest = report
        self._seq += 1
        self._wake()

    def close(self) -> None:
        """Wake every waiter for good: `next_after` returns None from now on."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def next_after(self, seq: int) -> tuple[int, pb.LoadReport] | None:
        """Wait until a report newer than number `seq` exists; return (its number, it), or
        None once the board is closed."""
        while not self._closed:
            if self._seq > seq and self._latest is not None:
                return self._seq, self._latest
            await self._event().wait()
        return None


class NodeLoadServicer(pb_grpc.NodeLoadServicer):
    """Serves a `ReportBoard`.

    Args:
        board: where the agent publishes its reports.
    """

    def __init__(self, board: ReportBoard) -> None:
        self._board = board

    async def Get(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadReport:
        report = self._board.latest
        if report is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no sample taken yet")
        return report

    async def Watch(
        self, request: pb.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LoadReport]:
        min_interval = 0.0
        if request.HasField("min_interval"):
            min_interval = request.min_interval.ToTimedelta().total_seconds()
            if min_interval < 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "min_interval must not be negative")
        seq = 0
        next_send = 0.0
        while True:
            got = await self._board.next_after(seq)
            if got is None:
                return
            wait = next_send - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                got = (self._board.seq, self._board.latest) if self._board.latest is not None else got
            seq, report = got
            yield report
            next_send = time.monotonic() + min_interval
