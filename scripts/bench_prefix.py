#!/usr/bin/env python3
"""Prefix-cache-aware routing against prefix-blind and peer routers, on four workloads (issue 12).

Every policy replays the same requests on a fresh simulated fleet (2× H100 + 2× A100,
Qwen3-8B, prefix caching on, 16-token blocks), one after another, through `llm-extproc bench`'s
machinery (`extproc.bench.commands.run_bench`):

- `mooncake-conv`, `mooncake-synth`: whole conversations sampled from the Mooncake traces
  (`extproc.bench.prefix_workloads.sample_conversations`), at the trace's own mean rate ×
  `--mooncake-scale`, a conversation's turns in a closed loop;
- `sharegpt`: ShareGPT multi-turn conversations, each turn resending the history and sent only
  after the previous answer came back (+ `--think-time`), conversations starting at
  `--conversation-rate`; the conversation id goes in `x-session-id` (sessions are what
  vllm-router's `consistent_hash` and llm-extproc's session scorer key on);
- `shared-system`: `--system-prompts` system prompts of ~6k tokens, a unique ~1.2k-token
  question, 1k output tokens, rate ramped linearly.

For each workload: the infinite-cache oracle hit rate at the engines' block size, then per
policy the engines' own prefix hit rate (tokens), TTFT p50/p90/p99, output tokens/s, goodput,
429 and 503 counts, and the duplicate prefills (requests sent to an engine holding at least 128
tokens less of their prefix than another engine held: `duplicate_prefills`; "–" for the peer
routers, whose per-request lines do not name the engine). Then capacity at equal p99 TTFT on `mooncake-conv`: `--capacity-policies`
at `--capacity-multiples` of the workload's rate; a policy's capacity is the highest offered rate
(interpolated) at which its p99 TTFT is no worse than envoy-least-request's p99 at the workload's
own rate (1×), the same bound in ms for every policy. `--capacity-from` recomputes that table
from saved reports (e.g. the main run plus a later run of more multiples) without running.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_prefix.py --out bench-prefix

Writes `<out>/prefix.md` (markdown tables, also printed) and `<out>/prefix.json`, plus each
run's bench report and per-request lines (`<out>/<workload>[-x<m>].json`, `...-requests.jsonl`).
`llm-extproc-precise` (the prefix index fed by the engines' KV events) joins the default
policies as soon as `extproc.bench.policies` defines it. `--route-debug` turns on llm-extproc's
`x-llm-route-debug` header and keeps it in the per-request lines (`route_debug`: the chosen
endpoint's and the runner-up's scores, each candidate's matched prefix and predicted TTFT), to
tell why a request went where it did (a duplicate prefill, a slow first token).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduling import capacity  # noqa: E402  (the same interpolation as the scheduling bench)

from rich.console import Console  # noqa: E402

from extproc.bench.commands import BenchOptions, Outputs, run_bench  # noqa: E402
from extproc.bench.policies import POLICIES, parse_policies  # noqa: E402
from extproc.bench.prefix_workloads import (  # noqa: E402
    SharedPromptSpec,
    duplicate_prefills,
    oracle_hit_rate,
    sample_conversations,
    shared_system_prompt_workload,
    sharegpt_conversations,
)
from extproc.bench.results import SLO  # noqa: E402
from extproc.bench.runner import ReplayOptions, Workload, auto_speed, fit_context, with_messages  # noqa: E402
from extproc.bench.stacks import StackSettings  # noqa: E402
from extproc.bench.traces import load_trace  # noqa: E402
from extproc.stack.fleet import DEFAULT_FLEET  # noqa: E402

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"
BASELINE = "envoy-least-request"
POLICY_NAMES = [
    BASELINE, "llm-extproc-noprefix", "llm-extproc", "llm-extproc-prefix",
    "sglang-cache-aware", "vllm-router-cache-aware", "vllm-router-consistent-hash",
]  # fmt: skip
if "llm-extproc-precise" in POLICIES:  # the KV-event-fed index, once it exists
    POLICY_NAMES.insert(3, "llm-extproc-precise")
WORKLOADS = ("mooncake-conv", "mooncake-synth", "sharegpt", "shared-system")
MAX_WALL_RPS = 15.0  # `bench --speed auto`'s ceiling (extproc.bench.cli.BENCH_MAX_WALL_RPS)
SESSION_HEADER = "x-session-id"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A workload ready to replay: requests with messages, how to replay it, its oracle."""

    name: str
    workload: Workload
    replay: ReplayOptions
    oracle: float | None
    notes: str


def _block_size() -> int:
    from extproc.sim.profiles import PROFILES

    sizes = {PROFILES[p].block_size for p in DEFAULT_FLEET}
    if len(sizes) != 1:
        raise SystemExit(f"the fleet mixes block sizes {sorted(sizes)}; the oracle needs one")
    return sizes.pop()


def prepare(name: str, args: argparse.Namespace, prompts: Any, max_model_len: int) -> Prepared:
    """Build workload `name` at scale 1 (messages built), and its oracle hit rate."""
    counter = prompts.counter
    closed = ReplayOptions(closed_loop_sessions=True, think_time_s=args.think_time, request_timeout_s=args.request_timeout)
    if name.startswith("mooncake"):
        path = TRACES / "mooncake" / ("conversation_trace.jsonl" if name == "mooncake-conv" else "synthetic_trace.jsonl")
        trace = load_trace(path)
        sampled = sample_conversations(trace.requests, args.requests, seed=args.seed)
        workload = Workload(name, sampled).scaled(args.mooncake_scale)
        workload, cut = fit_context(workload, max_model_len)
        notes = (f"{len(sampled)} requests, whole conversations drawn from all {len(trace.requests):,} of "
                 f"{path.name}, at ×{args.mooncake_scale:g} its mean rate; {cut} cut to the context")
        replay = dataclasses.replace(closed, think_time_s=0.0)  # the trace's own gaps are the think time
    elif name == "sharegpt":
        requests = sharegpt_conversations(
            TRACES / "sharegpt" / "sharegpt_v3_first2000.json", args.requests, counter,
            conversation_rate=args.conversation_rate, max_model_len=max_model_len, seed=args.seed,
        )  # fmt: skip
        workload = Workload(name, requests)
        conversations = len({r.session for r in requests})
        notes = (f"{len(requests)} turns of {conversations} conversations (≥ 2 turns), starting at "
                 f"{args.conversation_rate:g}/s, closed loop, think time {args.think_time:g} s, session header sent")
        replay = dataclasses.replace(closed, session_header=SESSION_HEADER)
    elif name == "shared-system":
        spec = SharedPromptSpec(
            requests=args.requests, system_prompts=args.system_prompts, rate_start=args.ramp[0], rate_end=args.ramp[1],
            seed=args.seed,
        )  # fmt: skip
        workload = Workload(name, shared_system_prompt_workload(prompts, spec))
        notes = (f"{spec.requests} requests: {spec.system_prompts} system prompts of {spec.system_tokens} tokens, "
                 f"a unique {spec.question_tokens}-token question, {spec.output_tokens} output tokens, "
                 f"rate ramped {spec.rate_start:g}→{spec.rate_end:g} req/s")
        replay = ReplayOptions(request_timeout_s=args.request_timeout)
    else:
        raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    workload = with_messages(workload, prompts)
    replay = dataclasses.replace(replay, route_debug=args.route_debug)
    ordered = sorted(workload.requests, key=lambda r: r.arrival_s)  # the send order (stable: turns in order)
    return Prepared(name, workload, replay, oracle_hit_rate(ordered, counter, _block_size()), notes)


def run(prepared: Prepared, policies: list[str], scale: float, args: argparse.Namespace, console: Console) -> list[dict]:
    """`run_bench` for `policies` at `scale` × the workload's rate; the bench report's runs.

    The simulator speed is bench's automatic choice (1, or slower above 15 requests per wall
    second), except that runs below the workload's own rate may go faster (up to 1 / scale,
    at most 2×), so that every load sends about as many requests per wall second and costs about
    as much wall time as the 1× run.
    """
    stem = prepared.name if scale == 1.0 else f"{prepared.name}-x{scale:g}"
    workload = prepared.workload.scaled(scale)
    speed = round(auto_speed(workload.offered_rps, MAX_WALL_RPS), 3)
    if scale < 1.0:
        speed = min(2.0, 1.0 / scale)
    out = Path(args.out)
    options = BenchOptions(
        policies=parse_policies(policies), workload=workload, rate_scales=[1.0], duration_s=None,
        stack=StackSettings(
            profiles=DEFAULT_FLEET, speed=speed, seed=args.seed,
            server_overrides=args.server_overrides,
        ),
        replay=dataclasses.replace(prepared.replay, speed=speed),
        outputs=Outputs(json_path=out / f"{stem}.json", requests_path=out / f"{stem}-requests.jsonl"),
        slo=SLO(),
    )  # fmt: skip
    status = asyncio.run(run_bench(options, console))
    if status not in (0,):
        raise SystemExit(f"bench for {stem} ended with status {status}")
    runs = json.loads((out / f"{stem}.json").read_text())["runs"]
    served = _served(out / f"{stem}-requests.jsonl")
    ordered = sorted(workload.requests, key=lambda r: r.arrival_s)  # the load generator's send order: its `index`
    for r in runs:
        r["scale"], r["speed"] = scale, speed
        dup = duplicate_prefills(ordered, served.get(r["policy"], []), args.counter, _block_size())
        r["duplicate_prefills"] = None if dup is None else dataclasses.asdict(dup)
    return runs


def _overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    """llm-extproc's config overrides for the llm-extproc policies: `--extproc-config`'s YAML
    (checked as `bench --extproc-config` checks it), with the route-debug header on top.

    Raises:
        SystemExit: (2) the file is unreadable, not a mapping, or not a valid configuration
            once merged; `bench`'s one `error: ...` line is already printed.
    """
    import typer

    from extproc.bench.cli import _server_overrides
    from extproc.bench.stacks import merge_config
    from extproc.stack.fleet import NamedFleet

    try:
        out: dict[str, Any] = _server_overrides(Path(args.extproc_config), NamedFleet(DEFAULT_FLEET)) if args.extproc_config else {}
    except typer.Exit as exc:  # the CLI's exit, raised here outside a CLI: no traceback
        raise SystemExit(exc.exit_code) from None
    if args.route_debug:
        out = merge_config(out, {"scheduling": {"explain_header": True}})
    return out or None


def _served(path: Path) -> dict[str, list[tuple[int, float, str | None]]]:
    """Per policy, `(index, send time s, endpoint)` of every request sent (per-request lines)."""
    out: dict[str, list[tuple[int, float, str | None]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault(r["policy"], []).append((r["index"], r["sent_s"], r["endpoint"]))
    return out


def _errors(run: dict, prefix: str) -> int:
    return sum(n for reason, n in run["errors"].items() if reason.startswith(prefix))


def _dups(run: dict) -> str:
    d = run.get("duplicate_prefills")
    return "–" if d is None else f"{d['requests']} ({d['tokens']:,} tok)"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def workload_table(prepared: Prepared, runs: list[dict]) -> list[str]:
    lines = [
        f"### {prepared.name}", "", prepared.notes + f"; oracle hit rate {_pct(prepared.oracle)}.", "",
        "| policy | engines' prefix hit | oracle | duplicate prefills | TTFT p50 / p90 / p99 (ms) | output tok/s | goodput (req/s) | 429 | 503 | other errors | late sends |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]  # fmt: skip
    for r in runs:
        other = {k: v for k, v in r["errors"].items() if not k.startswith(("429", "503"))}
        t = r["ttft_ms"]
        lines.append(
            f"| {r['policy']} | {_pct(r['prefix_cache_hit_rate'])} | {_pct(prepared.oracle)} | {_dups(r)} | "
            f"{_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} | {_ms(r['output_tokens_per_s'])} | "
            f"{(r['goodput_rps'] or 0):.2f} | {_errors(r, '429')} | {_errors(r, '503')} | "
            f"{', '.join(f'{k} ×{v}' for k, v in other.items()) or '–'} | {r['behind_schedule']['fraction']:.1%} |"
        )
    return lines + [""]


def capacity_table(runs: list[dict]) -> tuple[list[str], dict]:
    """Capacity of each policy at equal p99 TTFT: the bound is the baseline's p99 at scale 1
    (ms, the same for every policy); a policy's capacity is interpolated between its runs,
    lowest load first, up to the first run above the bound (`bench_scheduling.capacity`).
    Several runs at one scale (repeats) are all listed; the capacity uses their mean p99."""
    by_policy: dict[str, list[dict]] = {}
    for r in runs:
        by_policy.setdefault(r["policy"], []).append(r)
    at_one = [r["ttft_ms"]["p99"] for r in by_policy[BASELINE] if r["scale"] == 1.0]
    if not at_one:
        raise SystemExit(f"no {BASELINE} run at 1× to take the p99 bound from")
    limit = sum(at_one) / len(at_one)
    lines = [
        f"p99 TTFT bound: {BASELINE}'s p99 at 1× ({limit:,.0f} ms), the same for every policy.", "",
        "| policy | load (× workload rate) | offered req/s | TTFT p50 / p99 (ms) | goodput (req/s) | prefix hit | late sends |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    caps: dict[str, Any] = {}
    for policy, rs in by_policy.items():
        rs.sort(key=lambda r: r["offered_rps"])
        for r in rs:
            lines.append(
                f"| {policy} | {r['scale']:g} | {r['offered_rps']:.2f} | {_ms(r['ttft_ms']['p50'])} / {_ms(r['ttft_ms']['p99'])} | "
                f"{(r['goodput_rps'] or 0):.2f} | {_pct(r['prefix_cache_hit_rate'])} | {r['behind_schedule']['fraction']:.1%} |"
            )
        merged = _mean_by_scale(rs)
        cap, _ = capacity(merged, limit / merged[0]["ttft_ms"]["p99"])  # the relative bound that equals `limit`
        caps[policy] = {"capacity_rps": cap, "holds_at_top": cap is not None and cap >= rs[-1]["offered_rps"]}
    base_cap = caps[BASELINE]["capacity_rps"]
    lines += ["", "| policy | capacity (req/s) | × " + BASELINE + " |", "|---|---:|---:|"]
    for policy, c in caps.items():
        cap = c["capacity_rps"]
        ge = "≥ " if c["holds_at_top"] else ""
        ratio = "–" if cap is None or not base_cap else f"{ge}{cap / base_cap:.2f}"
        c["ratio"] = None if cap is None or not base_cap else cap / base_cap
        lines.append(f"| {policy} | {'below the lightest load' if cap is None else f'{ge}{cap:.2f}'} | {ratio} |")
    return lines + [""], {"limit_ms": limit, "policies": caps}


def _mean_by_scale(runs: list[dict]) -> list[dict]:
    """One point per scale (mean offered rate and mean p99 of its repeats), by offered rate."""
    scales: dict[float, list[dict]] = {}
    for r in runs:
        scales.setdefault(r["scale"], []).append(r)
    points = [
        {"offered_rps": sum(r["offered_rps"] for r in rs) / len(rs),
         "ttft_ms": {"p99": sum(r["ttft_ms"]["p99"] for r in rs) / len(rs)}}
        for rs in scales.values()
    ]  # fmt: skip
    return sorted(points, key=lambda p: p["offered_rps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-prefix", help="directory for the reports")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--requests", type=int, default=150, help="requests (turns) per workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mooncake-scale", type=float, default=1.0, help="× the Mooncake trace's own mean rate")
    ap.add_argument("--conversation-rate", type=float, default=1.5, help="ShareGPT conversations started per second")
    ap.add_argument("--think-time", type=float, default=1.0, help="ShareGPT: seconds between an answer and the next turn")
    ap.add_argument("--system-prompts", type=int, default=15, help="shared-system: distinct system prompts")
    ap.add_argument("--ramp", default="2,12", help="shared-system: arrival rate of the first and last request (req/s)")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="per request (simulated seconds)")
    ap.add_argument("--capacity-policies", default=f"{BASELINE},llm-extproc", help="'' skips the capacity runs")
    ap.add_argument("--capacity-multiples", default="0.5,1.5,2.0", help="mooncake-conv loads besides 1× (the lowest is the light load)")
    ap.add_argument("--route-debug", action="store_true",
                    help="llm-extproc policies explain each decision (x-llm-route-debug) in the per-request lines")
    ap.add_argument("--extproc-config", default="", help="YAML merged into llm-extproc's config for the llm-extproc policies (a variant of the default profile)")
    ap.add_argument("--capacity-from", default="", help="only recompute the capacity table from these prefix.json files (comma-separated)")
    args = ap.parse_args()
    if args.capacity_from:
        reports = [json.loads(Path(f).read_text()) for f in args.capacity_from.split(",")]
        runs = [r for rep in reports for r in rep.get("capacity", {}).get("runs", [])]
        print("\n".join(capacity_table(runs)[0]))
        return
    args.ramp = tuple(float(x) for x in args.ramp.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    parse_policies(policies)  # unknown names fail before anything starts
    args.server_overrides = _overrides(args)  # so does a bad --extproc-config, and it is read once

    from extproc.bench.prompts import PromptSynthesizer
    from extproc.pipeline.tokens import TokenCounter
    from extproc.sim.profiles import PROFILES

    prompts = PromptSynthesizer(TokenCounter.from_source("builtin:qwen3"))
    args.counter = prompts.counter
    max_model_len = min(PROFILES[p].max_model_len for p in DEFAULT_FLEET)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    report: dict[str, Any] = {"started": started, "fleet": list(DEFAULT_FLEET), "block_size": _block_size(), "workloads": {}}
    md = [f"Run {started}; fleet {', '.join(DEFAULT_FLEET)}; latencies in simulated ms.", ""]
    prepared_by_name: dict[str, Prepared] = {}
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        prepared = prepared_by_name[name] = prepare(name, args, prompts, max_model_len)
        console.print(f"{name}: {prepared.notes}; oracle hit rate {_pct(prepared.oracle)}", highlight=False)
        runs = run(prepared, policies, 1.0, args, console)
        report["workloads"][name] = {"notes": prepared.notes, "oracle_hit_rate": prepared.oracle, "runs": runs}
        md += workload_table(prepared, runs)
        _write(out, md, report)
    # Capacity last: the per-workload tables come first if time runs out.
    cap_policies = [p.strip() for p in args.capacity_policies.split(",") if p.strip()]
    if "mooncake-conv" in prepared_by_name and cap_policies:
        prepared = prepared_by_name["mooncake-conv"]
        capacity_runs = [r for r in report["workloads"]["mooncake-conv"]["runs"] if r["policy"] in cap_policies]
        for m in (float(x) for x in args.capacity_multiples.split(",")):
            capacity_runs += run(prepared, cap_policies, m, args, console)
        report["capacity"] = {"workload": "mooncake-conv", "runs": capacity_runs}
        if any(r["policy"] == BASELINE and r["scale"] == 1.0 for r in capacity_runs):
            lines, caps = capacity_table(capacity_runs)
            report["capacity"].update(caps)
        else:  # more multiples of a policy, to be tabled with a run that has the baseline's bound
            lines = [f"No {BASELINE} run at 1× here: recompute with `--capacity-from` and a report that has one.", ""]
        md += ["### Capacity at equal p99 TTFT (mooncake-conv)", "", *lines]
        _write(out, md, report)
    print("\n".join(md))


def _write(out: Path, md: list[str], report: dict) -> None:
    (out / "prefix.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    (out / "prefix.json").write_text(json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)))


if __name__ == "__main__":
    main()
