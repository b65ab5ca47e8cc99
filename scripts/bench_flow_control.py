#!/usr/bin/env python3
"""What flow control costs (issue 27, docs/decisions/0310), in process, three measurements:

* `overhead` — CPU per request through `ExtProcServicer.Process` with flow control off and on,
  queues empty (every request takes the fast path: a dict lookup, the gate's check, one memoised
  counter), driven as `bench_servicer.py` drives it (same config and messages; the two apps'
  rounds interleaved, best round of each). The difference is what flow control adds.
* `dispatch` — the dispatch cycle with `--queued` requests across `--tenants` tenants in one
  band: the cycle when the gate stays closed (what every tick costs while the fleet is
  saturated: expiry check, one fairness pick, one schedule, one gate check), and per dispatched
  request when the gate admits `--batch` per cycle. `schedule` is a stub returning the request,
  so this is the controller's own cost; the real `RequestPipeline.schedule` (tens of µs,
  `bench_scheduling.py`) adds per dispatch attempt.
* `memory` — bytes per queued request held by flow control (ticket, its future, its places in
  the flow's order and the expiry heap, a flow per tenant), by tracemalloc, over `--queued`
  requests; the request's body and counted prompt are held by the stream anyway.

    .venv/bin/python scripts/bench_flow_control.py [overhead|dispatch|memory|all] [--requests 2000] [--rounds 5]
        [--queued 10000] [--tenants 1000] [--batch 100]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_servicer import MODEL, WORDS, _Context, request_messages  # noqa: E402

from extproc.config.loader import config_from_mapping  # noqa: E402
from extproc.flowcontrol.config import FlowControlConfig  # noqa: E402
from extproc.flowcontrol.controller import FlowController  # noqa: E402
from extproc.flowcontrol.identity import FlowIdentity  # noqa: E402
from extproc.metrics import Metrics  # noqa: E402
from extproc.flowcontrol.metrics import FlowMetrics  # noqa: E402
from extproc.pipeline.request import ModelRuntime  # noqa: E402
from extproc.pipeline.tokens import TokenCounter  # noqa: E402
from extproc.server.app import ExtProcApp  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402


async def overhead(args: argparse.Namespace) -> None:
    base = {
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "admin": {"enabled": False},
        "models": [{"name": MODEL, "max_model_len": 40960}],
        "endpoints": [{"address": "127.0.0.1:9", "models": [MODEL]}],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}},
    }
    counter = TokenCounter.from_source("builtin:qwen3")
    apps = {}
    for name, flow in (("off", None), ("on", {"enabled": True})):
        cfg = config_from_mapping({**base, **({"flow_control": flow} if flow else {})})
        app = ExtProcApp(cfg, registry=CollectorRegistry(), models={m.name: ModelRuntime(m, counter) for m in cfg.models})
        await app.start()
        apps[name] = app
    context = _Context()
    content = " ".join(WORDS[i % len(WORDS)] for i in range(args.tokens))

    async def run(app: ExtProcApp, first: int, n: int) -> float:
        raws = [request_messages(first + i, content) for i in range(n)]
        servicer = app.servicer

        async def one(raw: list[bytes]) -> None:
            async def incoming():
                for r in raw:
                    yield pb.ProcessingRequest.FromString(r)

            async for reply in servicer.Process(incoming(), context):
                reply.SerializeToString()

        c0 = time.process_time()
        for raw in raws:
            await one(raw)
        return (time.process_time() - c0) / n

    try:
        for i, app in enumerate(apps.values()):
            await run(app, i * 500_000_000, max(500, args.requests // 4))  # warm-up
        best: dict[str, list[float]] = {k: [] for k in apps}
        for r in range(args.rounds):
            for i, (name, app) in enumerate(apps.items()):
                best[name].append(await run(app, (i + 1) * 100_000_000 + r * 1_000_000, args.requests))
        off, on = min(best["off"]), min(best["on"])
        fast = apps["on"].metrics.registry.get_sample_value("llm_extproc_flow_requests_total", {"band": "standard", "outcome": "immediate"})
        print(f"overhead: {args.tokens} words, {args.requests} requests x {args.rounds} rounds (best round each)")
        print(f"  flow control off: {off * 1e6:.1f} µs CPU/request; on, queues empty: {on * 1e6:.1f} µs; added {(on - off) * 1e6:+.1f} µs")
        print(f"  medians: off {statistics.median(best['off']) * 1e6:.1f}, on {statistics.median(best['on']) * 1e6:.1f}; fast-path requests counted: {fast:.0f}")
    finally:
        for app in apps.values():
            await app.aclose(grace_s=0)


class _Gate:
    endpoint_open = None  # no per-endpoint test: no runners-up

    def __init__(self) -> None:
        self.room = 0

    def admits(self, routed) -> bool:
        if self.room <= 0:
            return False
        self.room -= 1
        return True


def _controller(fairness: str, gate: _Gate, metrics: bool = True) -> FlowController:
    cfg = FlowControlConfig(enabled=True, fairness=fairness, max_requests=10**7, max_bytes=10**12)
    fm = FlowMetrics(Metrics(CollectorRegistry())) if metrics else None
    return FlowController(cfg, gate, schedule=lambda c: c, reserve=lambda r: None, metrics=fm)  # type: ignore[arg-type]


def _close(fc: FlowController, tickets: list) -> None:
    """Shut the controller down, reading each 503 (nobody awaits them here)."""
    fc.close()
    for t in tickets:
        if t.future.done() and not t.future.cancelled():
            t.future.exception()


def _fill(fc: FlowController, queued: int, tenants: int) -> list:
    idents = [FlowIdentity(f"t{i}", f"t{i}", 1, 1.0 + (i % 4), None, 3600.0) for i in range(tenants)]
    return [fc.enqueue(SimpleNamespace(i=i), MODEL, idents[i % tenants], 700, 200 + (i * 37) % 900) for i in range(queued)]


async def dispatch(args: argparse.Namespace) -> None:
    print(f"dispatch: {args.queued} queued across {args.tenants} tenants (standard band), controller cost only")
    for fairness in ("fcfs", "round-robin", "drr"):
        gate = _Gate()
        fc = _controller(fairness, gate)
        tickets = _fill(fc, args.queued, args.tenants)
        closed = []
        for _ in range(200):
            t0 = time.perf_counter()
            fc.run_cycle()
            closed.append(time.perf_counter() - t0)
        per = []
        while fc.live >= args.batch:
            gate.room = args.batch
            t0 = time.perf_counter()
            fc.run_cycle()
            per.append((time.perf_counter() - t0) / args.batch)
        closed.sort()
        per.sort()
        print(
            f"  {fairness:12s} gate closed: cycle p50 {closed[len(closed) // 2] * 1e6:.1f} µs, p99 {closed[int(len(closed) * 0.99)] * 1e6:.1f} µs; "
            f"per dispatched request (batches of {args.batch}): p50 {per[len(per) // 2] * 1e6:.1f} µs, p99 {per[int(len(per) * 0.99)] * 1e6:.1f} µs"
        )
        _close(fc, tickets)


async def memory(args: argparse.Namespace) -> None:
    gate = _Gate()
    fc = _controller("drr", gate, metrics=False)
    counted = [SimpleNamespace(i=i) for i in range(args.queued)]  # stand-ins: the stream holds the real ones
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    idents = [FlowIdentity(f"t{i}", f"t{i}", 1, 1.0, None, 3600.0) for i in range(args.tenants)]
    tickets = [fc.enqueue(counted[i], MODEL, idents[i % args.tenants], 700, 500) for i in range(args.queued)]
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    print(f"memory: {args.queued} queued across {args.tenants} tenants: {grown / len(tickets):.0f} bytes per queued request held by flow control")
    _close(fc, tickets)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", default="all", choices=["overhead", "dispatch", "memory", "all"])
    ap.add_argument("--tokens", type=int, default=100, help="prompt words (~tokens) per request (overhead)")
    ap.add_argument("--requests", type=int, default=2000, help="requests per round (overhead)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per app (overhead)")
    ap.add_argument("--queued", type=int, default=10_000, help="queued requests (dispatch, memory)")
    ap.add_argument("--tenants", type=int, default=1_000, help="tenants they belong to (dispatch, memory)")
    ap.add_argument("--batch", type=int, default=100, help="requests the gate admits per cycle (dispatch)")
    args = ap.parse_args()
    if args.what in ("overhead", "all"):
        await overhead(args)
    if args.what in ("dispatch", "all"):
        await dispatch(args)
    if args.what in ("memory", "all"):
        await memory(args)


if __name__ == "__main__":
    asyncio.run(main())
