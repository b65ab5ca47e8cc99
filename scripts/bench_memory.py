#!/usr/bin/env python3
"""Where a server's memory levels off: RSS against unique prompts, until it stops growing.

A real `llm-extproc serve` child (Qwen3 tokenizer, four endpoints that are never contacted: no
health checks, no scrapes) is sent generation requests over gRPC as Envoy sends them (request
headers, BUFFERED body, response headers), every prompt unique: a unique system prompt and user
message of `--words` words each, so every request adds new segments to the token cache and new
blocks to the prefix index. Every `--step` requests the child's RSS (`/proc/PID/status`) is
read and a row printed; the run stops once `--flat-steps` steps in a row each grew less than
`--flat-mb` MB per 1,000 requests (it levelled: the bounds hold), or after `--max-requests`.

The bounds that matter: the token segment cache (`limits.token_cache_bytes`), the prefix index
(`prefix.max_index_bytes`, and per endpoint its `default_capacity_blocks` until an engine
reports its pool). `--token-cache-mb` / `--prefix-index-mb` set them, to see the curve level
sooner or move.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_memory.py [--words 400] [--step 2000]
        [--max-requests 40000] [--concurrency 16] [--token-cache-mb N] [--prefix-index-mb N]
    Before / after: the same with `PYTHONPATH=<other tree>` first (its server runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.stack.server import ExtProcServerProcess

MODEL = "Qwen/Qwen3-8B"
WORDS = ["time", "data", "model", "light", "river", "stone", "green", "paper", "music", "field", "cloud", "metal"]


def rss_mb(pid: int) -> float:
    """Resident set size of `pid` (MB), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _headers(pairs: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def messages(i: int, words: int) -> list[pb.ProcessingRequest]:
    """One request's three ext_proc messages; its prompts are unique to `i`."""
    text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] + str((i * 31 + j) % 997) for j in range(words))
    body = json.dumps({
        "model": MODEL, "max_tokens": 16,
        "messages": [{"role": "system", "content": f"policy {i}: {text}"}, {"role": "user", "content": f"question {i}: {text[::-1]}"}],
    }).encode()  # fmt: skip
    buffered = pb.ProtocolConfiguration(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED)
    request = {":path": "/v1/chat/completions", ":method": "POST", ":authority": "bench", "x-request-id": f"{i:032x}"}
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(request)), protocol_config=buffered),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers({":status": "200", "content-type": "application/json"}))),
    ]


async def one(stub: pb_grpc.ExternalProcessorStub, i: int, words: int) -> None:
    call = stub.Process()
    for m in messages(i, words):
        await call.write(m)
        await call.read()
    await call.done_writing()
    await call.read()


def config(args: argparse.Namespace) -> dict:
    """The server's config; a bound left unset keeps the server's default (so a tree from
    before `limits.token_cache_bytes` runs as it is: `PYTHONPATH=<old tree>`)."""
    out: dict = {
        "models": [{"name": MODEL, "max_model_len": 40960}],
        "endpoints": [{"address": f"127.0.0.{i}:9", "models": [MODEL]} for i in range(1, 5)],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}},
    }
    if args.token_cache_mb is not None:
        out["limits"] = {"token_cache_bytes": args.token_cache_mb << 20}
    if args.prefix_index_mb is not None:
        out["prefix"] = {"max_index_bytes": args.prefix_index_mb << 20}
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, default=400, help="words of each unique system prompt and user message")
    ap.add_argument("--step", type=int, default=2000, help="requests between two RSS readings")
    ap.add_argument("--max-requests", type=int, default=40000)
    ap.add_argument("--concurrency", type=int, default=16, help="streams in flight")
    ap.add_argument("--flat-steps", type=int, default=3, help="steps in a row under --flat-mb that end the run")
    ap.add_argument("--flat-mb", type=float, default=0.5, help="growth per 1,000 requests that counts as level (MB)")
    ap.add_argument("--token-cache-mb", type=int, default=None, help="limits.token_cache_bytes in MB (default: the server's)")
    ap.add_argument("--prefix-index-mb", type=int, default=None, help="prefix.max_index_bytes in MB (default: the server's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        work = Path(tmp)
        (work / "config.yaml").write_text(yaml.safe_dump(config(args)))
        server = ExtProcServerProcess(work / "config.yaml", workdir=work, log_level="warning")
        await server.start()
        try:
            pid = server.pid
            assert pid is not None
            caches = f"token cache {args.token_cache_mb or 'default'} MB, prefix index {args.prefix_index_mb or 'default'} MB"
            print(f"words {args.words} x2 per prompt, {caches}", flush=True)
            print(f"{'requests':>9} {'RSS MB':>8} {'MB / 1k':>8} {'req/s':>7}")
            base = rss_mb(pid)
            print(f"{0:>9} {base:>8.1f}")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                stub = pb_grpc.ExternalProcessorStub(channel)
                sent, flat, last = 0, 0, base
                while sent < args.max_requests and flat < args.flat_steps:
                    t0 = time.perf_counter()
                    queue = iter(range(sent, sent + args.step))

                    async def worker() -> None:
                        for i in queue:
                            await one(stub, i, args.words)

                    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
                    sent += args.step
                    now = rss_mb(pid)
                    per_k = (now - last) * 1000 / args.step
                    flat = flat + 1 if per_k < args.flat_mb else 0
                    print(f"{sent:>9} {now:>8.1f} {per_k:>8.2f} {args.step / (time.perf_counter() - t0):>7.0f}", flush=True)
                    last = now
            verdict = "levelled" if flat >= args.flat_steps else "still growing at --max-requests"
            print(f"{verdict}: {last:.1f} MB after {sent} requests ({last - base:+.1f} MB from the start)")
            async with httpx.AsyncClient(trust_env=False, timeout=10) as admin:
                metrics = (await admin.get(f"{server.admin_url}/metrics")).text
            estimated = sum(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines() if x.startswith("llm_extproc_tokenizer_estimates_total{"))
            print(f"routed on a character estimate (not tokenized, nothing cached): {estimated:.0f} of {sent}")
        finally:
            await server.aclose()


if __name__ == "__main__":
    asyncio.run(main())
