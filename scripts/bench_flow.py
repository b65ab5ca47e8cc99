#!/usr/bin/env python3
"""Flow control's measurements 1-3 (issue 27): fairness under flood, weighted shares, overload goodput.

Every run is `bench --tenants` machinery (`extproc.bench.tenant_run`): a fresh simulated fleet,
`llm-extproc serve` and Envoy, each tenant a rate-limiter tenant by its API key with its own
arrivals. Capacity is the fleet's prefill throughput over the tenant's mean prompt + output
tokens (`bench --rate-scale auto`'s measure, `tenants.capacity_rps`); it ignores decode, so the
fleet saturates somewhat below "1× capacity".

Gates compared (`--modes`):
    no-gate   priority shedding off (`admission.priority.shed_*_at` 1e6): every request goes to
              an engine, however long its queue;
    off       today's default: flow control off, standard requests refused with 429 once the
              fleet's saturation reaches 1 (priority shedding) — the "429-only" gate;
    flow      flow control on (`flow_control.enabled`, DRR fairness, the weights of the run):
              needs a build with flow control (branch flow27); skipped with a note otherwise.

Measurements (`what`):
    fairness  tenant "steady" at 0.3× capacity (Poisson) alone ("solo", default config), then
              with tenant "flood" at 3× capacity that resends refusals at once, ignoring
              retry-after (5 sends at most), under each mode. Target: steady's TTFT p50 within
              10 % and p99 within 25 % of its solo run, in every seed; the flood's goodput not
              below the capacity left to it (1 − 0.3 of capacity).
    weights   tenants "heavy" and "light", both at 1.5× capacity (Poisson), flow weights 4:1;
              target: completed work (prompt + output tokens) within 5 % of 4:1.
    overload  one tenant replaying a trace's own arrivals (Azure 2023 conversation, Mooncake
              conversation; read in place) at 1.5× and 2× capacity, under each mode: goodput
              (SLO met) and the share of requests answered 429 / 503.

The simulated fleet runs slower than real time (`--speed`, default 0.25 simulated s per wall s)
so that the 2-core machine's CPU noise weighs less in the simulated latencies; latencies are
simulated milliseconds. Run under `flock /tmp/bench.lock` (each run starts a fleet and Envoy):

    flock /tmp/bench.lock .venv/bin/python scripts/bench_flow.py fairness --modes off,flow --seeds 3
    flock /tmp/bench.lock .venv/bin/python scripts/bench_flow.py weights --modes off,flow
    flock /tmp/bench.lock .venv/bin/python scripts/bench_flow.py overload --modes no-gate,off,flow
    # flow mode with another gate (decision 0311's running-load bound):
    flock /tmp/bench.lock .venv/bin/python scripts/bench_flow.py fairness --modes flow --gate '{"max_inflight": 32}'
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from extproc.bench.policies import POLICIES
from extproc.bench.results import SLO
from extproc.bench.stacks import StackSettings, policy_server_config
from extproc.bench.tenant_results import TenantReport, render_tenants
from extproc.bench.tenant_run import TenantRunOptions, run_tenants, tenant_server_overrides
from extproc.bench.tenants import parse_tenants
from extproc.config.loader import ConfigError, config_from_mapping

TRACES = {
    "azure-conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": "mooncake/conversation_trace.jsonl",
}
"""Trace files under `--traces-dir` (docs/benchmarks.md says where they come from)."""
_REPO = Path(__file__).resolve().parents[1]


def _traces_dir(given: str) -> Path:
    """`--traces-dir`, else the first of ../shared/data/traces and ../../shared/data/traces
    beside the repository (a checkout, or a worktree one level down) that exists."""
    if given:
        return Path(given)
    for candidate in (_REPO.parent / "shared/data/traces", _REPO.parent.parent / "shared/data/traces"):
        if candidate.is_dir():
            return candidate
    sys.exit("no trace folder at ../shared/data/traces beside the repository: pass --traces-dir")
NO_SHEDDING = {"admission": {"priority": {"shed_sheddable_at": 1e6, "shed_standard_at": 1e6}}}
MODES = {
    "no-gate": NO_SHEDDING,
    "off": {},
    "flow": {"flow_control": {"enabled": True, "fairness": "drr"}},
}
P50_BOUND, P99_BOUND, SHARE_BOUND = 0.10, 0.25, 0.05
_GATE: dict[str, Any] = {}
"""`--gate`: flow mode's `flow_control.gate` (empty: the build's defaults)."""


def _mode_config(mode: str, weights: dict[str, float] | None = None) -> dict[str, Any]:
    cfg = json.loads(json.dumps(MODES[mode]))
    if mode == "flow" and weights:
        cfg["flow_control"]["weights"] = weights
    if mode == "flow" and _GATE:
        cfg["flow_control"]["gate"] = dict(_GATE)
    return cfg


def _supported(mode: str, settings: StackSettings) -> str | None:
    """None when this build accepts `mode`'s config, else why not."""
    sample = {f"127.0.0.1:{8000 + i}": p for i, p in enumerate(settings.profiles)}
    try:
        config_from_mapping(policy_server_config(POLICIES["llm-extproc"], dataclasses.replace(settings, server_overrides=_mode_config(mode)), sample))
    except ConfigError as exc:
        return " ".join(str(exc).split())[:300]
    return None


async def _run(spec_raw: dict[str, Any], args: argparse.Namespace, seed: int, label: str, console: Console) -> TenantReport:
    spec = parse_tenants(spec_raw)
    settings = StackSettings(profiles=tuple(args.fleet.split(",")), speed=args.speed, seed=seed)
    options = TenantRunOptions(
        settings=settings, seed=seed, label=label, slo=SLO(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_tpot_ms),
        request_timeout_s=args.request_timeout,
    )  # fmt: skip
    console.print(f"[bold]{label}[/bold] (seed {seed}, load average {os.getloadavg()[0]:.2f})", highlight=False)
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as workdir:
        report = await run_tenants(spec, options, console=console, workdir=Path(workdir))
    console.print(render_tenants(report, title=label))
    return report


def _tenant(report: TenantReport, name: str):  # type: ignore[no-untyped-def]
    return next(t for t in report.tenants if t.tenant == name)


def _row_tenant(row: dict[str, Any], name: str) -> dict[str, Any]:
    """Tenant `name`'s summary in a result row's dumped report (`_tenant` after a JSON round trip)."""
    return next(t for t in row["report"]["tenants"] if t["tenant"] == name)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


async def fairness(args: argparse.Namespace, modes: list[str], console: Console) -> list[dict[str, Any]]:
    rows = []
    steady = {"name": "steady", "load": 0.3, "arrival": "poisson", "seed": 1}
    flood = {"name": "flood", "load": 3.0, "arrival": "poisson", "retry": "immediate", "max_attempts": 5, "seed": 2}
    for seed in range(args.seeds):
        solo = await _run({"duration_s": args.duration, "tenants": [steady]}, args, seed, "fairness: steady solo", console)
        s0 = _tenant(solo, "steady")
        rows.append({"what": "fairness", "seed": seed, "mode": "solo", "report": solo.model_dump(mode="json")})
        for mode in modes:
            spec = {"duration_s": args.duration, "tenants": [steady, flood], "extproc_config": _mode_config(mode)}
            report = await _run(spec, args, seed, f"fairness: steady + flood, {mode}", console)
            s, f = _tenant(report, "steady"), _tenant(report, "flood")
            rows.append({
                "what": "fairness", "seed": seed, "mode": mode, "report": report.model_dump(mode="json"),
                "steady_p50_ratio": _ratio(s.ttft_ms.p50, s0.ttft_ms.p50), "steady_p99_ratio": _ratio(s.ttft_ms.p99, s0.ttft_ms.p99),
                "solo_p50_ms": s0.ttft_ms.p50, "solo_p99_ms": s0.ttft_ms.p99,
                # capacity left to the flood: 1 − 0.3 of capacity (the flood's own requests/s scale)
                "flood_capacity_left_rps": f.offered_rps / 3.0 * (1 - 0.3),
            })  # fmt: skip
    return rows


async def weights(args: argparse.Namespace, modes: list[str], console: Console) -> list[dict[str, Any]]:
    rows = []
    tenants = [
        {"name": "heavy", "load": args.weights_load, "arrival": "poisson", "seed": 3},
        {"name": "light", "load": args.weights_load, "arrival": "poisson", "seed": 4},
    ]
    for seed in range(args.seeds):
        for mode in modes:
            spec = {"duration_s": args.duration, "tenants": tenants, "extproc_config": _mode_config(mode, {"heavy": 4.0, "light": 1.0})}
            report = await _run(spec, args, seed, f"weights 4:1, {mode}", console)
            h, lt = _tenant(report, "heavy"), _tenant(report, "light")
            rows.append({
                "what": "weights", "seed": seed, "mode": mode, "load": args.weights_load, "report": report.model_dump(mode="json"),
                "work_ratio": _ratio(h.completed_tokens, lt.completed_tokens),
                "work_ratio_while_sending": _ratio(h.completed_tokens_while_sending, lt.completed_tokens_while_sending),
                "requests_ratio": _ratio(h.ok, lt.ok),
            })  # fmt: skip
    return rows


async def overload(args: argparse.Namespace, modes: list[str], console: Console) -> list[dict[str, Any]]:
    rows = []
    for name in args.traces.split(","):
        for load in (1.5, 2.0):
            for seed in range(args.seeds):
                for mode in modes:
                    tenant = {"name": "trace", "load": load, "arrival": "trace", "workload": str(_traces_dir(args.traces_dir) / TRACES[name]), "seed": 5}
                    spec = {"duration_s": args.duration, "tenants": [tenant], "extproc_config": _mode_config(mode)}
                    report = await _run(spec, args, seed, f"overload {name} {load:g}×, {mode}", console)
                    t = _tenant(report, "trace")
                    rows.append({
                        "what": "overload", "trace": name, "load": load, "seed": seed, "mode": mode,
                        "report": report.model_dump(mode="json"),
                        "share_429": t.refused_429 / t.requests if t.requests else None,
                        "share_503": t.refused_503 / t.requests if t.requests else None,
                    })  # fmt: skip
    return rows


def _print_summary(rows: list[dict[str, Any]]) -> None:
    fair = [r for r in rows if r["what"] == "fairness" and r["mode"] != "solo"]
    if fair:
        print("\n| seed | mode | steady TTFT p50 / p99 ms (solo) | p50 / solo | p99 / solo | met (≤1.10 / ≤1.25) | steady 429/503 | flood ok / sent / 429 / 503 | flood goodput/s (capacity left/s) | late sends steady / flood |")
        print("|---:|---|---|---:|---:|---|---|---|---|---|")
        for r in fair:
            s, f = _row_tenant(r, "steady"), _row_tenant(r, "flood")
            p50, p99 = r["steady_p50_ratio"], r["steady_p99_ratio"]
            met = "yes" if p50 is not None and p99 is not None and p50 <= 1 + P50_BOUND and p99 <= 1 + P99_BOUND else "no"
            print(f"| {r['seed']} | {r['mode']} | {_fmt(s['ttft_ms']['p50'], '.0f')} / {_fmt(s['ttft_ms']['p99'], '.0f')} "
                  f"({_fmt(r['solo_p50_ms'], '.0f')} / {_fmt(r['solo_p99_ms'], '.0f')}) | {_fmt(p50)} | {_fmt(p99)} | {met} | "
                  f"{s['refused_429']}/{s['refused_503']} | {f['ok']} / {f['sent']} / {f['refused_429']} / {f['refused_503']} | "
                  f"{_fmt(f['goodput_rps'])} ({r['flood_capacity_left_rps']:.2f}) | "
                  f"{s['behind_schedule_fraction']:.1%} / {f['behind_schedule_fraction']:.1%} |")
    wts = [r for r in rows if r["what"] == "weights"]
    if wts:
        print("\n| seed | mode | load each | heavy ok / light ok | heavy : light completed tokens, whole run | while both sending | within 5 % of 4:1 (while sending) | 429 / 503 (heavy, light) |")
        print("|---:|---|---:|---|---:|---:|---|---|")
        for r in wts:
            h, lt = _row_tenant(r, "heavy"), _row_tenant(r, "light")
            wr, ws = r["work_ratio"], r.get("work_ratio_while_sending")
            met = "yes" if ws is not None and abs(ws / 4.0 - 1) <= SHARE_BOUND else "no"
            print(f"| {r['seed']} | {r['mode']} | {r.get('load', 1.5):g}× | {h['ok']} / {lt['ok']} | {_fmt(wr)} | {_fmt(ws)} | {met} | "
                  f"{h['refused_429']}/{h['refused_503']}, {lt['refused_429']}/{lt['refused_503']} |")
    over = [r for r in rows if r["what"] == "overload"]
    if over:
        print("\n| trace | load | seed | mode | requests | ok | goodput/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | 429 share | 503 share | other errors |")
        print("|---|---:|---:|---|---:|---:|---:|---|---|---:|---:|---|")
        for r in over:
            t = r["report"]["tenants"][0]
            other = ", ".join(f"{k}: {v}" for k, v in t["other_errors"].items()) or "–"
            print(f"| {r['trace']} | {r['load']:g}× | {r['seed']} | {r['mode']} | {t['requests']} | {t['ok']} | {_fmt(t['goodput_rps'])} | "
                  f"{_fmt(t['ttft_ms']['p50'], '.0f')} / {_fmt(t['ttft_ms']['p99'], '.0f')} | {_fmt(t['tpot_ms']['p50'], '.1f')} / "
                  f"{_fmt(t['tpot_ms']['p99'], '.1f')} | {_fmt(r['share_429'], '.1%')} | {_fmt(r['share_503'], '.1%')} | {other} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("fairness", "weights", "overload", "all"))
    ap.add_argument("--modes", default="off,flow", help=f"gates to compare, of {', '.join(MODES)} (fairness always runs solo too)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (workload draws and simulators)")
    ap.add_argument("--fleet", default="a100-qwen3-8b", help="simulator profiles, comma-separated (one endpoint each)")
    ap.add_argument("--speed", type=float, default=0.25, help="simulated seconds per wall second (< 1: the fleet slowed)")
    ap.add_argument("--duration", type=float, default=20.0, help="simulated seconds of arrivals per run")
    ap.add_argument("--weights-load", type=float, default=1.5, help="weights: each tenant's load (× capacity)")
    ap.add_argument("--traces", default="azure-conv,mooncake-conv", help=f"overload traces, of {', '.join(TRACES)}")
    ap.add_argument("--traces-dir", default="", help="folder of the public traces (default: ../shared/data/traces beside the repository)")
    ap.add_argument("--gate", default="", help='flow mode\'s flow_control.gate as JSON, e.g. \'{"max_inflight": 8}\' (default: the build\'s)')
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0)
    ap.add_argument("--request-timeout", type=float, default=300.0, help="per attempt (simulated seconds)")
    ap.add_argument("--out", default="out/bench_flow.json", help="JSON of every run")
    args = ap.parse_args()
    if args.gate:
        _GATE.update(json.loads(args.gate))
    console = Console(width=200)
    settings = StackSettings(profiles=tuple(args.fleet.split(",")), speed=args.speed)
    modes = []
    for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
        if mode not in MODES:
            sys.exit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        why = _supported(mode, settings)
        if why is not None:
            console.print(f"[yellow]mode {mode} skipped:[/yellow] this build refuses its config ({why})", highlight=False)
            continue
        modes.append(mode)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=False).stdout.strip())
    started = time.time()
    load_before = os.getloadavg()[0]
    console.print(
        f"commit {commit}{' (dirty)' if dirty else ''}; fleet {args.fleet}; speed {args.speed:g} simulated s per wall s"
        f"{' (the simulated fleet slowed so that CPU noise on this shared host weighs less)' if args.speed < 1 else ''}; "
        f"{os.cpu_count()} cores; latencies in simulated time; {args.duration:g} simulated s of arrivals per run; seeds 0..{args.seeds - 1}; modes {', '.join(modes)}; "
        f"load average {load_before:.2f}", highlight=False,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    for what, fn in (("fairness", fairness), ("weights", weights), ("overload", overload)):
        if args.what in (what, "all"):
            rows += asyncio.run(fn(args, modes, console))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"commit": commit, "dirty": dirty, "argv": sys.argv[1:], "load_before": load_before, "load_after": os.getloadavg()[0],
            "wall_s": time.time() - started}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\ncommit {commit}{' (dirty)' if dirty else ''}; load average {load_before:.2f} → {meta['load_after']:.2f}; "
          f"{meta['wall_s']:.0f} s wall; wrote {out}")  # fmt: skip
    _print_summary(rows)


if __name__ == "__main__":
    main()
