#!/usr/bin/env python3
"""Load-aware scheduling against Envoy's own balancers, on a real trace, at equal load.

The method the scheduling issue asks for, on a mixed fleet (2× H100, 2× A100, Qwen3-8B
simulators) behind a real Envoy:

1. Envoy least_request's capacity from a grid of loads (trace rate × each `--grid` scale, the
   first being the light load): the highest offered rate at which its p99 TTFT stays within
   `--bound` × its light-load p99 (linear interpolation between grid points; on a mixed fleet
   p99 is several times p50 even when idle, hence a relative bound).
2. Every policy, on the same requests with fresh simulators (`llm-extproc bench`), at the light
   load and at multiples of that capacity (`--multiples`, default 0.5×, 1.0× and 1.2×): TTFT p50/p99, E2E p99, output tokens/s,
   goodput, errors and 429s by reason.
3. Each policy's capacity at the same relative bound, interpolated over those points, as a
   multiple of least_request's ("≥" when it holds the bound even at the highest multiple).

    .venv/bin/python scripts/bench_scheduling.py --trace ../shared/data/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv

(where to get the trace: the top of docs/benchmarks.md)

Latencies are in simulated time (the simulators may run slower than real time to keep the
2-core load generator on schedule). Writes a markdown table to stdout and every report (JSON)
to `--out`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

POLICIES = ("envoy-round-robin", "envoy-least-request", "llm-extproc")
BASELINE = "envoy-least-request"


def bench(args: argparse.Namespace, policies: list[str], scales: list[float], out: Path) -> list[dict]:
    """Run `llm-extproc bench` once per load (so each gets its own automatic simulator speed:
    real time at light load, slower only where the load generator needs it) and return all runs."""
    runs: list[dict] = []
    for scale in scales:
        runs += _bench_one(args, policies, scale, out.with_name(f"{out.stem}-{scale:g}.json"))
    return runs


def _bench_one(args: argparse.Namespace, policies: list[str], scale: float, out: Path) -> list[dict]:
    cmd = [
        sys.executable, "-m", "extproc", "bench",
        "--trace", args.trace,
        "--policies", ",".join(policies),
        "--requests", str(args.requests),
        "--rate-scale", f"{scale:g}",
        "--seed", str(args.seed),
        "--json", str(out),
    ]  # fmt: skip
    if args.speed:
        cmd += ["--speed", str(args.speed)]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["runs"]


def capacity(runs: list[dict], bound: float) -> tuple[float | None, float]:
    """(capacity in offered req/s or None if even the lightest load breaks the bound, light p99):
    `extproc.bench.capacity.capacity_at_bound` at `bound` × the lightest load's p99 TTFT."""
    from extproc.bench.capacity import capacity_at_bound

    light = min(runs, key=lambda r: r["offered_rps"])["ttft_ms"]["p99"]
    return capacity_at_bound([(r["offered_rps"], r["ttft_ms"]["p99"]) for r in runs], bound * light), light


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--grid", default="3,10,15,20", help=f"trace-rate scales for {BASELINE}'s capacity; the first is the light load")
    ap.add_argument("--bound", type=float, default=3.0, help="capacity: p99 TTFT within this × light-load p99")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speed", default="", help="simulator speed (default: bench's auto)")
    ap.add_argument("--out", default="bench-scheduling", help="directory for the JSON reports")
    ap.add_argument("--multiples", default="0.5,1.0,1.2", help="loads to run every policy at, as multiples of least_request's capacity")
    ap.add_argument("--baseline-grid-json", default="", help="reuse least_request's grid runs from these bench JSON files (comma-separated)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    grid = [float(x) for x in args.grid.split(",")]
    if args.baseline_grid_json:
        base_runs = [r for f in args.baseline_grid_json.split(",") for r in json.loads(Path(f).read_text())["runs"]]
        base_runs.sort(key=lambda r: r["offered_rps"])
    else:
        base_runs = bench(args, [BASELINE], grid, out / "baseline.json")
    rate_per_scale = base_runs[0]["offered_rps"] / grid[0]
    base_cap, _ = capacity(base_runs, args.bound)
    if base_cap is None:
        sys.exit(f"{BASELINE} breaks the p99 bound at every grid load; lower the grid")
    multiples = tuple(float(x) for x in args.multiples.split(","))
    # Every policy at the light load and at the multiples of least_request's capacity; each
    # policy's own capacity is interpolated over those points.
    at = bench(args, list(POLICIES), [grid[0]] + [m * base_cap / rate_per_scale for m in multiples], out / "policies.json")
    by_policy = {p: [r for r in at if r["policy"] == p] for p in POLICIES}
    caps = {p: capacity(rs, args.bound) for p, rs in by_policy.items()}
    base_cap_same = caps[BASELINE][0] or base_cap

    print(f"\nTrace {Path(args.trace).name}, {args.requests} requests per run, fleet 2× h100-qwen3-8b + 2× a100-qwen3-8b, "
          f"latencies in simulated ms; capacity = highest offered rate with p99 TTFT ≤ {args.bound:g}× its light-load p99.\n")
    grid_s = ", ".join(f"{r['offered_rps']:.1f} req/s → p99 {r['ttft_ms']['p99']:.0f} ms" for r in base_runs)
    print(f"{BASELINE} capacity from its grid ({grid_s}): {base_cap:.1f} req/s\n")
    print("| load (× LR capacity) | policy | offered req/s | TTFT p50 | TTFT p99 | E2E p99 | output tok/s | goodput req/s | errors / 429s | late sends |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for m in (None, *multiples):
        target = grid[0] * rate_per_scale if m is None else m * base_cap
        rows = [r for r in at if abs(r["offered_rps"] - target) / target < 0.02]
        for r in sorted(rows, key=lambda r: POLICIES.index(r["policy"])):
            errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "–"
            label = "light" if m is None else f"{m:.1f}"
            print(f"| {label} | {r['policy']} | {r['offered_rps']:.1f} | {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p99']:.0f} | "
                  f"{r['e2e_ms']['p99']:.0f} | {r['output_tokens_per_s']:.0f} | {r['goodput_rps']:.2f} | {errors} | "
                  f"{r['behind_schedule']['fraction']:.1%} |")
    print("\n| policy | light-load p99 TTFT (ms) | capacity (req/s) | × least_request |")
    print("|---|---:|---:|---:|")
    for p in POLICIES:
        cap, light = caps[p]
        top = max(r["offered_rps"] for r in by_policy[p])
        cap_s = "below the light load" if cap is None else (f"≥ {cap:.1f}" if cap >= top else f"{cap:.1f}")
        mult = "–" if cap is None else (f"≥ {cap / base_cap_same:.2f}" if cap >= top else f"{cap / base_cap_same:.2f}")
        print(f"| {p} | {light:.0f} | {cap_s} | {mult} |")


if __name__ == "__main__":
    main()
