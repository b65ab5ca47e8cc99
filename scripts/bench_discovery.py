#!/usr/bin/env python3
"""What endpoint churn costs on the event loop, in microseconds (all synchronous work).

A fleet of `--endpoints` endpoints, each with the metric series and index state traffic leaves
(routed / ejection / scrape / TTFT series, prefix-index blocks, a session), on one app
(`ExtProcApp`, not started). Measured, each `--repeat` times:

  republish   Discovery.apply of a report that changes nothing (DNS republishes only on change,
              Kubernetes on every slice event: this is the cost per event)
  replace     one endpoint leaves and a new one joins (drain of an idle endpoint = removal:
              the hooks, the registry walk that removes its metric series, the add hooks)

Reported: median and best µs per operation. The machine is shared: compare rows of one run.

    .venv/bin/python scripts/bench_discovery.py [--endpoints 200] [--repeat 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

from extproc.config.loader import config_from_mapping
from extproc.config.schema import EndpointConfig
from extproc.discovery.base import Discovered
from extproc.discovery.manager import Discovery
from extproc.prefix.sessions import session_key
from extproc.server.app import ExtProcApp

MODEL = "m"


def address(i: int) -> str:
    return f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000"


def warm(app: ExtProcApp, addr: str) -> None:
    """The per-endpoint state a day of traffic leaves."""
    m = app.metrics
    m.child(m.endpoint_routed, addr).inc()
    m.child(m.endpoint_ejections, addr).inc()
    m.scrape_seconds.labels(addr).observe(0.01)
    m.endpoint_healthy.labels(addr).set(1)
    app.telemetry.ttft.labels(MODEL, addr).observe(0.2)
    app.prefix.index.add(addr, list(range(hash(addr) % 1000, hash(addr) % 1000 + 64)))
    app.prefix.sessions.bind(session_key(addr), addr, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    n = args.endpoints
    cfg = config_from_mapping({"models": [{"name": MODEL}], "endpoints": [{"address": address(i), "models": [MODEL]} for i in range(n)]})
    app = ExtProcApp(cfg)
    for ep in app.store.all():
        warm(app, ep.address)
    d = Discovery(app.store, [])
    d._settled = True  # noqa: SLF001 - no sources run here: apply the report below as complete
    d._reports = [{e.address: Discovered(e) for e in cfg.endpoints}]  # noqa: SLF001
    results: dict[str, list[float]] = {"republish": [], "replace": []}
    nxt = n
    for _ in range(args.repeat):
        t = time.perf_counter()
        d.apply()
        results["republish"].append(time.perf_counter() - t)
        report = dict(d._reports[0])  # noqa: SLF001
        gone = next(iter(report))
        del report[gone]
        new = EndpointConfig(address=address(nxt), models=[MODEL])
        nxt += 1
        report[new.address] = Discovered(new)
        d._reports = [report]  # noqa: SLF001
        t = time.perf_counter()
        d.apply()
        results["replace"].append(time.perf_counter() - t)
        assert app.store.get(gone) is None and app.store.get(new.address) is not None
        warm(app, new.address)
    series = sum(len(getattr(c, "_metrics", {})) for c in list(app.metrics.registry._collector_to_names))  # noqa: SLF001
    print(f"endpoints: {n}; labelled series on the registry: {series}; repeat: {args.repeat}")
    print(f"{'operation':<12} {'median µs':>10} {'best µs':>10}")
    for name, xs in results.items():
        print(f"{name:<12} {statistics.median(xs) * 1e6:>10.0f} {min(xs) * 1e6:>10.0f}")


if __name__ == "__main__":
    main()
