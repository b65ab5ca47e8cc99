"""The ext_proc server's side of the node agents: subscribe to each endpoint's agent and keep
its latest report on `endpoint.node`.

For every endpoint with an `agent` address (`Endpoint.agent`, from `EndpointConfig.agent`; host:port of
`llm-extproc agent`'s gRPC port), one task holds a `llm_extproc.v1.NodeLoad.Watch` stream and
turns each `LoadReport` into a `NodeReport` on `endpoint.node`. When the stream fails, ends
(the agent stopped) or stays silent for `idle_timeout_s`, the task reconnects with capped
exponential backoff and equal jitter: attempt n waits `d/2 + uniform(0, d/2)` seconds with
`d = min(backoff_max_s, backoff_initial_s · 2ⁿ)`; a received report resets n. Each attempt
uses a fresh channel with its own subchannel pool, so gRPC's shared reconnect backoff (up to
120 s) never delays it.

What the scheduler reads (`endpoint.node`, None until the first report):

* `node.usable` — False when the agent reports a device fault (ECC, Xid, NVML error: see
  `extproc.agent.nvml`) or the node unhealthy (engine /health failing). **Filter out
  endpoints with `node is not None and not node.usable`.**
* `node.stale()` — the report is older than `stale_after_s`: the agent is unreachable or
  stuck; treat the load figures as unknown (the last report is kept, never cleared).
* load figures: `gpu_util`, memory, KV blocks, `ttft_p95_ms`, and the node's own `weight`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import grpc

from extproc._proto.llm_extproc.v1 import node_load_pb2 as pb
from extproc._proto.llm_extproc.v1 import node_load_pb2_grpc as pb_grpc
from extproc.aio import cancel_and_wait
from extproc.datastore.endpoints import Datastore, Endpoint

__all__ = ["AgentWatcher", "NodeReport", "backoff_delay"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One node-agent report as the scheduler uses it.

    Attributes:
        gpu_util: mean GPU utilisation over the node's devices (0..1), None if unknown.
        memory_used_bytes / memory_total_bytes: summed over devices (bytes), None if unknown.
        device_fault: the devices' faults ("GPU 0: ..."), None when every device is fine.
        kv_blocks_free / kv_blocks_total: the engine's KV pool (blocks), None if unknown.
        ttft_p95_ms: the engine's TTFT P95 over the agent's window (milliseconds), None if
            no request got a first token in it.
        weight: the agent's compute-aware weight (0..1; 0 when unhealthy).
        healthy: the agent's verdict (no device fault, engine /health passing).
        usable: False when the endpoint must take no traffic: a device fault or not healthy.
        reason: why not healthy ("" when healthy).
        node: the agent's node name.
        received_at: `time.monotonic()` when the report arrived (seconds).
        stale_after_s: age past which `stale()` is True (seconds).
    """

    gpu_util: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    device_fault: str | None
    kv_blocks_free: int | None
    kv_blocks_total: int | None
    ttft_p95_ms: float | None
    weight: float
    healthy: bool
    usable: bool
    reason: str
    node: str
    received_at: float
    stale_after_s: float

    def stale(self, now: float | None = None) -> bool:
        """True when the report is older than `stale_after_s` (`now`: monotonic seconds)."""
        return (time.monotonic() if now is None else now) - self.received_at > self.stale_after_s

    @classmethod
    def from_proto(cls, report: pb.LoadReport, *, received_at: float, stale_after_s: float) -> NodeReport:
        """Summarise a `LoadReport` (devices aggregated, engine fields copied)."""
        devs = report.devices
        utils = [d.gpu_utilization for d in devs if d.HasField("gpu_utilization")]
        used = [d.memory_used_bytes for d in devs if d.HasField("memory_used_bytes")]
        total = [d.memory_total_bytes for d in devs if d.HasField("memory_total_bytes")]
        faults = [f"GPU {d.index}: {d.fault}" for d in devs if d.fault]
        has_engine = report.HasField("engine")
        eng = report.engine

        def opt(field: str) -> float | int | None:
            return getattr(eng, field) if has_engine and eng.HasField(field) else None

        device_fault = "; ".join(faults) or None
        return cls(
            gpu_util=sum(utils) / len(utils) if utils else None,
            memory_used_bytes=sum(used) if used else None,
            memory_total_bytes=sum(total) if total else None,
            device_fault=device_fault,
            kv_blocks_free=opt("kv_blocks_free"),
            kv_blocks_total=opt("kv_blocks_total"),
            ttft_p95_ms=opt("ttft_p95_ms"),
            weight=report.weight,
            healthy=report.healthy,
            usable=report.healthy and device_fault is None,
            reason=report.reason,
            node=report.node,
            received_at=received_at,
            stale_after_s=stale_after_s,
        )


def backoff_delay(attempt: int, *, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Seconds to wait before reconnect attempt `attempt` (0-based): equal jitter over a capped
    exponential, `d/2 + uniform(0, d/2)` with `d = min(max_s, initial_s · 2^attempt)`."""
    d = min(max_s, initial_s * (2.0 ** min(attempt, 30)))
    return d / 2 + rng.uniform(0.0, d / 2)


class AgentWatcher:
    """Keeps `endpoint.node` of every endpoint with an agent up to date.

    Args:
        store: the datastore whose endpoints receive reports; those with `agent` set now are
            watched, and those `add` names later.
        min_interval_s: ask agents for at most one report per this many seconds (0: every
            sampling period).
        stale_after_s: reports older than this are stale (seconds).
        idle_timeout_s: reconnect when a stream delivers nothing for this long (seconds).
        backoff_initial_s / backoff_max_s: reconnect backoff bounds (seconds).
        rng: jitter source (tests pass a seeded one).

    Nothing runs until `start()`.
    """

    def __init__(
        self,
        store: Datastore,
        *,
        min_interval_s: float = 0.0,
        stale_after_s: float = 3.0,
        idle_timeout_s: float = 10.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        self._store = store
        self._targets: dict[str, str] = {ep.address: ep.agent for ep in store.all() if ep.agent}
        """The agent watched for each endpoint address, in configuration order. A watch reports
        to the endpoint the store lists under its address now (a reload or discovery may have
        replaced the object)."""
        self._min_interval = min_interval_s
        self._stale_after = stale_after_s
        self._idle_timeout = idle_timeout_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._rng = rng or random.Random()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # by endpoint address
        self._started = False
        self.connects: dict[str, int] = {}
        """Streams opened per agent address (count), for tests and diagnostics."""

    @property
    def agents(self) -> list[str]:
        """The watched agent addresses, in configuration order."""
        return list(self._targets.values())

    async def start(self) -> None:
        """Start one watch task per endpoint with an agent (returns at once)."""
        self._started = True
        for address, agent in self._targets.items():
            self._spawn(address, agent)

    def _spawn(self, address: str, agent: str) -> None:
        if address not in self._tasks:
            self._tasks[address] = asyncio.create_task(self._watch(address, agent), name=f"agent-watch-{agent}")

    def add(self, ep: Endpoint, agent: str) -> None:
        """Watch the agent (`host:port`) of an endpoint that joined after construction; an
        endpoint watched on another agent (a reload changed it) moves to this one. Keyed on
        the endpoint's address: the same address and agent again keeps its stream (no
        reconnect), its reports going to whichever object the store lists under that address."""
        if self._targets.get(ep.address) == agent:
            return
        self.remove(ep)
        self._targets[ep.address] = agent
        if self._started:
            self._spawn(ep.address, agent)

    def remove(self, ep: Endpoint) -> None:
        """Stop watching the agent of an endpoint that left."""
        self._targets.pop(ep.address, None)
        task = self._tasks.pop(ep.address, None)
        if task is not None:
            task.cancel()

    async def aclose(self) -> None:
        """Cancel every watch task and wait for them; `endpoint.node` keeps its last report."""
        self._started = False
        await cancel_and_wait(self._tasks.values())
        self._tasks = {}

    def _request(self) -> pb.WatchLoadRequest:
        req = pb.WatchLoadRequest()
        if self._min_interval > 0:
            req.min_interval.FromNanoseconds(int(self._min_interval * 1e9))
        return req

    async def _watch(self, address: str, addr: str) -> None:
        attempt = 0
        initial, cap = self._backoff
        options = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", int(initial * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(initial * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(cap * 1000)),
        ]
        while True:
            try:
                async with grpc.aio.insecure_channel(addr, options=options) as channel:
                    call = pb_grpc.NodeLoadStub(channel).Watch(self._request())
                    self.connects[addr] = self.connects.get(addr, 0) + 1
                    while True:
                        report = await asyncio.wait_for(call.read(), self._idle_timeout)
                        if report is grpc.aio.EOF:
                            log.info("agent %s ended its stream", addr)
                            break
                        ep = self._store.get(address)
                        if ep is not None:  # else it left the store; `remove` is on its way
                            ep.node = NodeReport.from_proto(report, received_at=time.monotonic(), stale_after_s=self._stale_after)
                        attempt = 0
            except TimeoutError:
                log.warning("agent %s sent nothing for %.3g s; reconnecting", addr, self._idle_timeout)
            except grpc.aio.AioRpcError as exc:
                log.debug("agent %s: %s %s", addr, exc.code().name, exc.details())
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the watch for good
                log.exception("watching agent %s failed", addr)
            await asyncio.sleep(backoff_delay(attempt, initial_s=initial, max_s=cap, rng=self._rng))
            attempt += 1
