"""TTFT and inter-token latency of one simulated engine against offered load.

Replays a length-only trace (default: Azure LLM inference 2023, conversation) through the
simulator's engine directly, on its virtual clock (no HTTP, no sleeping), with Poisson arrivals
at each offered rate, and reports latency percentiles (simulated seconds) and throughput. Also
runs the whole prompt set at once (rate "inf", like `vllm bench serve --request-rate inf`) for
the maximum throughput, which is what the published vLLM figures report.

    .venv/bin/python scripts/sim_load_curve.py                       # Azure conv, h100-llama-3.1-8b
    .venv/bin/python scripts/sim_load_curve.py --profile h100-qwen3-8b --requests 1000
    .venv/bin/python scripts/sim_load_curve.py --sharegpt            # ShareGPT lengths (tokenized)
    .venv/bin/python scripts/sim_load_curve.py --plot docs/sim_load_curve.png

Prompts are synthetic token ids of the trace's lengths, unique per request (a length-only
trace implies no shared prefixes); outputs are exactly the trace's lengths (ignore_eos).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from extproc.sim.engine import Engine, EngineConfig, SimRequest
from extproc.sim.profiles import PROFILES, get_profile

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "data" / "traces"
AZURE_CONV = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
SHAREGPT = TRACES / "sharegpt" / "sharegpt_v3_first2000.json"
DEFAULT_RATES = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 28, 32)


@dataclass
class Point:
    rate: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_mean: float
    tpot_p50: float
    tpot_p90: float
    e2e_mean: float
    throughput: float
    out_tok_s: float
    preemptions: int


def azure_lengths(path: Path, n: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the first `n` rows."""
    with path.open(newline="") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    return rows[:n]


def sharegpt_lengths(path: Path, n: int) -> list[tuple[int, int]]:
    """(prompt, output) token lengths of the first human/gpt turn pairs, Qwen3 tokenizer,
    chat template on the prompt (as vLLM's benchmark does with its model's tokenizer)."""
    from extproc.pipeline.tokens import TokenCounter

    counter = TokenCounter.from_source("builtin:qwen3")
    out: list[tuple[int, int]] = []
    for conv in json.loads(path.read_text()):
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt = counter.count_chat([{"role": "user", "content": turns[0]["value"]}]).count
        output = len(counter.encode(turns[1]["value"]))
        if 4 <= prompt <= 1024 and 4 <= output <= 1024:  # vLLM's benchmark_serving ShareGPT filter
            out.append((prompt, output))
        if len(out) >= n:
            break
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def simulate(profile_name: str, lengths: list[tuple[int, int]], rate: float | None, seed: int) -> Point:
    """Replay `lengths` with Poisson arrivals at `rate` req/s (None: all at t=0)."""
    p = get_profile(profile_name)
    cfg = EngineConfig(
        num_gpu_blocks=p.num_gpu_blocks(), block_size=p.block_size, max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.max_num_batched_tokens, max_model_len=p.max_model_len,
    )
    eng = Engine(cfg, p.coefficients)
    rng = random.Random(seed)
    t = 0.0
    reqs: list[SimRequest] = []
    for i, (prompt, output) in enumerate(lengths):
        prompt = max(1, min(prompt, cfg.max_model_len - output - 1))
        if rate is not None:
            t += rng.expovariate(rate)
        ids = range(i * 1_000_003, i * 1_000_003 + prompt)  # unique ids: no shared prefixes
        req = SimRequest(ids, max(1, output), t)
        reqs.append(req)
        eng.add_request(req)
    eng.run(max_steps=256)
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    tpot = [
        (r.finish_time - r.first_token_time) / (r.num_output - 1)
        for r in reqs
        if r.num_output > 1 and r.finish_time is not None and r.first_token_time is not None
    ]
    span = max(r.finish_time or 0.0 for r in reqs) - min(r.arrival for r in reqs)
    out_tokens = sum(r.num_output for r in reqs)
    return Point(
        rate=float("inf") if rate is None else rate,
        ttft_p50=statistics.median(ttft), ttft_p90=percentile(ttft, 0.9), ttft_p99=percentile(ttft, 0.99),
        itl_mean=eng.stats.itl.mean, tpot_p50=statistics.median(tpot), tpot_p90=percentile(tpot, 0.9),
        e2e_mean=eng.stats.e2e.mean, throughput=len(reqs) / span, out_tok_s=out_tokens / span, preemptions=eng.stats.preemptions,
    )


def knee(points: list[Point], ttft_slo: float) -> Point | None:
    """The highest offered rate whose p90 TTFT stays within `ttft_slo` (past it the queue grows
    without bound and TTFT jumps by orders of magnitude)."""
    ok = [pt for pt in points if pt.ttft_p90 <= ttft_slo]
    return max(ok, key=lambda pt: pt.rate) if ok else None


def table(points: list[Point]) -> str:
    head = (
        "| offered req/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL mean | TPOT p50 | TPOT p90 | E2E mean "
        "| served req/s | out tok/s | preemptions |"
    )
    lines = [head, "|" + "---:|" * 11]
    for pt in points:
        rate = "inf" if pt.rate == float("inf") else f"{pt.rate:g}"
        lines.append(
            f"| {rate} | {pt.ttft_p50 * 1e3:.0f} ms | {pt.ttft_p90 * 1e3:.0f} ms | {pt.ttft_p99 * 1e3:.0f} ms "
            f"| {pt.itl_mean * 1e3:.1f} ms | {pt.tpot_p50 * 1e3:.1f} ms | {pt.tpot_p90 * 1e3:.1f} ms "
            f"| {pt.e2e_mean:.2f} s | {pt.throughput:.1f} | {pt.out_tok_s:.0f} | {pt.preemptions} |"
        )
    return "\n".join(lines)


def plot(points: list[Point], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [pt for pt in points if pt.rate != float("inf")]
    rates = [pt.rate for pt in finite]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
    ax1.plot(rates, [pt.ttft_p50 for pt in finite], "o-", label="p50")
    ax1.plot(rates, [pt.ttft_p90 for pt in finite], "s-", label="p90")
    ax1.set_yscale("log")
    ax1.set_xlabel("offered load (req/s)")
    ax1.set_ylabel("TTFT (simulated s)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(rates, [pt.itl_mean * 1e3 for pt in finite], "o-", label="ITL mean")
    ax2.plot(rates, [pt.tpot_p90 * 1e3 for pt in finite], "s-", label="TPOT p90")
    ax2.set_xlabel("offered load (req/s)")
    ax2.set_ylabel("inter-token latency (ms)")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h100-llama-3.1-8b", choices=sorted(PROFILES))
    ap.add_argument("--trace", type=Path, default=AZURE_CONV, help="Azure-format CSV (ContextTokens, GeneratedTokens)")
    ap.add_argument("--sharegpt", action="store_true", help="use ShareGPT lengths instead of --trace")
    ap.add_argument("--requests", type=int, default=2000, help="prompts per rate (a finite run, as vLLM's benchmark)")
    ap.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES))
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="p90 TTFT bound for the knee (simulated s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, help="write a PNG here")
    args = ap.parse_args(argv)

    source = SHAREGPT if args.sharegpt else args.trace
    if not source.is_file():
        print(f"error: trace not found: {source}", file=sys.stderr)
        return 2
    lengths = sharegpt_lengths(source, args.requests) if args.sharegpt else azure_lengths(source, args.requests)
    mean_in = statistics.mean(p for p, _ in lengths)
    mean_out = statistics.mean(o for _, o in lengths)
    print(f"# {args.profile}: {len(lengths)} requests from {source.name} (mean in {mean_in:.0f}, out {mean_out:.0f} tokens)")
    t0 = time.perf_counter()
    points = [simulate(args.profile, lengths, rate, args.seed) for rate in args.rates]
    points.append(simulate(args.profile, lengths, None, args.seed))
    print(table(points))
    k = knee(points[:-1], args.ttft_slo)
    print(
        f"\nmax throughput (all prompts at once): {points[-1].throughput:.1f} req/s, {points[-1].out_tok_s:.0f} output tok/s"
    )
    print(f"knee (highest rate served with p90 TTFT <= {args.ttft_slo:g} s): {k.rate:g} req/s" if k else "knee: none")
    print(f"simulated in {time.perf_counter() - t0:.1f} s wall")
    if args.plot:
        plot(points, args.plot, f"{args.profile}, {source.name}: {len(lengths)} requests per point (simulated time)")
        print(f"wrote {args.plot} ({args.plot.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
