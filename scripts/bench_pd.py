#!/usr/bin/env python3
"""Prefill/decode disaggregation against a unified fleet of the same simulated GPUs (issue 31).

Fleets (Qwen3-8B simulators, real Envoy, `llm-extproc serve` with its default profile):

- `unified`: 4× h100-qwen3-8b, every engine prefills and decodes;
- `pd`: `--fleet pd`, 2 prefill + 2 decode h100-qwen3-8b, each decode engine behind
  `llm-extproc pd-sidecar`; the KV moves at the simulators' 25 GB/s (decision 0330).

Workloads:

- `long`: llm-d's long-input shape, 5000 prompt / 250 output tokens, Poisson arrivals;
- `azure-conv`: the Azure LLM inference 2023 conversation trace's first `--requests` rows.

Each workload runs at `--loads` (offered prompt + output tokens per second as a fraction of the
4 engines' prefill throughput, `extproc.bench.runner.auto_rate_scale`; the same requests, the
same rate, for both fleets), then on the `pd` fleet at `--sweep-load` with the disaggregation
threshold swept over `--thresholds` (uncached tokens). Per run: TTFT, ITL and E2E p50/p99,
output tokens/s, goodput (TTFT ≤ 2 s and mean ITL ≤ 100 ms, `bench`'s default SLO), and on the
pd fleet the decision mix from the route-debug header.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_pd.py --out out/bench-pd

Latencies are simulated time. Writes `<out>/pd.md` (also printed) and every run's report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

from rich.console import Console

from extproc.bench.commands import BenchOptions, Outputs, run_bench
from extproc.bench.policies import parse_policies
from extproc.bench.results import SLO
from extproc.bench.runner import ReplayOptions, Workload, auto_rate_scale, auto_speed, fit_context
from extproc.bench.stacks import StackSettings
from extproc.bench.traces import TraceRequest, load_trace
from extproc.stack.fleet import PD_FLEET

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"
UNIFIED = ("h100-qwen3-8b",) * 4
FLEETS = {"unified": (UNIFIED, None), "pd": (tuple(p for p, _ in PD_FLEET), tuple(r for _, r in PD_FLEET))}
MAX_MODEL_LEN = 40960


def long_input(n: int, seed: int) -> Workload:
    """`n` requests of 5000 prompt / 250 output tokens, Poisson arrivals at 1 req/s (scaled later)."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        reqs.append(TraceRequest(arrival_s=t, input_tokens=5000, output_tokens=250))
        t += rng.expovariate(1.0)
    return Workload("long-5000-250", reqs)


def azure(n: int, traces: Path) -> Workload:
    trace = load_trace(traces / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv", limit=n)
    workload, _ = fit_context(Workload("azure-conv", trace.requests), MAX_MODEL_LEN)
    return workload


def run(name: str, workload: Workload, fleet: str, load: float, threshold: int | None, out: Path, console: Console) -> dict:
    """One bench run; its report's run, with the decision mix added for the pd fleet."""
    profiles, roles = FLEETS[fleet]
    scale = auto_rate_scale(workload, UNIFIED, load)
    scaled = workload.scaled(scale)
    speed = auto_speed(scaled.offered_rps, 12.0)
    overrides = {"scheduling": {"explain_header": True, **({"disaggregation": {"threshold_tokens": threshold}} if threshold is not None else {})}}
    stem = f"{name}-{fleet}-l{load:g}" + (f"-t{threshold}" if threshold is not None else "")
    options = BenchOptions(
        policies=parse_policies("llm-extproc"), workload=scaled, rate_scales=[1.0], duration_s=None,
        stack=StackSettings(profiles=profiles, roles=roles, speed=speed, server_overrides=overrides),
        replay=ReplayOptions(speed=speed, route_debug=True, progress=False, request_timeout_s=300.0),
        outputs=Outputs(json_path=out / f"{stem}.json", requests_path=out / f"{stem}-requests.jsonl"),
        slo=SLO(),
    )  # fmt: skip
    if asyncio.run(run_bench(options, console)) != 0:
        raise SystemExit(f"bench {stem} failed")
    (report,) = json.loads((out / f"{stem}.json").read_text())["runs"]
    mix = {"prefill-decode": 0, "decode-only": 0}
    for line in (out / f"{stem}-requests.jsonl").read_text().splitlines():
        debug = json.loads(line).get("route_debug") or ""
        for k in mix:
            if f"pd={k}/" in debug:
                mix[k] += 1
    report.update(fleet=fleet, load=load, threshold=threshold, mix=mix, speed=speed, workload=name)
    return report


def decision_cost(n: int = 2000) -> str:
    """CPU per scheduling cycle (µs): the P/D pair (pd-decode + pd-prefill over 4 prefill and 4
    decode endpoints) against one load-aware pick over 8 unified ones, a 5000-token request."""
    import time
    import timeit

    from extproc.config.schema import EndpointConfig, SchedulingConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.datastore.scraper import EngineMetrics
    from extproc.pipeline.request import build_profile
    from extproc.scheduling.framework import SchedulingContext
    from extproc.scheduling.pd import PDHandler
    from extproc.types import LLMRequest, RequestKind, TokenCount

    profiles = SchedulingConfig().all_profiles()

    def store(roles: list[str]) -> Datastore:
        ds = Datastore([EndpointConfig(address=f"10.0.0.{i}:8000", models=["m"], role=r) for i, r in enumerate(roles, 1)])
        for ep in ds.all():
            ep.engine = EngineMetrics(running=8, waiting=1, kv_usage=0.3, num_gpu_blocks=20000, block_size=16, scraped_at=time.monotonic())
        return ds

    def ctx() -> SchedulingContext:
        req = LLMRequest(kind=RequestKind.CHAT, model="m", served_model="m", prompt_tokens=TokenCount(5000))
        return SchedulingContext(req, 250, 16, time.monotonic(), random.Random(0))

    unified, pd_store = store(["both"] * 8).all(), store(["prefill"] * 4 + ["decode"] * 4).all()
    single = build_profile("load-aware", profiles["load-aware"])
    pair = PDHandler(build_profile("pd-decode", profiles["pd-decode"]), build_profile("pd-prefill", profiles["pd-prefill"]), 256, 25e9)
    t1 = min(timeit.repeat(lambda: single.run(ctx(), unified), number=n, repeat=3)) / n
    t2 = min(timeit.repeat(lambda: pair.run(ctx(), pd_store, 147456), number=n, repeat=3)) / n
    return f"decision CPU: one load-aware pick over 8 endpoints {t1 * 1e6:.0f} µs; P/D pair over 4 + 4 {t2 * 1e6:.0f} µs"


def row(r: dict) -> str:
    t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
    mix = r["mix"]
    total = sum(mix.values())
    share = f"{mix['prefill-decode'] / total:.0%}" if total and r["fleet"] == "pd" else "–"
    errors = sum(r["errors"].values()) if isinstance(r.get("errors"), dict) else 0
    thr = "–" if r["threshold"] is None else str(r["threshold"])
    return (f"| {r['workload']} | {r['fleet']} | {r['load']:g} | {thr} | {r['offered_rps']:.1f} | {t['p50']:.0f} / {t['p99']:.0f} | "
            f"{i['p50']:.1f} / {i['p99']:.1f} | {e['p50']:.0f} / {e['p99']:.0f} | {r['output_tokens_per_s']:.0f} | "
            f"{r['goodput_rps']:.2f} | {share} | {errors} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench-pd")
    ap.add_argument("--long-requests", type=int, default=120)
    ap.add_argument("--requests", type=int, default=300, help="Azure conversation requests")
    ap.add_argument("--loads", default="0.3,0.45", help="offered load as a fraction of the 4 engines' prefill throughput (1× and 1.5×)")
    ap.add_argument("--sweep-load", type=float, default=0.3)
    ap.add_argument("--thresholds", default="0,256,1024,4096")
    ap.add_argument("--workloads", default="long,azure-conv")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", type=Path, default=TRACES, help="the traces directory (shared/data/traces)")
    ap.add_argument("--cost-only", action="store_true", help="measure the decision's CPU only (no fleet)")
    args = ap.parse_args()
    cost = decision_cost()
    print(cost)
    if args.cost_only:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    loads = [float(x) for x in args.loads.split(",")]
    thresholds = [int(x) for x in args.thresholds.split(",")]
    workloads = {"long": lambda: long_input(args.long_requests, args.seed), "azure-conv": lambda: azure(args.requests, args.traces)}
    runs = []
    for name in args.workloads.split(","):
        w = workloads[name]()
        for load in loads:
            for fleet in FLEETS:
                runs.append(run(name, w, fleet, load, None, out, console))
        for threshold in thresholds:
            runs.append(run(name, w, "pd", args.sweep_load, threshold, out, console))
    lines = [
        "| workload | fleet | load | threshold | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | output tok/s | goodput req/s | disaggregated | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(row(r) for r in runs),
    ]
    text = cost + "\n\n" + "\n".join(lines)
    print(text)
    (out / "pd.md").write_text(text + "\n", encoding="utf-8")
    (out / "pd.json").write_text(json.dumps(runs, indent=1), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
