#!/usr/bin/env python3
"""What the precise prefix source costs the server's event loop per KV-event batch, side by side
for the two event shapes vLLM has published (tagged arrays up to 0.2x, tagged maps since), and
against tokenizing the same tokens on the request path.

Per batch of one `BlockStored` of N 16-token blocks (random token ids and engine hashes):

  decode           `decode_batch(payload)` (msgpack → our dataclasses, every field checked)
  apply stored     `PreciseIndexer.apply`: our chained BLAKE2b hashes from the token ids, the
                   translation table, the prefix index
  apply removed    a `BlockRemoved` of the same blocks
  tokenize         the Qwen3 tokenizer's cost per token on new text (no segment cache), times the
                   batch's tokens: what the request path already pays for a prompt that long

Micro-benchmark (no fleet, no Envoy): runs anywhere.

    .venv/bin/python scripts/bench_kv_events.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import time

from extproc.config.schema import PrefixConfig
from extproc.pipeline.tokens import TokenCounter
from extproc.prefix.kv_events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from extproc.prefix.precise import PreciseIndexer
from extproc.prefix.tracker import PrefixTracker

BS = 16
SIZES = (1, 8, 64, 512)


def per_call(fn, items) -> float:
    t = time.perf_counter()
    for it in items:
        fn(it)
    return (time.perf_counter() - t) / len(items)


def measure(blocks: int, shape: str, rng: random.Random) -> dict[str, float]:
    n = 2000 if blocks < 100 else 200
    toks = tuple(rng.randrange(150_000) for _ in range(blocks * BS))
    batches = [
        KVEventBatch(time.time(), (BlockStored(tuple(rng.getrandbits(64) for _ in range(blocks)), None, toks, BS, None, "GPU"),), 0)
        for _ in range(n)
    ]
    payloads = [encode_batch(b, event_shape=shape) for b in batches]  # type: ignore[arg-type]
    tracker = PrefixTracker(PrefixConfig())
    idx = PreciseIndexer(tracker)
    idx.register("10.0.0.1:8000")
    removed = [KVEventBatch(0.0, (BlockRemoved(b.events[0].block_hashes, "GPU"),), 0) for b in batches]  # type: ignore[union-attr]
    return {
        "bytes": len(payloads[0]),
        "decode_us": per_call(decode_batch, payloads) * 1e6,
        "stored_us": per_call(lambda b: idx.apply("10.0.0.1:8000", b), batches) * 1e6,
        "removed_us": per_call(lambda b: idx.apply("10.0.0.1:8000", b), removed) * 1e6,
    }


def tokenize_s_per_token(counter: TokenCounter) -> float:
    """The tokenizer's cost per token on text it has never seen (the segment cache cannot help)."""
    rng = random.Random(12345)
    vocab = ["load", "balancing", "of", "the", "cache", "prefix", "engine", "token", "block", "request"]
    texts = [" ".join(rng.choice(vocab) + str(rng.randrange(10**6)) for _ in range(500)) for _ in range(40)]
    t = time.perf_counter()
    tokens = sum(counter.count_text(x).count for x in texts)
    return (time.perf_counter() - t) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the fastest is reported")
    args = ap.parse_args()
    tok_s = tokenize_s_per_token(TokenCounter.from_source("builtin:qwen3"))
    print(f"tokenizing new text: {tok_s * 1e6:.2f} µs per token\n")
    print("| blocks × 16 tokens | shape | payload | decode | apply stored | apply removed | µs per stored token | tokenize same length | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for blocks in SIZES:
        for shape in ("map", "array"):
            runs = [measure(blocks, shape, random.Random(r)) for r in range(args.repeat)]
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            per_token = (best["decode_us"] + best["stored_us"]) / (blocks * BS)
            tokenize_us = tok_s * blocks * BS * 1e6
            print(
                f"| {blocks} | {shape} | {best['bytes']:,} B | {best['decode_us']:.1f} µs | {best['stored_us']:.1f} µs | "
                f"{best['removed_us']:.1f} µs | {per_token:.3f} | {tokenize_us:.0f} µs | "
                f"{(best['decode_us'] + best['stored_us']) / tokenize_us:.2f} |"
            )


if __name__ == "__main__":
    main()
