#!/usr/bin/env python3
"""Steady-state runs over several seeds: the method of issue 29, one workload per invocation.

Every policy replays the same requests per seed on a fresh simulated fleet (2× H100 + 2× A100,
Qwen3-8B): seed k picks the trace sample (Mooncake: which whole conversations; Azure: which
window of the trace) and the simulators' randomness. Arrivals span `--warmup` + `--steady`
seconds of the fleet's (simulated) time; the warm-up's requests load the fleet and are left out
of every figure. Each run reports the achieved rate and hotspot, and is marked invalid (kept in
the file, out of means and verdicts) when the load generator sent late or its CPU saturated
(`extproc.bench.steady`). Then, per policy, mean and 95 % bootstrap interval over seeds of every
figure, and against `--baseline` "ahead", "behind" or "within noise" (`extproc.bench.stats`).

    flock /tmp/bench.lock .venv/bin/python scripts/bench_steady.py --workload mooncake-conv \\
        --policies envoy-least-request,llm-extproc --seeds 3 --out out/steady

Writes `<out>/<workload>[-x<load>].json` (an `extproc.bench.seeds.SeededResult`, after every run,
so an interrupted bench keeps what it measured). Copy it under docs/benchmarks/results/ and run
scripts/bench_report.py to put it on docs/benchmarks.md.

Workloads: `mooncake-conv`, `mooncake-synth` (whole conversations of the Mooncake traces at
× `--rate-scale` their mean rate, a conversation's turns in a closed loop), `azure-conv`,
`azure-code` (the Azure 2023 traces at × `--rate-scale`, default 12, a window starting
`seed × 300` trace seconds in), `sharegpt`, `shared-system` (as `scripts/bench_prefix.py`
builds them, `--requests` of them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from extproc.bench.cli import BENCH_MAX_WALL_RPS  # noqa: E402
from extproc.bench.policies import parse_policies  # noqa: E402
from extproc.bench.runner import ReplayOptions, Workload, auto_speed, fit_context, with_messages  # noqa: E402
from extproc.bench.seeds import SeededOptions, SeededResult, run_seeded  # noqa: E402
from extproc.bench.stacks import StackSettings  # noqa: E402
from extproc.bench.steady import SteadySettings  # noqa: E402
from extproc.stack.fleet import DEFAULT_FLEET  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "data" / "traces"
WORKLOADS = ("mooncake-conv", "mooncake-synth", "azure-conv", "azure-code", "sharegpt", "shared-system")
AZURE_WINDOW_S = 300.0  # seed k replays the Azure trace from k × this (trace seconds)


def _traces(args: argparse.Namespace) -> Path:
    return Path(args.traces) if args.traces else TRACES


def make_workload(name: str, seed: int, args: argparse.Namespace, prompts, max_model_len: int) -> tuple[Workload, ReplayOptions, str]:  # type: ignore[no-untyped-def]
    """Workload `name` for `seed` (messages built), how to replay it, and a description.

    Raises:
        SystemExit: an unknown workload name.
    """
    span = args.warmup + args.steady
    timeout = ReplayOptions(request_timeout_s=args.request_timeout)
    if name.startswith("mooncake"):
        from extproc.bench.prefix_workloads import sample_conversations
        from extproc.bench.traces import load_trace

        path = _traces(args) / "mooncake" / ("conversation_trace.jsonl" if name == "mooncake-conv" else "synthetic_trace.jsonl")
        trace = load_trace(path)
        rate = len(trace.requests) / (trace.requests[-1].arrival_s - trace.requests[0].arrival_s) * args.rate_scale
        sampled = sample_conversations(trace.requests, math.ceil(rate * span * 1.05), seed=seed)
        workload = Workload(name, sampled).scaled(args.rate_scale)
        workload = Workload(name, [r for r in workload.requests if r.arrival_s <= span])
        replay = dataclasses.replace(timeout, closed_loop_sessions=True)  # the trace's gaps are the think time
        what = (f"whole conversations of {path.name} (seed: which), × {args.rate_scale:g} its mean rate "
                f"({rate:.2f} req/s), turns of a conversation in a closed loop")  # fmt: skip
    elif name.startswith("azure"):
        from extproc.bench.runner import WorkloadOptions, load_workload

        path = _traces(args) / "azure_llm_2023" / f"AzureLLMInferenceTrace_{name.removeprefix('azure-')}.csv"
        workload = load_workload(WorkloadOptions(
            trace=path, rate_scale=args.rate_scale, start_offset_s=seed * AZURE_WINDOW_S, duration_s=span,
        ))  # fmt: skip
        workload = Workload(name, workload.requests)
        replay = timeout
        what = f"{path.name} from {AZURE_WINDOW_S:g} s × seed, × {args.rate_scale:g} its rate, open loop"
    elif name in ("sharegpt", "shared-system"):
        import bench_prefix

        ns = argparse.Namespace(
            requests=args.requests, seed=seed, mooncake_scale=1.0, conversation_rate=1.5, think_time=1.0,
            system_prompts=15, ramp=(2.0, 12.0), request_timeout=args.request_timeout, route_debug=False,
        )  # fmt: skip
        prepared = bench_prefix.prepare(name, ns, prompts, max_model_len)
        return prepared.workload, prepared.replay, prepared.notes
    else:
        raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    workload, _cut = fit_context(workload, max_model_len)
    return with_messages(workload, prompts), replay, what


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, check=False)
    return (done.stdout.strip() or "unknown") + ("+dirty" if dirty.stdout.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, choices=WORKLOADS)
    ap.add_argument("--policies", default="envoy-least-request,llm-extproc")
    ap.add_argument("--baseline", default="envoy-least-request")
    ap.add_argument("--seeds", type=int, default=3, help="run each policy at seeds 0..N-1 (>= 1)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=60.0, help="simulated seconds of arrivals left out of the figures")
    ap.add_argument("--steady", type=float, default=300.0, help="simulated seconds of arrivals measured")
    ap.add_argument("--rate-scale", type=float, default=None, help="× the trace's rate (default: 1 Mooncake, 12 Azure)")
    ap.add_argument("--requests", type=int, default=600, help="sharegpt / shared-system: requests per seed")
    ap.add_argument("--speed", type=float, default=None, help="simulator speed (default: bench's auto, ≤ 15 req per wall s)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="per request (simulated seconds)")
    ap.add_argument("--load", default="1", help="the load label stored with each run (e.g. 1, 1.5 for capacity points)")
    ap.add_argument("--traces", default="", help="the traces folder (default ../shared/data/traces)")
    ap.add_argument("--machine", default="shared 2-core development machine (2 vCPU), other engineers' work outside the lock")
    ap.add_argument("--out", default="out/steady")
    args = ap.parse_args()
    if args.seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    if args.rate_scale is None:
        args.rate_scale = 12.0 if args.workload.startswith("azure") else 1.0
    policies = parse_policies(args.policies)
    if args.baseline not in [p.name for p in policies]:
        raise SystemExit(f"--baseline {args.baseline} is not among --policies")
    missing = [f"{p.name}: {p.unavailable()}" for p in policies if p.unavailable()]
    if missing:
        raise SystemExit("; ".join(missing))
    steady = SteadySettings(warmup_s=args.warmup, min_steady_s=300.0)

    from extproc.bench.prompts import PromptSynthesizer
    from extproc.pipeline.tokens import TokenCounter
    from extproc.sim.profiles import PROFILES

    console = Console(stderr=True, width=200)
    prompts = PromptSynthesizer(TokenCounter.from_source("builtin:qwen3"))
    max_model_len = min(PROFILES[p].max_model_len for p in DEFAULT_FLEET)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    built: dict[int, tuple[Workload, ReplayOptions, str]] = {}

    def workload_for(seed: int):  # type: ignore[no-untyped-def]
        if seed not in built:
            built[seed] = make_workload(args.workload, seed, args, prompts, max_model_len)
        workload = built[seed][0]
        console.print(f"seed {seed}: {len(workload.requests)} requests, {workload.offered_rps or 0:.2f} req/s offered", highlight=False)
        return workload, prompts

    first, replay, what = built[seeds[0]] = make_workload(args.workload, seeds[0], args, prompts, max_model_len)
    speed = args.speed or round(auto_speed(first.offered_rps, BENCH_MAX_WALL_RPS), 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.workload if args.load == "1" else f"{args.workload}-x{args.load}"
    path = out / f"{name}.json"
    command = "flock /tmp/bench.lock .venv/bin/python scripts/bench_steady.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = SeededResult(
        name=name, workload=what, commit=_commit(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=command, machine=args.machine, baseline=args.baseline, seeds=seeds,
        settings={
            "warmup_s": args.warmup, "steady_s": args.steady, "rate_scale": args.rate_scale, "speed": speed,
            "fleet": list(DEFAULT_FLEET), "slo": {"ttft_ms": 2000.0, "itl_ms": 100.0}, "load": args.load,
            "stream_interval": 8,
        },
        runs=[],
    )  # fmt: skip

    def save(run) -> None:  # type: ignore[no-untyped-def]
        result.runs.append(run)
        path.write_text(result.model_dump_json(indent=1) + "\n", encoding="utf-8")

    console.print(f"{args.workload}: {what}; speed {speed:g}; seeds {seeds}; writing {path}", highlight=False)
    with tempfile.TemporaryDirectory(prefix="bench-steady-") as logs:
        options = SeededOptions(
            policies=policies, seeds=seeds, stack=StackSettings(profiles=DEFAULT_FLEET, speed=speed),
            replay=dataclasses.replace(replay, speed=speed, progress=False), steady=steady, workdir=Path(logs),
            load=args.load,
        )  # fmt: skip
        asyncio.run(run_seeded(options, workload_for, console, on_run=save))
    from bench_report import steady_tables

    print("\n".join(steady_tables(result)))


if __name__ == "__main__":
    main()
