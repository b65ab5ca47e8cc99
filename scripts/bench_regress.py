#!/usr/bin/env python3
"""Regression check: rerun a small fixed set (a few minutes) and compare it with the stored figures.

Run it before resolving any change to the decision path (scoring, admission, the prefix index):

    flock /tmp/bench.lock .venv/bin/python scripts/bench_regress.py          # rerun and compare
    .venv/bin/python scripts/bench_regress.py --compare new.json             # compare a saved rerun

The set (`FIXED`): Mooncake conversation at its own rate, whole conversations in a closed loop,
envoy-least-request and llm-extproc, seeds 0-2, 20 s warm-up and 100 s of arrivals measured,
simulators at speed 2: six runs of ~80 s on the 2-core machine (~8 minutes with start-ups). The
reference is docs/benchmarks/regress/reference.json, made by `--update` with the same set.

A figure of a policy is **flagged** when its change against the reference, paired by seed, is
beyond noise (the 95 % bootstrap interval of the per-seed differences excludes 0,
`extproc.bench.stats.compare`) *and* larger than `--tolerance` (10 %) of the reference mean: the
seeds' own spread decides what noise is, and a consistent but tiny shift is not a regression.
The verdict says which way ("better" or "worse"). Exit 1 when a figure got worse, 0 otherwise
(a better one is reported, not failed: update the reference once the change is resolved).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extproc.bench.seeds import FIGURES, SeededResult  # noqa: E402
from extproc.bench.stats import compare  # noqa: E402

REFERENCE = ROOT / "docs" / "benchmarks" / "regress" / "reference.json"
FIXED = [
    "--workload", "mooncake-conv", "--policies", "envoy-least-request,llm-extproc", "--seeds", "3",
    "--warmup", "20", "--steady", "100", "--speed", "2",
]  # fmt: skip
CHECKED = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "goodput_rps", "prefix_hit", "hotspot")


def regressions(reference: SeededResult, new: SeededResult, tolerance: float) -> list[dict]:
    """Every (policy, figure) of `CHECKED` compared, paired by seed; rows with `flag` set where
    the change is beyond noise and tolerance (`better` / `worse`), else `flag` None.

    Runs invalid in either file drop out of the pairs (their seed is None on that side).
    """
    figures = {f.key: f for f in FIGURES}
    rows = []
    policies = list(dict.fromkeys(r.policy for r in reference.runs))
    for policy in policies:
        ref = {r.seed: r for r in reference.valid_runs() if r.policy == policy}
        cur = {r.seed: r for r in new.valid_runs() if r.policy == policy}
        seeds = sorted(set(ref) & set(cur))
        if not seeds:
            rows.append({"policy": policy, "figure": "-", "flag": "missing", "note": "no valid seed in both files"})
            continue
        for key in CHECKED:
            fig = figures[key]
            a = [fig.get(cur[s]) for s in seeds]
            b = [fig.get(ref[s]) for s in seeds]
            if not any(x is not None and y is not None for x, y in zip(a, b)):
                continue
            c = compare(a, b, higher_is_better=bool(fig.higher_is_better))
            ref_mean = sum(v for v in b if v is not None) / max(1, sum(v is not None for v in b))
            rel = c.difference.mean / ref_mean if ref_mean else 0.0
            flag = None
            if c.verdict in ("ahead", "behind") and abs(rel) > tolerance:
                flag = "better" if c.verdict == "ahead" else "worse"
            rows.append({
                "policy": policy, "figure": key, "reference": ref_mean, "change": c.difference.mean, "relative": rel,
                "interval": (c.difference.low, c.difference.high), "verdict": c.verdict, "flag": flag,
            })  # fmt: skip
    return rows


def _print(rows: list[dict]) -> None:
    print("| policy | figure | reference | change [95 % interval] | relative | flag |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        if r["figure"] == "-":
            print(f"| {r['policy']} | – | – | – | – | **{r['flag']}**: {r['note']} |")
            continue
        lo, hi = r["interval"]
        flag = f"**{r['flag']}**" if r["flag"] else "–"
        print(f"| {r['policy']} | {r['figure']} | {r['reference']:,.3g} | {r['change']:+,.3g} [{lo:+,.3g}, {hi:+,.3g}] | {r['relative']:+.1%} | {flag} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", default="", help="compare this saved rerun instead of running the set")
    ap.add_argument("--reference", default=str(REFERENCE))
    ap.add_argument("--update", action="store_true", help="run the set and make it the reference")
    ap.add_argument("--tolerance", type=float, default=0.10, help="smallest relative change flagged (0.10 = 10 %%)")
    ap.add_argument("--traces", default="", help="the traces folder (scripts/bench_steady.py's --traces)")
    ap.add_argument("--out", default="out/regress")
    args = ap.parse_args()
    if not args.update and not Path(args.reference).exists():
        raise SystemExit(f"no reference at {args.reference}: make one with --update (the same fixed set) first")
    if args.compare:
        new_path = Path(args.compare)
    else:
        argv = [sys.executable, str(ROOT / "scripts" / "bench_steady.py"), *FIXED, "--out", args.out]
        if args.traces:
            argv += ["--traces", args.traces]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        new_path = Path(args.out) / "mooncake-conv.json"
    new = SeededResult.model_validate_json(new_path.read_bytes())
    if args.update:
        ref_path = Path(args.reference)
        ref_path.parent.mkdir(parents=True, exist_ok=True)
        ref_path.write_text(new_path.read_text(encoding="utf-8"), encoding="utf-8")
        print(f"wrote {ref_path}")
        return
    reference = SeededResult.model_validate_json(Path(args.reference).read_bytes())
    rows = regressions(reference, new, args.tolerance)
    print(f"reference {reference.commit} ({reference.date}) against {new.commit} ({new.date}); "
          f"flagged beyond the seeds' noise and {args.tolerance:.0%}:")  # fmt: skip
    _print(rows)
    raise SystemExit(1 if any(r["flag"] in ("worse", "missing") for r in rows) else 0)


if __name__ == "__main__":
    main()
