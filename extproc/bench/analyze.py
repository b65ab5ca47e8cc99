"""Token-length and arrival analysis of a trace (`llm-extproc analyze`).

What it computes from a list of `TraceRequest` (definitions as in
the traces' published quick stats, so those tables can be reproduced; sources in docs/benchmarks.md):
  - input and output lengths: count, mean, p50/p90/p99/p99.9 (numpy linear interpolation), max,
    share ≤ 512 tokens, and a histogram on power-of-two bins `[2^k, 2^(k+1))`;
  - the design notes' tier split: < 512 / 512–2048 / > 2048 input tokens (DESIGN section 9
    item 9: low-latency / balanced / high-throughput), and tier boundaries suggested for this
    traffic (`suggest_tiers`);
  - arrivals: span, mean rate (requests / span), peak 1-minute rate (busiest 60 s bin from the
    first arrival), and the index of dispersion of per-second counts (population variance /
    mean: ~1 for Poisson arrivals, above 1 for bursty ones);
  - prefix reuse when requests carry `prefix_blocks` (Mooncake, the synthetic workload), with an
    infinite cache, in arrival order;
  - optionally, how many requests a head + tail truncation to `max_len` tokens would cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from extproc.bench.traces import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest
from extproc.pipeline.truncate import head_tail_split

__all__ = [
    "TIER_EDGES",
    "analyze_trace",
    "arrival_stats",
    "enough_spread",
    "length_stats",
    "log2_histogram",
    "prefix_reuse",
    "render_analysis",
    "suggest_tiers",
    "tier_split",
    "truncation_stats",
]

TIER_EDGES = (512, 2048)
"""Tier boundaries (tokens): < 512 low-latency, 512–2048 balanced, > 2048 high-throughput."""


def log2_histogram(values: np.ndarray) -> list[dict[str, Any]]:
    """Counts on bins `[2^k, 2^(k+1))` covering `values` (positive ints); share of the total each."""
    if values.size == 0:
        return []
    lo = int(np.floor(np.log2(max(1, values.min()))))
    hi = int(np.floor(np.log2(max(1, values.max())))) + 1
    edges = 2.0 ** np.arange(lo, hi + 1)
    counts, _ = np.histogram(values, bins=edges)
    total = values.size
    return [
        {"lo": int(a), "hi": int(b), "count": int(c), "share": int(c) / total}
        for a, b, c in zip(edges[:-1], edges[1:], counts)
    ]


def length_stats(values: np.ndarray) -> dict[str, Any]:
    """Distribution of lengths (tokens): count, mean, percentiles, max, share ≤ 512, histogram."""
    if values.size == 0:
        return {"count": 0}
    p50, p90, p99, p999 = np.percentile(values, [50, 90, 99, 99.9])
    return {
        "count": int(values.size),
        "mean": float(values.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "p99.9": float(p999),
        "max": int(values.max()),
        "share_le_512": float((values <= 512).mean()),
        "histogram": log2_histogram(values),
    }


def tier_split(input_tokens: np.ndarray, edges: tuple[int, int] = TIER_EDGES) -> dict[str, dict[str, float]]:
    """Count and share of requests per tier (`<512`, `512-2048`, `>2048` for the default edges)."""
    low, high = edges
    total = max(1, input_tokens.size)
    counts = {
        f"<{low}": int((input_tokens < low).sum()),
        f"{low}-{high}": int(((input_tokens >= low) & (input_tokens <= high)).sum()),
        f">{high}": int((input_tokens > high).sum()),
    }
    return {k: {"count": v, "share": v / total} for k, v in counts.items()}


SUGGEST_QUANTILES = (68.0, 90.0)
"""The design notes' edges sit at these percentiles of their traffic (68 % ≤ 512 tokens, P90
2,048): `suggest_tiers` puts this traffic's edges at the same percentiles."""


def _pow2(x: float) -> int:
    return int(2 ** round(np.log2(max(1.0, x))))


def suggest_tiers(input_tokens: np.ndarray) -> dict[str, Any]:
    """Tier boundaries for this traffic: its P68 and P90 input lengths (`SUGGEST_QUANTILES`),
    each rounded to the nearest power of two — on the design notes' distribution this gives
    their 512 and 2,048. Keys: `low_latency_below`, `high_throughput_above` (tokens, as in
    `scheduling.tiers`), `edges` and the `split` those edges give. Both percentiles rounding to
    the same power of two (`enough_spread` False: no balanced tier exists, the edges are no
    advice) gives equal edges; no traffic gives the low default edge twice."""
    if input_tokens.size == 0:
        low = high = TIER_EDGES[0]
    else:
        p_low, p_high = np.percentile(input_tokens, SUGGEST_QUANTILES)
        low, high = _pow2(p_low), _pow2(p_high)
        high = max(high, low)
    split = tier_split(input_tokens, (low, high))
    return {"low_latency_below": low, "high_throughput_above": high, "edges": (low, high), "split": split}


def enough_spread(suggested: dict[str, Any]) -> bool:
    """Whether `suggest_tiers`' edges leave room for a balanced tier (they differ)."""
    low, high = suggested["edges"]
    return high > low


def arrival_stats(arrivals: np.ndarray) -> dict[str, float | None]:
    """Span (s), mean and peak-1-minute rates (requests/s), index of dispersion per 1 s.

    The peak is the busiest 60 s bin's count over the bin's length, min(60 s, span): a log
    shorter than a minute has one bin, whose rate is the mean, not its count over 60 s."""
    if arrivals.size < 2 or arrivals[-1] <= arrivals[0]:
        return {"span_s": 0.0, "mean_rps": None, "peak_1min_rps": None, "iod_1s": None}
    rel = np.sort(arrivals) - arrivals.min()
    per_second = np.bincount(np.floor(rel).astype(np.int64))
    per_minute = np.bincount(np.floor(rel / 60).astype(np.int64))
    span = float(rel[-1])
    return {
        "span_s": span,
        "mean_rps": arrivals.size / span,
        "peak_1min_rps": float(per_minute.max()) / min(60.0, span),
        "iod_1s": float(per_second.var() / per_second.mean()),
    }


def prefix_reuse(requests: Sequence[TraceRequest]) -> dict[str, float | int] | None:
    """Prefix reuse over `prefix_blocks` (512-token blocks), infinite cache, in arrival order.

    Returns None when no request has blocks. Keys: `block_refs`, `distinct_blocks`,
    `repeat_fraction` (block references that repeat an earlier request's block),
    `cached_token_fraction` (Σ min(512·k, input) / Σ input, k = leading blocks seen before),
    `lead1_fraction` / `lead2_fraction` (requests whose leading ≥1 / ≥2 blocks were seen).
    """
    if not any(r.prefix_blocks for r in requests):
        return None
    seen: set[int] = set()
    refs = repeats = cached = total = lead1 = lead2 = 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        blocks = r.prefix_blocks or ()
        refs += len(blocks)
        repeats += sum(1 for b in blocks if b in seen)
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        cached += min(MOONCAKE_BLOCK_TOKENS * k, r.input_tokens)
        total += r.input_tokens
        lead1 += k >= 1
        lead2 += k >= 2
        seen.update(blocks)
    n = len(requests)
    return {
        "block_refs": refs,
        "distinct_blocks": len(seen),
        "repeat_fraction": repeats / refs if refs else 0.0,
        "cached_token_fraction": cached / total if total else 0.0,
        "lead1_fraction": lead1 / n,
        "lead2_fraction": lead2 / n,
    }


def truncation_stats(input_tokens: np.ndarray, max_len: int) -> dict[str, float | int]:
    """What head + tail truncation to `max_len` tokens would do to these prompts.

    Raises:
        ValueError: `max_len` < 1.
    """
    head_tail_split(0, max_len)  # validates max_len
    cut = input_tokens[input_tokens > max_len]
    heads = [head_tail_split(int(n), max_len)[0] for n in cut]
    total = int(input_tokens.sum())
    dropped = int((cut - max_len).sum())
    return {
        "max_len": max_len,
        "requests_cut": int(cut.size),
        "share_cut": cut.size / max(1, input_tokens.size),
        "tokens_dropped": dropped,
        "share_tokens_dropped": dropped / total if total else 0.0,
        "head_tokens_p50": float(np.median(heads)) if heads else None,
    }


def analyze_trace(trace: Trace, *, truncate: int | None = None) -> dict[str, Any]:
    """The full analysis of a loaded trace, as a JSON-ready dict.

    A decision log's `output_tokens` are output budgets (`max_tokens`, or the expected output),
    not generated lengths: `output_label` says which, and refused requests (`refused`, counted)
    are left out of them, since nothing was generated for them; they stay in the input lengths
    and arrivals (they were offered)."""
    requests = trace.requests
    inputs = np.array([r.input_tokens for r in requests], dtype=np.int64)
    outputs = np.array([r.output_tokens for r in requests if not r.refused], dtype=np.int64)
    arrivals = np.array([r.arrival_s for r in requests], dtype=float)
    return {
        "path": str(trace.path),
        "format": trace.format,
        "requests": len(requests),
        "skipped": dict(trace.skipped),
        "synthesized_arrivals": trace.synthesized_arrivals,
        "sessions": len({r.session for r in requests if r.session}),
        "input_tokens": length_stats(inputs),
        "output_tokens": length_stats(outputs),
        "output_label": "output budget" if trace.format == "decisions" else "output",
        "refused": sum(1 for r in requests if r.refused),
        "tiers": tier_split(inputs),
        "suggested_tiers": suggest_tiers(inputs),
        "arrivals": arrival_stats(arrivals),
        "prefix_reuse": prefix_reuse(requests),
        "truncation": truncation_stats(inputs, truncate) if truncate is not None else None,
    }


def _n(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def render_analysis(analysis: dict[str, Any], console: Console) -> None:
    """Print the analysis as rich tables."""
    skipped = ", ".join(f"{k}: {v}" for k, v in analysis["skipped"].items()) or "none"
    console.print(
        f"[bold]{analysis['path']}[/bold] format={analysis['format']} requests={analysis['requests']:,} "
        f"sessions={analysis['sessions']:,} skipped_rows={skipped}"
    )
    lengths = Table(title="Token lengths (tokens)", box=box.SIMPLE)
    lengths.add_column("")
    for key in ("count", "mean", "p50", "p90", "p99", "p99.9", "max", "≤ 512"):
        lengths.add_column(key, justify="right")
    labels = {"input_tokens": "input", "output_tokens": analysis.get("output_label", "output")}
    for name, label in labels.items():
        s = analysis[name]
        if s.get("count"):
            lengths.add_row(
                label,
                *(_n(s[k]) for k in ("count", "mean", "p50", "p90", "p99", "p99.9", "max")),
                f"{s['share_le_512']:.1%}",
            )
    console.print(lengths)
    if analysis.get("refused"):
        console.print(f"{analysis['refused']:,} refused requests are in the input lengths, not in the output budget (nothing was generated)")
    hist = Table(title="Input length histogram (power-of-two bins, tokens)", box=box.SIMPLE)
    for col, justify in (("bin", "left"), ("count", "right"), ("share", "right"), ("", "left")):
        hist.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in analysis["input_tokens"].get("histogram", []):
        hist.add_row(f"[{row['lo']:,}, {row['hi']:,})", f"{row['count']:,}", f"{row['share']:.1%}",
                     "█" * round(40 * row["share"]))
    console.print(hist)
    tiers = Table(title="Tiers", box=box.SIMPLE)
    for col in ("tier", "requests", "share"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in analysis["tiers"].items():
        tiers.add_row(name, f"{t['count']:,}", f"{t['share']:.1%}")
    console.print(tiers)
    sug = analysis["suggested_tiers"]
    shares = " / ".join(f"{t['share']:.1%}" for t in sug["split"].values())
    if not enough_spread(sug):
        console.print(
            "Suggested tiers: not enough spread in input lengths to suggest tiers (P68 and P90 both "
            f"round to {sug['low_latency_below']:,} tokens); keep scheduling.tiers as they are"
        )
    else:
        console.print(
            f"Suggested tiers for this traffic (its P68 and P90, to the nearest power of two): "
            f"scheduling.tiers.low_latency_below: {sug['low_latency_below']}, high_throughput_above: "
            f"{sug['high_throughput_above']} (shares {shares})"
        )
    a = analysis["arrivals"]
    note = " (synthesized, Poisson)" if analysis["synthesized_arrivals"] else ""
    console.print(
        f"Arrivals{note}: span {_n(a['span_s'], 1)} s, mean {_n(a['mean_rps'], 3)} req/s, "
        f"peak 1-min {_n(a['peak_1min_rps'], 2)} req/s, index of dispersion (1 s) {_n(a['iod_1s'], 2)}"
    )
    reuse = analysis["prefix_reuse"]
    if reuse:
        console.print(
            f"Prefix reuse (512-token blocks, infinite cache): {reuse['block_refs']:,} block refs, "
            f"{reuse['distinct_blocks']:,} distinct; repeat {reuse['repeat_fraction']:.3f}; cached tokens "
            f"{reuse['cached_token_fraction']:.3f}; leading ≥1 block seen {reuse['lead1_fraction']:.4f}, "
            f"≥2 blocks {reuse['lead2_fraction']:.3f}"
        )
    cut = analysis["truncation"]
    if cut:
        console.print(
            f"Head + tail truncation to {cut['max_len']:,} tokens: {cut['requests_cut']:,} requests cut "
            f"({cut['share_cut']:.2%}), {cut['tokens_dropped']:,} tokens dropped "
            f"({cut['share_tokens_dropped']:.2%} of input tokens); median head kept {_n(cut['head_tokens_p50'])}"
        )
