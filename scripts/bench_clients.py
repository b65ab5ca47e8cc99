#!/usr/bin/env python3
"""The field's own benchmark clients beside ours, on the same stacks and the same requests.

For each policy, three fresh stacks (the same seed and simulator speed `--speed`), one per
client, each replaying the same requests open loop at the trace's times. The external clients
keep wall time: their traces are written with gaps stretched by 1 / speed, and their latencies
are multiplied by the speed (rates divided by it) to read in simulated time as ours do:

  - ours: `extproc.bench.loadgen` (chat completions, streamed);
  - guidellm 0.8.1: the requests as a Mooncake-format trace, its `replay` profile
    (`extproc.bench.clients.guidellm`);
  - inference-perf 0.7.0: the requests as an Azure-format trace, its `trace_replay` load with
    random-token prompts (`extproc.bench.clients.inference_perf`); prefix-free workloads only
    (its random prompts share no prefix, so on Mooncake it would measure another workload).

Each client runs from its own virtualenv (`--guidellm`, `--inference-perf`: paths of their
executables; guidellm needs torch, inference-perf Python >= 3.12), offline, with the built-in
Qwen3 tokenizer by local path. The figures go into the `external` list of a result file
(`--into`, a scripts/bench_steady.py result) so that scripts/bench_report.py puts them beside the
steady-state table, and are printed.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_clients.py --workload azure-conv \\
        --guidellm /opt/guidellm/bin/guidellm --inference-perf /opt/inference-perf/bin/inference-perf \\
        --into docs/benchmarks/results/azure-conv.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402

from extproc.bench.clients import ClientError, tokenizer_dir  # noqa: E402
from extproc.bench.policies import parse_policies  # noqa: E402
from extproc.bench.results import LabeledRun, summarize_run  # noqa: E402
from extproc.bench.runner import ReplayOptions, Workload, replay, scrape_prefix_counters  # noqa: E402
from extproc.bench.stacks import PolicyStack, StackSettings  # noqa: E402
from extproc.stack.fleet import DEFAULT_FLEET  # noqa: E402

NOTES = {
    "ours": "chat, our synthesized prompts; TPOT = per-request mean gap",
    "guidellm": "chat, its own text per 512-token hash block; ITL percentiles over tokens",
    "inference-perf": "completions, random token ids (no chat template); TPOT per request",
}


async def _on_stack(policy, settings: StackSettings, workdir: Path, work):  # type: ignore[no-untyped-def]
    """Start a fresh stack, run `work(stack)`, read the engines' prefix hit rate around it, stop."""
    from extproc.bench.results import prefix_cache_hit_rate

    stack = PolicyStack(policy, settings, workdir=workdir)
    try:
        await stack.start()
        before = await scrape_prefix_counters(stack.fleet.urls)
        out = await work(stack)
        after = await scrape_prefix_counters(stack.fleet.urls)
    finally:
        await stack.aclose()
    hit = prefix_cache_hit_rate(before, after) if before is not None and after is not None else None
    return out, hit


def _simulated(figures: dict[str, Any], speed: float) -> dict[str, Any]:
    """An external client's wall-clock figures in simulated time: ms × speed, per-second rates ÷ speed."""
    out = dict(figures)
    for key, value in figures.items():
        if value is None or not isinstance(value, (int, float)):
            continue
        if key.endswith("_ms"):
            out[key] = value * speed
        elif key in ("output_tokens_per_s", "rps"):
            out[key] = value / speed
        elif key == "duration_s":
            out[key] = value * speed
    return out


def _ours(run: LabeledRun) -> dict[str, Any]:
    s = summarize_run(run)
    return {
        "ok": s.successes, "errored": s.requests - s.successes,
        "ttft_p50_ms": s.ttft_ms.p50, "ttft_p99_ms": s.ttft_ms.p99, "tpot_p50_ms": s.itl_ms.p50, "tpot_p99_ms": s.itl_ms.p99,
        "output_tokens_per_s": s.output_tokens_per_s, "rps": s.successes / run.record.duration_s if run.record.duration_s else None,
    }  # fmt: skip


async def compare_clients(args: argparse.Namespace, workload: Workload, prompts, console: Console) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """Every policy × every client available; one entry each (see `bench_report.steady_tables`)."""
    from extproc.bench.clients import guidellm, inference_perf

    entries: list[dict[str, Any]] = []
    settings = StackSettings(profiles=DEFAULT_FLEET, speed=args.speed, seed=args.seed)
    model = "Qwen/Qwen3-8B"
    options = ReplayOptions(speed=args.speed, request_timeout_s=args.request_timeout, progress=False)
    span = workload.requests[-1].arrival_s - workload.requests[0].arrival_s
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp:
        tmpdir = Path(tmp)
        gl_trace, ip_trace = tmpdir / "trace-mooncake.jsonl", tmpdir / "trace-azure.csv"
        guidellm.write_trace(workload.requests, gl_trace, stretch=1 / args.speed)
        inference_perf.write_trace(workload.requests, ip_trace, stretch=1 / args.speed)
        wall = span / args.speed
        for policy in parse_policies(args.policies):
            clients = ["ours"]
            if args.guidellm:
                clients.append("guidellm")
            if args.inference_perf and not workload.requests[0].prefix_blocks:
                clients.append("inference-perf")
            for client in clients:
                work_dir = tmpdir / f"{policy.name}-{client}"

                async def work(stack, client=client, work_dir=work_dir):  # type: ignore[no-untyped-def]
                    if client == "ours":
                        return _ours(await replay(stack, workload, prompts, options, console=console))
                    if client == "guidellm":
                        cfg = guidellm.scenario(stack.url, model, gl_trace, tokenizer_dir(), work_dir / "report.json")
                        path = await asyncio.to_thread(guidellm.run_guidellm, Path(args.guidellm), cfg, work_dir, timeout_s=wall + 600)
                        return _simulated(guidellm.parse_report(path), args.speed)
                    cfg = inference_perf.config(stack.url, model, ip_trace, tokenizer_dir(), work_dir / "reports", duration_s=int(wall + 300))
                    path = await asyncio.to_thread(
                        inference_perf.run_inference_perf, Path(args.inference_perf), cfg, work_dir, timeout_s=wall + 600
                    )  # fmt: skip
                    return _simulated(inference_perf.parse_report(path), args.speed)

                console.print(f"{policy.name}: {client}", highlight=False)
                try:
                    figures, hit = await _on_stack(policy, settings, work_dir, work)
                except ClientError as exc:
                    figures, hit = {"error": str(exc)[:300]}, None
                entry = {"policy": policy.name, "client": client, "seed": args.seed, **figures, "prefix_hit": hit}
                entry["notes"] = NOTES[client] + (f"; engines' prefix hit {hit:.1%}" if hit is not None else "")
                if "error" in figures:
                    entry["notes"] = f"failed: {figures['error']}"
                console.print(json.dumps(entry), highlight=False, soft_wrap=True)
                entries.append(entry)
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, help="as scripts/bench_steady.py's")
    ap.add_argument("--policies", default="envoy-least-request,llm-extproc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals")
    ap.add_argument("--speed", type=float, default=1.0, help="simulator speed (below 1 for loads over ~15 req per wall second)")
    ap.add_argument("--rate-scale", type=float, default=None, help="× the trace's rate (default: 1 Mooncake, 12 Azure)")
    ap.add_argument("--requests", type=int, default=300, help="sharegpt / shared-system: requests")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--guidellm", default="", help="path of the guidellm executable (its own virtualenv)")
    ap.add_argument("--inference-perf", default="", help="path of the inference-perf executable (its own virtualenv)")
    ap.add_argument("--traces", default="")
    ap.add_argument("--into", default="", help="add the entries to this result file's `external` list (made when missing)")
    args = ap.parse_args()
    if args.rate_scale is None:
        args.rate_scale = 12.0 if args.workload.startswith("azure") else 1.0
    import bench_steady

    from extproc.bench.prompts import PromptSynthesizer
    from extproc.pipeline.tokens import TokenCounter
    from extproc.sim.profiles import PROFILES

    console = Console(stderr=True, width=200)
    prompts = PromptSynthesizer(TokenCounter.from_source("builtin:qwen3"))
    steady_args = argparse.Namespace(**vars(args), warmup=0.0, steady=args.duration)
    max_model_len = min(PROFILES[p].max_model_len for p in DEFAULT_FLEET)
    workload, _replay, what = bench_steady.make_workload(args.workload, args.seed, steady_args, prompts, max_model_len)
    console.print(f"{args.workload}: {len(workload.requests)} requests, {what}; open loop for every client", highlight=False)
    workload = dataclasses.replace(workload, requests=sorted(workload.requests, key=lambda r: r.arrival_s))
    entries = asyncio.run(compare_clients(args, workload, prompts, console))
    if args.into:
        from extproc.bench.seeds import SeededResult

        path = Path(args.into)
        if path.exists():
            result = SeededResult.model_validate_json(path.read_bytes())
        else:  # a file of the clients' figures alone (no steady-state runs of ours)
            result = SeededResult(
                name=path.stem, workload=what + "; the field's clients only", commit=bench_steady._commit(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                command="flock /tmp/bench.lock .venv/bin/python scripts/bench_clients.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                machine="shared 2-core development machine (2 vCPU), other engineers' work outside the lock",
                baseline="envoy-least-request", seeds=[args.seed],
                settings={"rate_scale": args.rate_scale, "speed": args.speed, "steady_s": args.duration, "warmup_s": 0.0,
                          "fleet": list(DEFAULT_FLEET), "load": "1"},
                runs=[],
            )  # fmt: skip
        for e in entries:
            e["duration_s_arrivals"] = args.duration
        result.external = [e for e in result.external if (e["policy"], e["client"]) not in {(x["policy"], x["client"]) for x in entries}] + entries
        path.write_text(result.model_dump_json(indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {len(entries)} entries into {path}", highlight=False)
    print(json.dumps(entries, indent=1))


if __name__ == "__main__":
    main()
