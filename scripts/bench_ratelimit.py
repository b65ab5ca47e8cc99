#!/usr/bin/env python3
"""What rate limiting costs, and what it buys, side by side in one run.

    micro   the limiter's cost per decision (µs, p50/p99) for the memory and Redis backends
            (acquire, and acquire + settle), and the ext_proc decision latency (headers + body
            over a real gRPC channel to an in-process server, sequential) with rate limiting
            off / memory / Redis. Redis is a real redis-server on 127.0.0.1 (Debian package).
    fleet   a two-tenant run on the simulated fleet (4 engines) behind Envoy and
            `llm-extproc serve`: tenant "steady" sends streamed chats at a fixed rate; first alone,
            then while tenant "flood" (its own process) runs 48 concurrent long requests with no
            limit; with a token limit only (retrying refusals every 0.2 s); refused outright
            (1 request per minute: what refusing costs the gateway host alone); with the same limit
            paced (`burst_tokens`) and a concurrency cap (`max_concurrent_requests`), retrying
            every 0.2 s, then honouring retry-after; then steady alone again (the solo figure's
            run-to-run spread). Reports steady's TTFT (p50/p99) in each phase and the ratio to
            its first solo figure (target: within 10 %), and flood's admitted / refused counts.
            Run under `flock /tmp/bench.lock` (it starts a fleet and Envoy).

    .venv/bin/python scripts/bench_ratelimit.py micro [--decisions 5000] [--requests 1000]
    flock /tmp/bench.lock .venv/bin/python scripts/bench_ratelimit.py fleet [--phase-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import orjson
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry

from extproc.bench.stacks import server_config
from extproc.config.loader import config_from_mapping
from extproc.pipeline.request import ModelRuntime
from extproc.pipeline.tokens import TokenCounter
from extproc.metrics import Metrics
from extproc.ratelimit.config import RateLimitConfig, RedisConfig
from extproc.ratelimit.limiter import RateLimiter
from extproc.ratelimit.memory import MemoryBackend
from extproc.ratelimit.metrics import RateLimitMetrics
from extproc.ratelimit.redis_backend import RedisBackend
from extproc.ratelimit.window import ScopeLimit
from extproc.server.app import ExtProcApp
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.fleet import DEFAULT_FLEET, Fleet
from extproc.stack.redis import RedisProcess
from extproc.stack.server import ExtProcServerProcess
from extproc.types import LLMRequest, RequestKind, TokenCount

MODEL = "Qwen/Qwen3-8B"


def _cpu_s(pids: list[int | None]) -> float:
    """CPU seconds (user + system) the processes have used so far, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        if pid is None:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
    return total


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _row(name: str, xs_s: list[float]) -> str:
    return f"| {name} | {_pct(xs_s, 0.5) * 1e6:.1f} | {_pct(xs_s, 0.99) * 1e6:.1f} |"


# -- micro -------------------------------------------------------------------------------------


async def _backend_costs(backend, n: int, controls: bool = False) -> tuple[list[float], list[float]]:
    """acquire, and acquire + settle; `controls`: the scope also has a concurrency cap and pacing
    (decision 0190), so each decision registers and releases an in-flight entry."""
    key = "{bench-cc}" if controls else "{bench}"
    extra = {"concurrent": 10**9, "burst": 10**12} if controls else {}
    scopes = [ScopeLimit(key, tokens=10**12, requests=10**9, **extra)]
    acq, both = [], []
    for i in range(200):  # warm-up (connection, script load)
        d = await backend.acquire(scopes, 100, request_id=f"w{i}")
        await backend.settle([key], d.bucket, 0, request_id=f"w{i}")
    for i in range(n):
        t0 = time.perf_counter()
        d = await backend.acquire(scopes, 100, request_id=f"r{i}")
        t1 = time.perf_counter()
        await backend.settle([key], d.bucket, -50, request_id=f"r{i}")
        t2 = time.perf_counter()
        acq.append(t1 - t0)
        both.append(t2 - t0)
    return acq, both


async def _limiter_path(backend, n: int) -> list[float]:
    """Everything the server adds per request: tenant (hash), precheck, admit (metrics,
    headers), settle."""
    config = RateLimitConfig(enabled=True, default={"tokens_per_minute": 10**12, "requests_per_minute": 10**9})
    lim = RateLimiter(config, backend, RateLimitMetrics(Metrics(CollectorRegistry())), {MODEL: (512, 8192)})
    req = LLMRequest(kind=RequestKind.CHAT, model=MODEL, served_model=MODEL, prompt_tokens=TokenCount(100), max_tokens=16)
    out = []
    for i in range(n + 200):
        t0 = time.perf_counter()
        tenant = lim.tenant({"authorization": f"Bearer sk-{i % 10}"})
        await lim.precheck(tenant, MODEL, 16, 1, 300)
        adm = await lim.admit(tenant, req)
        lim.settle(adm, 110)
        if i >= 200:
            out.append(time.perf_counter() - t0)
    await lim.aclose()
    return out


def _headers(auth: bytes) -> pb.ProcessingRequest:
    hdrs = {":method": b"POST", ":path": b"/v1/chat/completions", "authorization": auth}
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in hdrs.items()]))
    )


async def _decision_latency(ratelimit: dict | None, n: int, counter: TokenCounter) -> list[float]:
    raw = {
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "models": [{"name": MODEL, "max_model_len": 8192}],
        "endpoints": [{"address": "127.0.0.1:18001", "models": [MODEL]}, {"address": "127.0.0.1:18002", "models": [MODEL]}],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}},
        "telemetry": {"enabled": False},
    }
    if ratelimit:
        raw["ratelimit"] = ratelimit
    cfg = config_from_mapping(raw)
    app = ExtProcApp(cfg, registry=CollectorRegistry(), models={MODEL: ModelRuntime(cfg.models[0], counter)})
    await app.start()
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
            stub = pb_grpc.ExternalProcessorStub(ch)
            body = pb.ProcessingRequest(
                request_body=pb.HttpBody(
                    body=orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}),
                    end_of_stream=True,
                )
            )
            for i in range(n + 100):
                call = stub.Process()
                t0 = time.perf_counter()
                await call.write(_headers(f"Bearer sk-{i % 10}".encode()))
                await call.read()
                await call.write(body)
                reply = await call.read()
                t1 = time.perf_counter()
                assert reply.WhichOneof("response") == "request_body", reply
                await call.done_writing()
                await call.read()
                if i >= 100:
                    out.append(t1 - t0)
    finally:
        await app.aclose(grace_s=0)
    return out


async def micro(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        redis = RedisProcess(workdir=Path(tmp) / "redis")
        await redis.start()
        try:
            mem_acq, mem_both = await _backend_costs(MemoryBackend(60), args.decisions)
            rb = RedisBackend(RedisConfig(url=redis.url, key_prefix="bench:", timeout_ms=200), 60)
            red_acq, red_both = await _backend_costs(rb, args.decisions)
            mem_cc = await _backend_costs(MemoryBackend(60), args.decisions, controls=True)
            red_cc = await _backend_costs(rb, args.decisions, controls=True)
            await rb.aclose()
            mem_path = await _limiter_path(MemoryBackend(60), args.decisions)
            red_path = await _limiter_path(RedisBackend(RedisConfig(url=redis.url, key_prefix="bench2:", timeout_ms=200), 60), args.decisions)
            print(f"## limiter cost per decision ({args.decisions} decisions, one scope)\n")
            print("| backend, call | p50 µs | p99 µs |\n|---|---|---|")
            for name, xs in (("memory acquire", mem_acq), ("memory acquire + settle", mem_both),
                             ("memory, whole path (tenant, precheck, admit, settle)", mem_path),
                             ("redis acquire", red_acq), ("redis acquire + settle", red_both),
                             ("redis, whole path (settle in a task, not awaited)", red_path),
                             ("memory acquire, with cap + pacing", mem_cc[0]), ("memory acquire + settle, with cap + pacing", mem_cc[1]),
                             ("redis acquire, with cap + pacing", red_cc[0]), ("redis acquire + settle, with cap + pacing", red_cc[1])):
                print(_row(name, xs))
            counter = TokenCounter.from_source("builtin:qwen3")
            limited = {"enabled": True, "default": {"tokens_per_minute": 10**12, "requests_per_minute": 10**9}}
            runs = {
                "off": await _decision_latency(None, args.requests, counter),
                "memory": await _decision_latency(limited, args.requests, counter),
                "redis": await _decision_latency({**limited, "backend": "redis", "redis": {"url": redis.url}}, args.requests, counter),
            }
            print(f"\n## ext_proc decision latency (headers + body round trips, {args.requests} sequential requests)\n")
            print("| rate limiting | p50 µs | p99 µs | added p50 µs |\n|---|---|---|---|")
            base = _pct(runs["off"], 0.5)
            for name, xs in runs.items():
                print(f"{_row(name, xs)[:-1]}| {(_pct(xs, 0.5) - base) * 1e6:+.1f} |")
        finally:
            await redis.stop()


# -- fleet -------------------------------------------------------------------------------------

STEADY_KEY, FLOOD_KEY, FLOOD_LIMITED_KEY = "sk-steady-bench", "sk-flood-bench", "sk-flood-limited-bench"
FLOOD_PACED_KEY, FLOOD_REFUSED_KEY = "sk-flood-paced-bench", "sk-flood-refused-bench"


async def _steady(client: httpx.AsyncClient, rate: float, duration_s: float, rng: random.Random) -> list[float]:
    ttfts: list[float] = []

    async def one() -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 64,
                "messages": [{"role": "user", "content": f"{rng.random()} Summarise the plot of a short story in a few lines."}]}
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {STEADY_KEY}"}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    ttfts.append(time.perf_counter() - t0)
                    break
            async for _ in r.aiter_bytes():
                pass

    tasks = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks, return_exceptions=True)
    return ttfts


async def flood_main(args: argparse.Namespace) -> None:
    """The flooding tenant, in its own process (its event loop must not delay the steady
    client's clock): `concurrency` workers for `duration_s`, then its answer counts as JSON."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    counts: dict[str, int] = {}
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits, trust_env=False) as client:
        task = asyncio.create_task(_flood(client, args.key, stop, counts, args.concurrency, args.honor_retry_after))
        await asyncio.sleep(args.duration_s)
        stop.set()
        await task
    counts["cpu_s"] = round(time.process_time(), 1)  # type: ignore[assignment]
    print(orjson.dumps(counts).decode(), flush=True)


async def _flood(client: httpx.AsyncClient, key: str, stop: asyncio.Event, counts: dict[str, int], concurrency: int, honor: bool) -> None:
    prompt = "Review this long design document carefully. " * 300  # ~2.7k tokens

    async def worker(i: int) -> None:
        while not stop.is_set():
            body = {"model": MODEL, "max_tokens": 512, "messages": [{"role": "user", "content": f"{i} {time.time()} {prompt}"}]}
            try:
                r = await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
            except httpx.HTTPError:
                counts["error"] = counts.get("error", 0) + 1
                continue
            counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1
            if r.status_code == 429:  # retry-after honoured, or a fast retry that ignores it
                delay = float(r.headers.get("retry-after", "1")) if honor else 0.2
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass

    await asyncio.gather(*(worker(i) for i in range(concurrency)))


async def fleet(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-rl-fleet-") as tmp:
        work = Path(tmp)
        sims = Fleet(DEFAULT_FLEET, workdir=work, speed=1.0, stream_interval=1)
        await sims.start()
        server = envoy = None
        try:
            cfg = server_config(sims.profiles, profile="load-aware")
            def digest(key: str) -> str:
                return hashlib.sha256(key.encode()).hexdigest()

            cfg["ratelimit"] = {
                "enabled": True,
                # steady and the unlimited flood: each a tenant of its own, with no limit
                "unknown_api_keys": "per_key",
                "tenants": {
                    "flood-limited": {"api_key_sha256": [digest(FLOOD_LIMITED_KEY)], "tokens_per_minute": args.flood_tpm},
                    # one request a minute: every other one refused, so the phase measures only
                    # what refusing a flood costs the gateway host (no engine work)
                    "flood-refused": {"api_key_sha256": [digest(FLOOD_REFUSED_KEY)], "requests_per_minute": 1},
                    "flood-paced": {
                        "api_key_sha256": [digest(FLOOD_PACED_KEY)],
                        "tokens_per_minute": args.flood_tpm,
                        "burst_tokens": args.flood_burst,
                        "max_concurrent_requests": args.flood_concurrent,
                    },
                },
            }
            path = work / "server.yaml"
            path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
            server = ExtProcServerProcess(path, workdir=work)
            await server.start()
            host_ports = [tuple(a.rsplit(":", 1)) for a in sims.addresses]
            ecfg = rewrite_config(load_envoy_config("fail-open"), RunSettings(extproc=server.grpc_address, endpoints=[(h, int(p)) for h, p in host_ports]))
            envoy = EnvoyProcess(ecfg, workdir=work, name="envoy")
            await envoy.start()
            rng = random.Random(1)
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
            results: dict[str, tuple[list[float], dict[str, int], float]] = {}
            async with httpx.AsyncClient(base_url=envoy.url, timeout=600, limits=limits, trust_env=False) as client:
                await _steady(client, args.rate, 5, rng)  # warm-up
                paced = f"{args.flood_tpm} TPM paced (burst {args.flood_burst}), at most {args.flood_concurrent} in flight"
                phases = (
                    ("solo", None, False),
                    ("flood, no limit", FLOOD_KEY, False),
                    (f"flood, {args.flood_tpm} TPM window only, retries every 0.2 s", FLOOD_LIMITED_KEY, False),
                    ("flood refused (1 RPM: no engine work), retries every 0.2 s", FLOOD_REFUSED_KEY, False),
                    (f"flood, {paced}, retries every 0.2 s", FLOOD_PACED_KEY, False),
                    (f"flood, {paced}, honours retry-after", FLOOD_PACED_KEY, True),
                    ("solo again", None, False),
                )
                cpu: dict[str, dict[str, float]] = {}
                for phase, key, honor in phases:
                    await asyncio.sleep(args.cool_s)
                    flood = None
                    cpu0 = {"envoy": _cpu_s([envoy.pid]), "server": _cpu_s([server.pid]), "fleet": _cpu_s(list(sims.pids)), "steady": time.process_time()}
                    if key:
                        argv = [sys.executable, __file__, "flood", "--url", envoy.url, "--key", key,
                                "--concurrency", str(args.concurrency), "--duration-s", str(args.phase_s + 5)]
                        flood = await asyncio.create_subprocess_exec(*argv + (["--honor-retry-after"] if honor else []), stdout=asyncio.subprocess.PIPE)
                        await asyncio.sleep(5)  # the flood reaches its steady state
                    ttfts = await _steady(client, args.rate, args.phase_s, rng)
                    counts = {}
                    if flood:
                        out, _ = await flood.communicate()
                        counts = orjson.loads(out.strip().splitlines()[-1])
                    cpu1 = {"envoy": _cpu_s([envoy.pid]), "server": _cpu_s([server.pid]), "fleet": _cpu_s(list(sims.pids)), "steady": time.process_time()}
                    cpu[phase] = {k: cpu1[k] - cpu0[k] for k in cpu0} | {"flood client": counts.pop("cpu_s", 0.0)}
                    load = os.getloadavg()[0]
                    results[phase] = (ttfts, counts, load)
                    print(f"{phase}: {len(ttfts)} steady requests, flood {counts}, load average (1 min) {load:.2f}", flush=True)
            solo50, solo99 = _pct(results["solo"][0], 0.5), _pct(results["solo"][0], 0.99)
            print(f"\n## steady tenant's TTFT ({args.rate}/s, {args.phase_s:.0f} s per phase; flood: {args.concurrency} concurrent ~2.7k-token prompts, max_tokens 512)\n")
            print("| phase | steady requests | TTFT p50 s | TTFT p99 s | p50 / solo | p99 / solo | mean s | flood answers | load 1 min |")
            print("|---|---|---|---|---|---|---|---|---|")
            for phase, (xs, counts, load) in results.items():
                p50, p99 = _pct(xs, 0.5), _pct(xs, 0.99)
                row = f"| {phase} | {len(xs)} | {p50:.3f} | {p99:.3f} | {p50 / solo50:.2f} | {p99 / solo99:.2f} | {statistics.mean(xs):.3f}"
                print(f"{row} | {counts or '-'} | {load:.2f} |")
            print(f"\n## CPU seconds per phase (the phase and the flood's 5 s lead; 2 cores = {2 * (args.phase_s + 5):.0f} CPU s)\n")
            print("| phase | flood client | Envoy | server | fleet (simulators) | steady client |\n|---|---|---|---|---|---|")
            for phase, c in cpu.items():
                print(f"| {phase} | {c['flood client']:.1f} | {c['envoy']:.1f} | {c['server']:.1f} | {c['fleet']:.1f} | {c['steady']:.1f} |")
        finally:
            if envoy is not None:
                await envoy.aclose()
            if server is not None:
                await server.aclose()
            await sims.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("micro")
    m.add_argument("--decisions", type=int, default=5000)
    m.add_argument("--requests", type=int, default=1000)
    f = sub.add_parser("fleet")
    f.add_argument("--phase-s", type=float, default=30.0)
    f.add_argument("--cool-s", type=float, default=10.0)
    f.add_argument("--rate", type=float, default=4.0, help="steady tenant's requests per second")
    f.add_argument("--concurrency", type=int, default=48, help="flood tenant's concurrent requests")
    f.add_argument("--flood-tpm", type=int, default=60_000, help="flood tenant's tokens per minute in the limited phases")
    f.add_argument("--flood-burst", type=int, default=8_000, help="flood tenant's burst_tokens in the paced phases")
    f.add_argument("--flood-concurrent", type=int, default=2, help="flood tenant's max_concurrent_requests in the paced phases")
    fl = sub.add_parser("flood", help="(internal) the flooding tenant's process")
    fl.add_argument("--url", required=True)
    fl.add_argument("--key", required=True)
    fl.add_argument("--concurrency", type=int, default=48)
    fl.add_argument("--duration-s", type=float, required=True)
    fl.add_argument("--honor-retry-after", action="store_true")
    args = ap.parse_args()
    asyncio.run({"micro": micro, "fleet": fleet, "flood": flood_main}[args.cmd](args))


if __name__ == "__main__":
    main()
