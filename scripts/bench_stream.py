#!/usr/bin/env python3
"""Inter-token latency that llm-extproc's response telemetry adds to streamed generations.

One simulated H100 + Qwen3-8B engine (`llm-extproc sim`, its own process, real time) streams
512-token responses (one token per SSE event) to clients at a fixed concurrency, through, side
by side in one run:

  envoy-alone         the fail-open config with the ext_proc filter removed
  extproc-headers     Envoy + llm-extproc with telemetry off (response headers only)
  extproc-telemetry   Envoy + llm-extproc with telemetry on: every SSE chunk crosses the server
  epp-headers         (--epp) Envoy configured as the Endpoint Picker Protocol's gateways do
                      (FULL_DUPLEX_STREAMED, `extproc.stack.epp_envoy`) + llm-extproc in
                      `protocol.mode: epp` with telemetry off: no mode override can stop the
                      response body, so every chunk still crosses the server, unobserved
  epp-telemetry       (--epp) the same with telemetry on

Reports per setup the client-observed inter-chunk gap (mean, p50, p99; milliseconds), TTFT
p50 and E2E p50, and the server's CPU seconds per streamed chunk.

    .venv/bin/python scripts/bench_stream.py [--concurrency 1,8] [--requests 16] [--tokens 512] [--epp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import without_access_log, without_ext_proc  # noqa: E402

from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config  # noqa: E402
from extproc.stack.epp_envoy import gateway_config  # noqa: E402
from extproc.stack.fleet import SimProcess  # noqa: E402
from extproc.stack.server import ExtProcServerProcess  # noqa: E402

MODEL = "Qwen/Qwen3-8B"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[float, float, list[float]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write at length."}], "max_tokens": tokens, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in r.aiter_bytes():
            if b'"content"' in chunk:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - t0, time.perf_counter() - t0, gaps


async def measure(url: str, concurrency: int, requests: int, tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(trust_env=False, timeout=120, limits=httpx.Limits(max_connections=concurrency * 2)) as client:

        async def run():
            async with sem:
                return await one(client, url, tokens)

        results = await asyncio.gather(*(run() for _ in range(requests)))
    gaps = sorted(g for _, _, gs in results for g in gs)
    return {
        "gap_mean_ms": statistics.fmean(gaps) * 1e3,
        "gap_p50_ms": gaps[len(gaps) // 2] * 1e3,
        "gap_p99_ms": gaps[int(len(gaps) * 0.99)] * 1e3,
        "ttft_p50_ms": statistics.median(r[0] for r in results) * 1e3,
        "e2e_p50_ms": statistics.median(r[1] for r in results) * 1e3,
        "chunks": len(gaps) + len(results),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--epp", action="store_true", help="add the Endpoint Picker Protocol setups")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    sim = SimProcess("h100-qwen3-8b", name="sim", workdir=work)
    await sim.start()
    servers: dict[str, ExtProcServerProcess] = {}
    envoys: dict[str, EnvoyProcess] = {}
    try:
        base = without_access_log(load_envoy_config("fail-open"))
        endpoint = [("127.0.0.1", sim.port)]
        envoys["envoy-alone"] = EnvoyProcess(rewrite_config(without_ext_proc(base), RunSettings(endpoints=endpoint)), workdir=work, name="alone", concurrency=1)
        setups = [("extproc-headers", False, "buffered"), ("extproc-telemetry", True, "buffered")]
        if args.epp:
            setups += [("epp-headers", False, "epp"), ("epp-telemetry", True, "epp")]
        for name, telemetry, protocol in setups:
            cfg = work / f"{name}.yaml"
            cfg.write_text(yaml.safe_dump({
                "models": [{"name": MODEL}],
                "endpoints": [{"address": sim.address, "models": [MODEL]}],
                "telemetry": {"enabled": telemetry, "sample_rate": 1.0},
                "protocol": {"mode": protocol},
            }))
            servers[name] = ExtProcServerProcess(cfg, workdir=work, name=name, log_level="warning")
            await servers[name].start()
            if protocol == "epp":
                envoy_cfg = gateway_config(servers[name].grpc_port)
            else:
                envoy_cfg = rewrite_config(base, RunSettings(extproc=servers[name].grpc_address, endpoints=endpoint))
            envoys[name] = EnvoyProcess(envoy_cfg, workdir=work, name=name, concurrency=1)
        for e in envoys.values():
            await e.start()
        rows = []
        for conc in [int(c) for c in args.concurrency.split(",")]:
            for name, envoy in envoys.items():
                server = servers.get(name)
                cpu0 = cpu_seconds(server.process.pid) if server else 0.0
                r = await measure(envoy.url, conc, args.requests, args.tokens)
                r["server_us_per_chunk"] = (cpu_seconds(server.process.pid) - cpu0) / r["chunks"] * 1e6 if server else None
                rows.append((conc, name, r))
                print(conc, name, {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    finally:
        for e in envoys.values():
            await e.aclose()
        for s in servers.values():
            await s.aclose()
        await sim.aclose()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.requests} requests × {args.tokens} tokens per cell, one token per SSE event, h100-qwen3-8b simulator at real time")
    print("| concurrency | setup | gap mean / p50 / p99 (ms) | added mean gap (ms) | TTFT p50 (ms) | E2E p50 (ms) | server CPU µs/chunk |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    base_gap = {c: r["gap_mean_ms"] for c, n, r in rows if n == "envoy-alone"}
    for conc, name, r in rows:
        cpu = "—" if r["server_us_per_chunk"] is None else f"{r['server_us_per_chunk']:.0f}"
        print(f"| {conc} | {name} | {r['gap_mean_ms']:.2f} / {r['gap_p50_ms']:.2f} / {r['gap_p99_ms']:.2f} | {r['gap_mean_ms'] - base_gap[conc]:+.2f} | {r['ttft_p50_ms']:.1f} | {r['e2e_p50_ms']:.0f} | {cpu} |")


if __name__ == "__main__":
    asyncio.run(main())
