#!/usr/bin/env python3
"""docs/benchmarks.md from the result files, so the page cannot drift from the runs.

    .venv/bin/python scripts/bench_report.py            # rewrite docs/benchmarks.md
    .venv/bin/python scripts/bench_report.py --check    # exit 1 when the page is not what the files say

The page is docs/benchmarks/header.md (prose written by hand: the method, what was and was not
rerun), then one section per result file in docs/benchmarks/results/*.json (an
`extproc.bench.seeds.SeededResult`, written by scripts/bench_steady.py), in file-name order:
its commit, date, seeds, load and command; per policy the mean and 95 % bootstrap interval over
the valid seeds of every figure; every other policy against the baseline ("ahead", "behind",
"within noise", with the interval of the difference); the runs one by one (invalid ones with the
reason); and the field's own clients' figures beside ours when the file has them. Then
docs/benchmarks/footer.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extproc.bench.seeds import FIGURES, SeededResult, aggregate, compare_to  # noqa: E402
from extproc.bench.stats import Interval  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks"
PAGE = ROOT / "docs" / "benchmarks.md"
_BY_KEY = {f.key: f for f in FIGURES}
SUBJECT = "llm-extproc"
"""The policy the page is about (the default profile): also compared with every peer, not only the baseline."""


def _cell(iv: Interval | None, key: str) -> str:
    if iv is None:
        return "–"
    fig = _BY_KEY[key]
    if fig.percent:
        return iv.fmt(fig.digits, 100).replace(" [", " % [").replace("]", " %]") if iv.n > 1 else f"{iv.mean * 100:.{fig.digits}f} %"
    return iv.fmt(fig.digits)


def _hotspot_classes(result: SeededResult, policy: str) -> str:
    runs = [r for r in result.valid_runs() if r.policy == policy and r.hotspot_by_class]
    if not runs:
        return "–"
    classes = sorted({c for r in runs for c in r.hotspot_by_class})
    parts = []
    for c in classes:
        spots = [r.hotspot_by_class[c] for r in runs if c in r.hotspot_by_class]
        shares = [r.class_share.get(c, 0.0) for r in runs]
        parts.append(f"{c} {sum(spots) / len(spots):.2f} ({sum(shares) / len(shares):.0%})")
    return ", ".join(parts)


def steady_tables(result: SeededResult) -> list[str]:
    """The markdown section of one result file (see the module docstring)."""
    s = result.settings
    valid = result.valid_runs()
    policies = list(dict.fromkeys(r.policy for r in result.runs))
    lines = [
        f"## {result.name}", "",
        f"- **workload**: {result.workload}",
        f"- **commit** `{result.commit}`, **date** {result.date}, **seeds** {', '.join(map(str, result.seeds))}, "
        f"**load** ×{s.get('rate_scale', 1):g} the trace's rate (label {s.get('load', '1')}), simulator speed {s.get('speed', 1):g}, "
        f"warm-up {s.get('warmup_s', 0):g} s left out, {s.get('steady_s', 0):g} s of arrivals measured (simulated time)",
        f"- **fleet** {', '.join(s.get('fleet', []))}; **SLO** TTFT ≤ {s.get('slo', {}).get('ttft_ms', 2000):g} ms, "
        f"TPOT ≤ {s.get('slo', {}).get('itl_ms', 100):g} ms",
        f"- **machine** {result.machine}",
        f"- **command** `{result.command}`",
    ]  # fmt: skip
    if not result.rerun:
        lines.append("- **not rerun with this method**: carried over from the history (see there)")
    if result.runs:
        lines += _steady(result, valid, policies)
    if result.external:
        lines += _external(result)
    return lines + [""]


def _steady(result: SeededResult, valid: list, policies: list[str]) -> list[str]:
    """Means with intervals, verdicts against the baseline, and the runs one by one."""
    lines = [
        "", f"Mean over valid seeds [95 % bootstrap interval]; {len(valid)} of {len(result.runs)} runs valid.", "",
        "| policy | seeds | " + " | ".join(f.label for f in FIGURES) + " | hotspot per GPU (share) |",
        "|---|---:|" + "---:|" * len(FIGURES) + "---|",
    ]  # fmt: skip
    table = aggregate(valid)
    for policy in policies:
        row = table.get(policy, {})
        n = sum(1 for r in valid if r.policy == policy)
        cells = [_cell(row.get(f.key), f.key) for f in FIGURES]
        lines.append(f"| {policy} | {n} | " + " | ".join(cells) + f" | {_hotspot_classes(result, policy)} |")
    verdicts = compare_to(valid, result.baseline)
    if verdicts:
        title = f"Against {result.baseline}, paired by seed: verdict (difference of means [95 % interval])."
        lines += _verdict_table(title, "policy", verdicts)
    subject = SUBJECT if SUBJECT in policies and SUBJECT != result.baseline else None
    others = [p for p in policies if p not in (subject, result.baseline)]
    if subject and others:
        rows = {other: compare_to(valid, other).get(subject, {}) for other in others}
        lines += _verdict_table(f"{subject} against each other policy, paired by seed.", "against", rows)
    lines += [
        "", "Runs:", "",
        "| policy | seed | valid | steady span (s) | requests | offered / achieved req/s | TTFT p99 | TPOT p99 | hotspot | client CPU | load avg | notes |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for r in result.runs:
        why = "yes" if r.valid else "**no**: " + "; ".join(r.invalid_reasons)
        lines.append(
            f"| {r.policy} | {r.seed} | {why} | {r.steady_span_s:,.0f} | {r.summary.requests:,} | "
            f"{r.offered_rps or 0:.2f} / {r.achieved_rps or 0:.2f} | {r.summary.ttft_ms.p99 or 0:,.0f} | "
            f"{r.summary.itl_ms.p99 or 0:,.1f} | {'–' if r.hotspot is None else f'{r.hotspot:.2f}'} | {r.client_cpu:.0%} | "
            f"{r.load_average:.1f} | {'; '.join(r.notes) or '–'} |"
        )
    return lines


def _verdict_table(title: str, head: str, rows: dict[str, dict]) -> list[str]:
    """A titled table of verdicts, one row per label (`rows`: label -> `compare_to`'s comparisons)."""
    keys = [f for f in FIGURES if f.higher_is_better is not None]
    lines = ["", title, "", f"| {head} | " + " | ".join(f.label for f in keys) + " |", "|---|" + "---|" * len(keys)]
    return lines + [_verdict_row(label, comps, keys) for label, comps in rows.items()]


def _verdict_row(label: str, comps: dict, keys: list) -> str:
    cells = []
    for f in keys:
        c = comps.get(f.key)
        cells.append("–" if c is None else f"**{c.verdict}** ({_cell(c.difference, f.key)})")
    return f"| {label} | " + " | ".join(cells) + " |"


def _external(result: SeededResult) -> list[str]:
    """The field's clients' figures beside ours (`scripts/bench_clients.py`)."""
    lines = [
        "", "The field's clients on the same stacks (one seed each; the notes say how each was run):", "",
        "| policy | client | requests ok | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | req/s | notes |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for e in result.external:
        lines.append(
            f"| {e['policy']} | {e['client']} | {e.get('ok', '–')} | {_ms(e.get('ttft_p50_ms'))} / {_ms(e.get('ttft_p99_ms'))} | "
            f"{_ms(e.get('tpot_p50_ms'), 1)} / {_ms(e.get('tpot_p99_ms'), 1)} | {_ms(e.get('output_tokens_per_s'))} | "
            f"{_ms(e.get('rps'), 2)} | {e.get('notes', '')} |"
        )
    return lines


def _ms(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def capacity_tables(results: list[SeededResult]) -> list[str]:
    """Capacity on p99 TTFT, p99 TPOT and both, for each workload run at two loads or more.

    Result files of one workload share its name before `-x<load>` (bench_steady.py names them
    so). The bounds are the baseline's mean p99 TTFT and p99 TPOT at load "1"; each load point
    is the mean over valid seeds (`extproc.bench.capacity.two_objective_capacity`).
    """
    from extproc.bench.capacity import LoadPoint, two_objective_capacity

    groups: dict[str, list[SeededResult]] = {}
    for r in results:
        if r.runs:
            groups.setdefault(r.name.split("-x")[0], []).append(r)
    lines: list[str] = []
    for workload, rs in groups.items():
        if len({r.settings.get("load", "1") for r in rs}) < 2:
            continue
        baseline = rs[0].baseline
        points: dict[str, list[LoadPoint]] = {}
        bounds = None
        for r in rs:
            valid = r.valid_runs()
            for policy, figs in aggregate(valid).items():
                offered = [v.offered_rps for v in valid if v.policy == policy and v.offered_rps]
                if not offered or not {"ttft_p99_ms", "tpot_p99_ms"} <= set(figs):
                    continue
                point = LoadPoint(sum(offered) / len(offered), figs["ttft_p99_ms"].mean, figs["tpot_p99_ms"].mean)
                points.setdefault(policy, []).append(point)
                if policy == baseline and r.settings.get("load", "1") == "1":
                    bounds = (point.ttft_p99_ms, point.tpot_p99_ms)
        if bounds is None:
            continue
        lines += [
            f"## Capacity on every objective: {workload}", "",
            f"The highest offered rate at which p99 TTFT ≤ {bounds[0]:,.0f} ms *and* p99 TPOT ≤ {bounds[1]:,.1f} ms "
            f"({baseline}'s at load 1), interpolated between loads (mean over valid seeds); ≥ when it held at the heaviest load.", "",
            "| policy | loads (req/s) | capacity on TTFT | on TPOT | on both | × " + baseline + " |",
            "|---|---|---:|---:|---:|---:|",
        ]  # fmt: skip
        caps = {p: two_objective_capacity(pts, *bounds) for p, pts in points.items()}
        base = caps.get(baseline)
        for policy, cap in caps.items():
            ge = "≥ " if cap.holds_at_top else ""
            loads = ", ".join(f"{p.offered_rps:.2f}" for p in sorted(points[policy], key=lambda p: p.offered_rps))
            ratio = "–" if cap.both_rps is None or base is None or not base.both_rps else f"{ge}{cap.both_rps / base.both_rps:.2f}"
            lines.append(
                f"| {policy} | {loads} | {_ms(cap.ttft_rps, 2)} | {_ms(cap.tpot_rps, 2)} | "
                f"{ge if cap.both_rps is not None else ''}{_ms(cap.both_rps, 2)} | {ratio} |"
            )
        lines.append("")
    return lines


def render(docs: Path = DOCS) -> str:
    """The whole page: header, one section per result file (name order), capacity, footer."""
    parts = [(docs / "header.md").read_text(encoding="utf-8").rstrip() + "\n"]
    results = [SeededResult.model_validate_json(p.read_bytes()) for p in sorted((docs / "results").glob("*.json"))]
    for result in results:
        parts.append("\n".join(steady_tables(result)))
    capacity = capacity_tables(results)
    if capacity:
        parts.append("\n".join(capacity))
    footer = docs / "footer.md"
    if footer.exists():
        parts.append(footer.read_text(encoding="utf-8").rstrip() + "\n")
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="do not write: exit 1 when docs/benchmarks.md differs")
    ap.add_argument("--docs", default=str(DOCS), help="the folder with header.md, footer.md and results/")
    ap.add_argument("--page", default=str(PAGE))
    args = ap.parse_args()
    page = render(Path(args.docs))
    target = Path(args.page)
    if args.check:
        current = target.read_text(encoding="utf-8") if target.exists() else ""
        if current != page:
            print(f"{target} is not what the result files say: run scripts/bench_report.py", file=sys.stderr)
            raise SystemExit(1)
        return
    target.write_text(page, encoding="utf-8")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
