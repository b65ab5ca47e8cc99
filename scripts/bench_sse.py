#!/usr/bin/env python3
"""Per-chunk cost of the response-path telemetry, in microseconds.

A vLLM-shaped 512-token chat stream (role chunk, 512 one-token content chunks, finish chunk,
usage chunk, `[DONE]`; built with the simulator's own chunk writer), delivered one event per
body chunk as vLLM and Envoy usually do, or several events per chunk (`--events-per-chunk`), fed
through:

  parse            SSEParser.feed only
  observe          StreamObserver.on_body_chunk without markers (parse + JSON + TTFT/ITL + stats)
  observe+markers  the same with markers injected before every event
  parse+markers    SSEParser with start tracking plus marker splicing (what markers add to parse)

Each variant runs the whole stream `--repeat` times, interleaved with the others; the report is
the median µs per chunk over runs and the best run (the machine is shared and noisy: compare rows
of one run, and trust the best run more than the median).

    .venv/bin/python scripts/bench_sse.py [--tokens 512] [--repeat 200] [--events-per-chunk 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from extproc.protocol.sse import SSEParser
from extproc.sim.api import DONE, output_text, stream_chunk, usage_chunk
from extproc.telemetry.observer import ObserverOptions, StreamObserver
from extproc.telemetry.stats import EndpointStreamStats

MODEL = "Qwen/Qwen3-8B"


def build_stream(tokens: int, events_per_chunk: int) -> list[bytes]:
    rid, created = "chatcmpl-bench", 1753862400
    events = [stream_chunk("chat", rid, created, MODEL, "", role=True)]
    events += [stream_chunk("chat", rid, created, MODEL, output_text(7, i, i + 1)) for i in range(tokens)]
    events.append(stream_chunk("chat", rid, created, MODEL, "", finish_reason="stop"))
    events.append(usage_chunk("chat", rid, created, MODEL, 1000, tokens))
    events.append(DONE)
    return [b"".join(events[i : i + events_per_chunk]) for i in range(0, len(events), events_per_chunk)]


def run_parse(chunks: list[bytes]) -> None:
    p = SSEParser()
    for c in chunks:
        p.feed(c)
    p.flush()


def run_parse_markers(chunks: list[bytes]) -> None:
    p = SSEParser(track_starts=True)
    n = 0
    for c in chunks:
        p.feed(c)
        if p.starts:
            parts, prev = [], 0
            for s in p.starts:
                parts += (c[prev:s], b": x-chunk-id=%d x-sent-at-us=%d\n" % (n, time.time_ns() // 1000))
                n += 1
                prev = s
            parts.append(c[prev:])
            b"".join(parts)


def make_run_observer(markers: bool) -> Callable[[list[bytes]], None]:
    options = ObserverOptions(markers=markers)
    stats = EndpointStreamStats()

    def run(chunks: list[bytes]) -> None:
        t = time.monotonic_ns()
        obs = StreamObserver(endpoint="10.0.0.1:8000", model=MODEL, request_start_ns=t, stats=stats, options=options, route_weight=0.5)
        obs.on_response_headers(200, "text/event-stream", None, t)
        last = len(chunks) - 1
        for i, c in enumerate(chunks):
            obs.on_body_chunk(c, i == last, time.monotonic_ns())
        obs.on_end("complete")

    return run


def measure(variants: dict[str, Callable[[list[bytes]], None]], chunks: list[bytes], repeat: int) -> dict[str, list[float]]:
    """Microseconds per chunk of each run, variants interleaved run by run (so load from other
    processes hits them alike)."""
    per_chunk: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            t0 = time.perf_counter_ns()
            fn(chunks)
            per_chunk[name].append((time.perf_counter_ns() - t0) / 1e3 / len(chunks))
    return per_chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="output tokens (one content event each)")
    ap.add_argument("--repeat", type=int, default=200, help="runs of the whole stream per variant")
    ap.add_argument("--events-per-chunk", type=int, default=1, help="SSE events per body chunk")
    args = ap.parse_args()
    chunks = build_stream(args.tokens, args.events_per_chunk)
    size = sum(map(len, chunks))
    print(f"stream: {args.tokens} tokens, {len(chunks)} chunks, {size} bytes ({size / len(chunks):.0f} B/chunk)")
    variants = {
        "parse": run_parse,
        "parse+markers": run_parse_markers,
        "observe": make_run_observer(False),
        "observe+markers": make_run_observer(True),
    }
    for fn in variants.values():  # warm up
        fn(chunks)
    print(f"{'variant':<16} {'median µs/chunk':>16} {'best µs/chunk':>14}")
    for name, runs in measure(variants, chunks, args.repeat).items():
        print(f"{name:<16} {statistics.median(runs):>16.2f} {min(runs):>14.2f}")


if __name__ == "__main__":
    main()
