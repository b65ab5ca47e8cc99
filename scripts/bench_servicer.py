#!/usr/bin/env python3
"""The servicer's own Python cost per request, in process: no gRPC, no Envoy, no other process.

`ExtProcServicer.Process` is driven directly with the messages Envoy sends for one generation
request (request headers as `wrk` through the fail-open gateway sends them, the BUFFERED body,
the response headers of a 200), each parsed from its wire bytes, and every reply serialized, as
gRPC would. The server is `ExtProcApp` with the `bench_overhead.py` config (Qwen3, one endpoint,
the default load-aware profile and telemetry: one response in ten observed, whose body never
comes here), minus the endpoint probes and scrapes (the endpoint is not listening). Every prompt is
unique, as in `bench_overhead.py`.

What it shows is the part of `bench_overhead.py`'s "server CPU per request" that this project's
Python code costs (parse, count, schedule, reserve, reply building, metrics), without the gRPC
and event-loop cost of the messages and with much less noise: CPU time per request (best of
`--rounds` rounds, after a warm-up that fills the prefix index to its steady state).

Before / after: run it with another tree first on the path, e.g.
`PYTHONPATH=/tmp/base .venv/bin/python scripts/bench_servicer.py`.

    .venv/bin/python scripts/bench_servicer.py [--tokens 100] [--requests 2000] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import time

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from extproc.config.loader import config_from_mapping
from extproc.pipeline.request import ModelRuntime
from extproc.pipeline.tokens import TokenCounter
from extproc.server.app import ExtProcApp

MODEL = "Qwen/Qwen3-8B"
REQUEST_HEADERS = {
    ":authority": "127.0.0.1:10000", ":path": "/v1/chat/completions", ":method": "POST", ":scheme": "http",
    "user-agent": "wrk", "content-type": "application/json", "content-length": "700", "x-forwarded-proto": "http",
    "x-envoy-expected-rq-timeout-ms": "300000",
}  # fmt: skip
RESPONSE_HEADERS = {
    ":status": "200", "content-type": "application/json", "content-length": "250", "date": "Wed, 02 Dec 2026 06:00:00 GMT",
    "server": "envoy", "x-envoy-upstream-service-time": "0",
}  # fmt: skip
WORDS = ["time", "data", "model", "light", "river", "stone", "green", "paper", "music", "field"]


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def request_messages(i: int, content: str) -> list[bytes]:
    """The wire bytes of one generation request's three ext_proc messages (prompt made unique by `i`)."""
    body = json.dumps({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": f"req {i} {content}"}]}).encode()
    buffered = pb.ProtocolConfiguration(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED)
    headers = header_map({**REQUEST_HEADERS, "x-request-id": f"{i:032x}"})
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers), protocol_config=buffered).SerializeToString(),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString(),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(RESPONSE_HEADERS))).SerializeToString(),
    ]


class _Context:
    """The one `ServicerContext` call a well-formed stream never makes."""

    async def abort(self, code, details):  # pragma: no cover - only on a malformed stream
        raise RuntimeError(f"stream aborted: {code} {details}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100, help="prompt words (~tokens) per request")
    ap.add_argument("--requests", type=int, default=2000, help="requests per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the best one is reported")
    ap.add_argument("--profile", action="store_true", help="one more round under cProfile, top functions by own time")
    args = ap.parse_args()
    cfg = config_from_mapping({
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "models": [{"name": MODEL, "max_model_len": 40960}],
        "endpoints": [{"address": "127.0.0.1:9", "models": [MODEL]}],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}},
    })  # fmt: skip
    counter = TokenCounter.from_source("builtin:qwen3")
    app = ExtProcApp(cfg, registry=CollectorRegistry(), models={m.name: ModelRuntime(m, counter) for m in cfg.models})
    await app.start()
    servicer, context = app.servicer, _Context()
    content = " ".join(WORDS[i % len(WORDS)] for i in range(args.tokens))

    async def one(raw: list[bytes]) -> None:
        async def incoming():
            for r in raw:
                yield pb.ProcessingRequest.FromString(r)

        async for reply in servicer.Process(incoming(), context):
            reply.SerializeToString()

    async def run(first: int, n: int) -> float:
        """CPU seconds per request over `n` requests numbered from `first`."""
        raws = [request_messages(first + i, content) for i in range(n)]
        c0 = time.process_time()
        for raw in raws:
            await one(raw)
        return (time.process_time() - c0) / n

    try:
        await run(0, max(500, args.requests // 4))  # warm-up: caches, prefix index at its bound
        best = min([await run((r + 1) * 1_000_000, args.requests) for r in range(args.rounds)])
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            await run(99_000_000, args.requests)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        print(f"{args.tokens} words, {args.requests} requests x {args.rounds} rounds: {best * 1e6:.1f} µs of CPU per request (best round)")
    finally:
        await app.aclose(grace_s=0)


if __name__ == "__main__":
    asyncio.run(main())
