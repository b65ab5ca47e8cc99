#!/usr/bin/env python3
"""Multi-LoRA routing (issue 32): adapter-aware against adapter-blind and activity-only routing.

Every policy replays the same requests on a fresh simulated `--fleet lora` (4× H100 serving
Qwen3-8B, `--adapters` rank-16 LoRA adapters, `--max-loras` GPU slots and twice as many in host
memory per engine, `extproc.sim.lora`), one after another:

- `llm-extproc-lora`: the `lora` profile (`lora-affinity-scorer`: residency + spread rule);
- `llm-extproc`: today's default (`load-aware`), blind to adapters;
- `llm-extproc-lora-activity`: the `lora` profile with GIE's activity-only rule;
- `envoy-least-request`: Envoy alone.

The workload (`extproc.bench.lora_workload`): Zipf(`--zipf`) adapter popularity (or
`--hot-share` for adapter 0), a `--system-tokens` system prompt per adapter, a unique
`--user-tokens` user turn, `--output-tokens` out, Poisson arrivals. Loads (`--loads`) are
multiples of the fleet's prefill capacity (`extproc.bench.runner.fleet_prefill_capacity`: offered
prompt + output tokens/s over Σ 1/b of the engines), the definition `bench --rate-scale auto`
uses. Per run: TTFT p50/p99, goodput (requests/s meeting TTFT ≤ `--slo-ttft-ms` and mean ITL
≤ 100 ms), adapter loads per 1,000 requests (the engines' own count, `/sim/state`), and with
`--hot-share` the hot adapter's p99 TTFT and the others'.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_lora.py --out out/bench-lora

Writes `<out>/lora.json` after every run (the rows so far) and, at the end, `<out>/lora.md`
(also printed). SIGTERM (a `timeout`) stops it as Ctrl-C does, stopping every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from extproc.bench.cli import BENCH_MAX_WALL_RPS
from extproc.bench.lora_workload import LoraWorkloadSpec, lora_workload
from extproc.bench.policies import parse_policies
from extproc.bench.prompts import PromptSynthesizer
from extproc.bench.results import SLO, LabeledRun, percentiles, summarize_run
from extproc.bench.runner import ReplayOptions, Workload, auto_speed, fleet_prefill_capacity, get_all, replay
from extproc.bench.stacks import PolicyStack, StackSettings
from extproc.pipeline.tokens import TokenCounter
from extproc.stack.fleet import NAMED_FLEETS, LoraFleet, adapter_names

POLICIES = "llm-extproc-lora,llm-extproc,llm-extproc-lora-activity,envoy-least-request"


async def adapter_loads(urls: list[str]) -> int | None:
    """Adapter loads so far over the engines (`/sim/state`'s `lora.loads`), None if one fails."""
    states = await get_all(urls, "/sim/state", timeout_s=5.0)
    return None if states is None else sum((s.json().get("lora") or {}).get("loads", 0) for s in states)


async def run_policy(policy_name: str, workload: Workload, prompts: PromptSynthesizer, settings: StackSettings, console: Console) -> tuple[LabeledRun, int | None]:
    """One replay on a fresh stack; the run and the adapter loads it caused."""
    (policy,) = parse_policies(policy_name)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as logs:
        stack = PolicyStack(policy, settings, workdir=Path(logs))
        try:
            await stack.start()
            run = await replay(stack, workload, prompts, ReplayOptions(speed=settings.speed, progress=False), console=console)
            loads = await adapter_loads(stack.fleet.urls)
        finally:
            await stack.aclose()
    return run, loads


def adapter_p99(run: LabeledRun, models: list[str | None], hot: str) -> tuple[float | None, float | None]:
    """p99 TTFT (ms, the run's time unit) of the hot adapter's requests and of the others'."""
    scale = 1000.0
    hot_ttft = [r.ttft_s for r in run.record.results if r.ok and r.ttft_s is not None and models[r.index] == hot]
    rest = [r.ttft_s for r in run.record.results if r.ok and r.ttft_s is not None and models[r.index] != hot]
    return percentiles(hot_ttft, [99], scale=scale)[0], percentiles(rest, [99], scale=scale)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/bench-lora")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--loads", default="0.5,1", help="multiples of the fleet's prefill capacity")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (workload and simulators)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--hot-share", type=float, default=None)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--lora-metrics", default="residency", choices=["residency", "activity"])
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    args = ap.parse_args()
    # A `timeout` (SIGTERM) stops the run as Ctrl-C does: each stack's `finally` stops its
    # simulators, Envoy and llm-extproc (a plain SIGTERM left the simulators running).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    console = Console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = NAMED_FLEETS["lora"].profiles
    lora = LoraFleet(tuple(adapter_names(args.adapters)), max_loras=args.max_loras, max_cpu_loras=2 * args.max_loras, metrics=args.lora_metrics)
    prompts = PromptSynthesizer(TokenCounter.from_source("builtin:qwen3"))
    slo = SLO(ttft_ms=args.slo_ttft_ms)
    rows: list[dict[str, Any]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        spec = LoraWorkloadSpec(
            requests=args.requests, rate=1.0, adapters=args.adapters, zipf_s=args.zipf, hot_share=args.hot_share,
            system_tokens=args.system_tokens, user_tokens=args.user_tokens, output_tokens=args.output_tokens, seed=seed,
        )  # fmt: skip
        base = Workload("lora", lora_workload(prompts, spec))
        models = [r.model for r in base.requests]
        tokens = sum(r.input_tokens + r.output_tokens for r in base.requests) / len(base.requests)
        for load in (float(x) for x in args.loads.split(",")):
            rate = load * fleet_prefill_capacity(profiles) / tokens
            workload = base.scaled(rate / (base.offered_rps or 1.0))
            speed = round(auto_speed(workload.offered_rps, BENCH_MAX_WALL_RPS), 3)
            settings = StackSettings(profiles=profiles, speed=speed, seed=seed, lora=lora)
            for name in args.policies.split(","):
                run, loads = asyncio.run(run_policy(name, workload, prompts, settings, console))
                s = summarize_run(run, slo)
                hot_p99, rest_p99 = adapter_p99(run, models, "adapter-00") if args.hot_share else (None, None)
                row = {
                    "policy": name, "seed": seed, "load": load, "offered_rps": workload.offered_rps, "speed": speed,
                    "requests": s.requests, "successes": s.successes, "ttft_p50_ms": s.ttft_ms.p50, "ttft_p99_ms": s.ttft_ms.p99,
                    "goodput_rps": s.goodput_rps, "adapter_loads": loads,
                    "loads_per_1000": None if loads is None else 1000.0 * loads / max(1, s.requests),
                    "hot_p99_ms": hot_p99, "others_p99_ms": rest_p99, "errors": s.errors,
                }  # fmt: skip
                rows.append(row)
                console.print(row, highlight=False)
                (out / "lora.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2), encoding="utf-8")
    md = table(rows, args)
    console.print("\n".join(md), highlight=False)
    (out / "lora.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    (out / "lora.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2), encoding="utf-8")


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Markdown: per load and policy, the mean over seeds of each measure."""
    head = "| load | policy | TTFT p50 / p99 (ms) | adapter loads / 1,000 req | goodput (req/s) | errors |"
    if args.hot_share:
        head += " hot p99 / others p99 (ms) |"
    md = [head, "|" + "---|" * (head.count("|") - 1)]
    keys = sorted({(r["load"], r["policy"]) for r in rows}, key=lambda k: (k[0], args.policies.split(",").index(k[1])))
    for load, policy in keys:
        group = [r for r in rows if r["load"] == load and r["policy"] == policy]

        def mean(key: str) -> float | None:
            vals = [r[key] for r in group if r[key] is not None]
            return sum(vals) / len(vals) if vals else None

        errors = sum(sum(r["errors"].values()) for r in group)
        line = (
            f"| {load:g}× | {policy} | {_f(mean('ttft_p50_ms'))} / {_f(mean('ttft_p99_ms'))} | {_f(mean('loads_per_1000'))} "
            f"| {_f(mean('goodput_rps'), '{:.1f}')} | {errors} |"
        )
        if args.hot_share:
            line += f" {_f(mean('hot_p99_ms'))} / {_f(mean('others_p99_ms'))} |"
        md.append(line)
    return md


if __name__ == "__main__":
    main()
