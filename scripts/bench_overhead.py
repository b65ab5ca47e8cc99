#!/usr/bin/env python3
"""What llm-extproc adds to a request, against Envoy alone, side by side in one run.

For 100-, 1k- and 8k-token chat prompts (every request's prompt is unique, so the token cache
cannot help: the worst case), at a fixed concurrency, through:

  envoy-alone      the same Envoy config with the ext_proc filter removed (least-request
                   fallback cluster over the same backend)
  passthrough      the shipped envoy/fail-open.yaml with a bare Python `grpc.aio` ext_proc
                   server that decides nothing: it continues the request headers and answers
                   the body with a fixed destination header (two messages per request, the
                   floor any Python ext_proc server starts from)
  envoy+extproc    the shipped envoy/fail-open.yaml with `llm-extproc serve` deciding

The backend is a second Envoy answering a fixed chat completion after buffering the request
body (C++, effectively instant), so what is measured is the gateway, not the backend. Load
comes from `wrk` (Debian package `wrk`), a C load generator that stays off the Python path.

The token cache's effect shows in a fourth case: an 8k-token shared context (a long document or
chat history every request resends) with a unique 20-token question.

Before / after in one run: `--baseline TREE` runs a second `llm-extproc serve` from another
source tree (e.g. `git worktree add /tmp/base main`, or `git archive`), behind its own gateway,
in the same loop; the tables then show both servers' CPU per request and tokenize phase.

The flood (`--flood`): 200 KB unique prompts (`--flood-chars`) at concurrency 150
(`--flood-concurrency`), sent straight to each server's gRPC port (the decision alone: request
headers, then the body; the stream is cancelled once the body is answered) for
`--flood-duration` seconds: decisions per second, p50/p99 decision latency (body sent → body
answered) and the share routed on the character estimate. After each flood the script waits
for the server to go idle (its abandoned counts finish) before the next.

Reports per prompt size: p50/p99 latency and requests/s of each, the added p50/p99, the
throughput ratios to Envoy alone, each ext_proc server's CPU time per request (from /proc, over
the measurement), the server's decision cost split (parse / tokenize / pick, mean from its
Prometheus histogram), and the server's resident memory before and after each of two rounds of 10,000 requests.

    .venv/bin/python scripts/bench_overhead.py [--duration 10] [--concurrency 8] [--baseline TREE] [--flood]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.ports import free_port
from extproc.stack.server import ExtProcServerProcess

MODEL = "Qwen/Qwen3-8B"
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)


def backend_config(port: int) -> dict:
    """An Envoy that buffers the request body, then answers COMPLETION (the 'instant engine')."""
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "backend",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "per_connection_buffer_limit_bytes": 8 * 1024 * 1024,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "backend",
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.buffer",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                                                    "max_request_bytes": 8 * 1024 * 1024,
                                                },
                                            },
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                                            },
                                        ],
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "direct_response": {"status": 200, "body": {"inline_string": COMPLETION}},
                                                            "response_headers_to_add": [
                                                                {"header": {"key": "content-type", "value": "application/json"}}
                                                            ],
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                    },
                                }
                            ]
                        }
                    ],
                }
            ]
        },
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
    }


def without_ext_proc(cfg: dict) -> dict:
    """The same gateway config with the ext_proc filter removed (Envoy alone)."""
    out = copy.deepcopy(cfg)
    for listener in out["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                tc = f.get("typed_config", {})
                if "http_filters" in tc:
                    tc["http_filters"] = [h for h in tc["http_filters"] if h["name"] != "envoy.filters.http.ext_proc"]
    return out


def without_access_log(cfg: dict) -> dict:
    out = copy.deepcopy(cfg)
    for listener in out["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                f.get("typed_config", {}).pop("access_log", None)
    return out


def prompt_words(tokens: int) -> str:
    """Text of about `tokens` tokens (common single-token words); the real count is measured."""
    words = ["time", "data", "model", "light", "river", "stone", "green", "paper", "music", "field"]
    text = " ".join(words[i % len(words)] for i in range(tokens))
    return text


def wrk_script(content: str, shared_context: str | None = None) -> str:
    """A wrk Lua script posting a chat body whose prompt starts with a per-request counter,
    so every prompt is unique (no token-cache hits). With `shared_context`, that text goes
    first as a system message every request shares (a multi-turn history, a long document),
    and only the short user message is new."""
    messages = [{"role": "user", "content": "@@"}]
    if shared_context is not None:
        messages.insert(0, {"role": "system", "content": shared_context})
    head = json.dumps({"model": MODEL, "max_tokens": 16, "messages": messages})
    before, after = head.split("@@")
    return f"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local before = {json.dumps(before)}
local after = {json.dumps(after)}
local content = {json.dumps(content)}
local counter = 0
request = function()
  counter = counter + 1
  return wrk.format(nil, "/v1/chat/completions", nil, before .. "req " .. counter .. " " .. content .. after)
end
"""


def run_wrk(url: str, script: Path, duration_s: int, concurrency: int) -> dict:
    """Run wrk; return requests/s, p50/p99 latency (ms) and non-2xx count."""
    import subprocess

    out = subprocess.run(
        ["wrk", "-t", "2", "-c", str(concurrency), "-d", f"{duration_s}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=duration_s + 60,
        check=True,
    ).stdout

    def latency_ms(label: str) -> float:
        m = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            raise RuntimeError(f"no {label}% latency in wrk output:\n{out}")
        value, unit = float(m.group(1)), m.group(2)
        return value / 1000 if unit == "us" else value * 1000 if unit == "s" else value

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {"rps": rps, "p50_ms": latency_ms("50"), "p99_ms": latency_ms("99"), "non2xx": int(bad.group(1)) if bad else 0}


async def passthrough_server(port: int, destination: str) -> None:
    """The floor: a bare grpc.aio ext_proc server (runs in a child process, see main)."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    headers = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    routed = pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=destination.encode()),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    ]
                ),
                clear_route_cache=True,
            )
        )
    )
    other = {
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    }

    class Passthrough(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):  # noqa: N802
            async for msg in request_iterator:
                phase = msg.WhichOneof("request")
                yield headers if phase == "request_headers" else routed if phase == "request_body" else other[phase]

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 8 * 1024 * 1024)])
    pb_grpc.add_ExternalProcessorServicer_to_server(Passthrough(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wrk_cpu(url: str, script: Path, duration_s: int, concurrency: int, pid: int | None) -> dict:
    """`run_wrk`, plus the CPU milliseconds process `pid` spent per request during it."""
    before = cpu_seconds(pid) if pid else 0.0
    result = run_wrk(url, script, duration_s, concurrency)
    if pid:
        served = result["rps"] * duration_s
        result["server_cpu_ms"] = (cpu_seconds(pid) - before) * 1000 / served if served else float("nan")
    return result


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def decision_totals(admin_url: str) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) per decision phase, from the server's histogram."""
    async with httpx.AsyncClient(trust_env=False) as client:
        text = (await client.get(f"{admin_url}/metrics")).text
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "llm_extproc_decision_duration_seconds":
            for s in fam.samples:
                phase = s.labels.get("phase")
                if s.name.endswith("_sum"):
                    sums[phase] = s.value
                elif s.name.endswith("_count"):
                    counts[phase] = s.value
    return {p: (sums[p], counts.get(p, 0.0)) for p in sums}


def mean_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean milliseconds per phase between two histogram readings."""
    out = {}
    for phase, (s1, c1) in after.items():
        s0, c0 = before.get(phase, (0.0, 0.0))
        if c1 > c0:
            out[phase] = (s1 - s0) / (c1 - c0) * 1000
    return out


async def flood(address: tuple[str, int], duration_s: float, concurrency: int, chars: int) -> dict:
    """Decisions under a flood of unique `chars`-character chat prompts at `concurrency`, straight
    to an ext_proc server: decisions/s, p50/p99 decision latency (ms), errors."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    hdrs = {":method": b"POST", ":path": b"/v1/chat/completions", ":authority": b"llm.local", "content-type": b"application/json"}
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in hdrs.items()]))
    )
    text = prompt_words(chars // 5)[:chars]
    latencies: list[float] = []
    errors = answered = 0
    stop = time.monotonic() + duration_s

    async def worker(stub, n: int) -> None:
        nonlocal errors, answered
        i = 0
        while time.monotonic() < stop:
            i += 1
            body = json.dumps({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": f"req {n}-{i} {text}"}]}).encode()
            call = stub.Process()
            try:
                await call.write(headers)
                await call.read()
                t0 = time.perf_counter()
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
                reply = await call.read()
                answered += 1
                if time.monotonic() < stop:
                    latencies.append(time.perf_counter() - t0)
                    errors += reply.WhichOneof("response") != "request_body"
            finally:
                call.cancel()

    options = [("grpc.max_send_message_length", 8 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(f"{address[0]}:{address[1]}", options=options) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        t_start = time.monotonic()
        await asyncio.gather(*(worker(stub, n) for n in range(concurrency)))
        elapsed = min(time.monotonic(), stop) - t_start
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    return {
        "decisions_per_s": len(latencies) / elapsed, "p50_ms": pct(0.50), "p99_ms": pct(0.99),
        "decisions": len(latencies), "answered": answered, "errors": errors,
    }  # fmt: skip


def wait_idle(pid: int, limit_s: float = 120.0) -> float:
    """Wait until process `pid` uses under 5% of a core over a second (or `limit_s` passes);
    returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        before = cpu_seconds(pid)
        time.sleep(1.0)
        if cpu_seconds(pid) - before < 0.05:
            break
    return time.monotonic() - t0


async def metric_value(admin_url: str, name: str) -> float:
    """Sum of a metric's samples named `name` on a server's /metrics."""
    async with httpx.AsyncClient(trust_env=False) as client:
        text = (await client.get(f"{admin_url}/metrics")).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sizes", default="100,1000,8000", help="prompt sizes (tokens)")
    ap.add_argument("--shared", default="8000", help="sizes (tokens) also measured as a shared context + a unique 20-token question")
    ap.add_argument("--rss-requests", type=int, default=10_000, help="requests per memory round")
    ap.add_argument("--rss-rounds", type=int, default=2, help="rounds of --rss-requests, RSS read after each")
    ap.add_argument("--telemetry", choices=("on", "off"), default="on", help="server response telemetry (off: no response body messages)")
    ap.add_argument("--baseline", type=Path, help="source tree of a second llm-extproc to compare with (before / after)")
    ap.add_argument("--variant", type=json.loads, help="JSON laid over the server config for a third server (this tree), e.g. "
                    "'{\"telemetry\": {\"response_headers\": \"when_needed\"}}'")
    ap.add_argument("--flood", action="store_true", help="also measure decisions under a flood of long prompts")
    ap.add_argument("--flood-chars", type=int, default=200_000)
    ap.add_argument("--flood-concurrency", type=int, default=150)
    ap.add_argument("--flood-duration", type=float, default=20.0)
    ap.add_argument("--passthrough-server", nargs=2, metavar=("PORT", "DESTINATION"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.passthrough_server:
        await passthrough_server(int(args.passthrough_server[0]), args.passthrough_server[1])
        return
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")

    from extproc.pipeline.tokens import TokenCounter

    counter = TokenCounter.from_source("builtin:qwen3")
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    backend_port = free_port()
    backend = EnvoyProcess(backend_config(backend_port), workdir=work, name="backend", concurrency=1)
    await backend.start()
    server_cfg = work / "extproc.yaml"
    server_cfg.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": MODEL, "max_model_len": 40960}],
                "endpoints": [{"address": f"127.0.0.1:{backend_port}", "models": [MODEL]}],
                "telemetry": {"enabled": args.telemetry == "on"},
            }
        )
    )
    server = ExtProcServerProcess(server_cfg, workdir=work, log_level="warning")
    variant = None
    if args.variant:
        from extproc.bench.stacks import merge_config

        variant_cfg = work / "variant.yaml"
        variant_cfg.write_text(yaml.safe_dump(merge_config(yaml.safe_load(server_cfg.read_text()), args.variant)))
        variant = ExtProcServerProcess(variant_cfg, workdir=work, log_level="warning", name="variant")
    baseline = None
    if args.baseline is not None:
        tree = args.baseline.resolve()
        if not (tree / "extproc" / "__init__.py").is_file():
            sys.exit(f"--baseline {tree}: no extproc package there")
        baseline = ExtProcServerProcess(server_cfg, workdir=work, log_level="warning", env={"PYTHONPATH": str(tree)}, cwd=tree, name="baseline")
    base = without_access_log(load_envoy_config("fail-open"))

    def gateway(extproc: tuple[str, int], name: str) -> EnvoyProcess:
        """The fail-open gateway onto the instant backend, its ext_proc filter pointing at `extproc`."""
        settings = RunSettings(extproc=extproc, endpoints=[("127.0.0.1", backend_port)])
        return EnvoyProcess(rewrite_config(base, settings), workdir=work, name=name, concurrency=1)

    floor_port = free_port()
    floor: subprocess.Popen | None = None
    gw = floor_gw = alone = base_gw = var_gw = None
    rows = []
    floods = {}
    try:
        await server.start()
        if baseline is not None:
            await baseline.start()
            base_gw = gateway(baseline.grpc_address, "gateway-baseline")
            await base_gw.start()
        if variant is not None:
            await variant.start()
            var_gw = gateway(variant.grpc_address, "gateway-variant")
            await var_gw.start()
        gw = gateway(server.grpc_address, "gateway")
        floor = subprocess.Popen(
            [sys.executable, __file__, "--passthrough-server", str(floor_port), f"127.0.0.1:{backend_port}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        if floor.stdout.readline().strip() != "ready":
            raise RuntimeError("the pass-through ext_proc server did not start")
        floor_gw = gateway(("127.0.0.1", floor_port), "passthrough")
        alone = EnvoyProcess(
            rewrite_config(without_ext_proc(base), RunSettings(endpoints=[("127.0.0.1", backend_port)])),
            workdir=work, name="alone", concurrency=1,
        )  # fmt: skip
        for envoy in (gw, floor_gw, alone):
            await envoy.start()
        cases = [(int(s), False) for s in args.sizes.split(",") if s] + [(int(s), True) for s in args.shared.split(",") if s]
        for size, shared in cases:
            if shared:
                context, content = prompt_words(size), prompt_words(20)
                msgs = [{"role": "system", "content": context}, {"role": "user", "content": "req 1 " + content}]
            else:
                context, content = None, prompt_words(size)
                msgs = [{"role": "user", "content": "req 1 " + content}]
            n = counter.count_chat(msgs).count
            script = work / f"chat_{size}_{shared}.lua"
            script.write_text(wrk_script(content, context))
            before = await decision_totals(server.admin_url)
            r_alone = run_wrk(alone.url, script, args.duration, args.concurrency)
            r_floor = run_wrk_cpu(floor_gw.url, script, args.duration, args.concurrency, floor.pid)
            r_ext = run_wrk_cpu(gw.url, script, args.duration, args.concurrency, server.process.pid)
            after = await decision_totals(server.admin_url)
            rows.append({
                "size": size, "shared": shared, "prompt_tokens": n, "alone": r_alone, "passthrough": r_floor, "extproc": r_ext,
                "decision_ms": mean_ms(before, after),
            })  # fmt: skip
            if baseline is not None:
                b0 = await decision_totals(baseline.admin_url)
                rows[-1]["baseline"] = run_wrk_cpu(base_gw.url, script, args.duration, args.concurrency, baseline.process.pid)
                rows[-1]["baseline_decision_ms"] = mean_ms(b0, await decision_totals(baseline.admin_url))
            if variant is not None:
                rows[-1]["variant"] = run_wrk_cpu(var_gw.url, script, args.duration, args.concurrency, variant.process.pid)
            print(json.dumps(rows[-1]), flush=True)
        # Memory: RSS before and after each of `--rss-rounds` rounds of many more requests
        # (unique 1k-token prompts: the token cache churns at its bound the whole time).
        pid = server.process.pid
        rss = [rss_bytes(pid) / 2**20]
        script = work / "chat_1000.lua"
        script.write_text(wrk_script(prompt_words(1000)))
        served = 0
        for _ in range(args.rss_rounds):
            target = served + args.rss_requests
            while served < target:
                r = run_wrk(gw.url, script, 5, args.concurrency)
                served += int(r["rps"] * 5)
            rss.append(rss_bytes(pid) / 2**20)
            print(json.dumps({"rss_mib": rss, "requests": served}), flush=True)
        if args.flood:
            for name, srv in (("after", server), ("before", baseline)):
                if srv is None:
                    continue
                wait_idle(srv.process.pid)
                est0 = await metric_value(srv.admin_url, "llm_extproc_tokenizer_estimates_total")
                cpu0 = cpu_seconds(srv.process.pid)
                result = await flood(srv.grpc_address, args.flood_duration, args.flood_concurrency, args.flood_chars)
                result["server_cpu_s"] = cpu_seconds(srv.process.pid) - cpu0
                result["estimated"] = await metric_value(srv.admin_url, "llm_extproc_tokenizer_estimates_total") - est0
                result["idle_after_s"] = wait_idle(srv.process.pid)
                floods[name] = result
                print(json.dumps({"flood": name, **result}), flush=True)
    finally:
        for envoy in (gw, floor_gw, alone, base_gw, var_gw):
            if envoy is not None:
                await envoy.aclose()
        if floor is not None:
            floor.terminate()
            floor.wait(timeout=10)
        await server.aclose()
        for extra in (baseline, variant):
            if extra is not None:
                await extra.aclose()
        await backend.aclose()
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"concurrency {args.concurrency}, {args.duration} s per cell, telemetry {args.telemetry}; unique prompts, or a shared context + a unique question")
    print(
        "| prompt tokens | Envoy alone p50 / p99 (ms) | + llm-extproc p50 / p99 (ms) | added p50 / p99 (ms) | req/s alone "
        "| req/s pass-through (ratio) | req/s llm-extproc (ratio) | server CPU per request, pass-through / llm-extproc (ms) "
        "| decision parse / tokenize / schedule (ms, mean) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        a, f, e = row["alone"], row["passthrough"], row["extproc"]
        d = row["decision_ms"]
        label = f"{row['prompt_tokens']} (shared context)" if row["shared"] else str(row["prompt_tokens"])
        print(
            f"| {label} | {a['p50_ms']:.2f} / {a['p99_ms']:.2f} | {e['p50_ms']:.2f} / {e['p99_ms']:.2f} | "
            f"{e['p50_ms'] - a['p50_ms']:.2f} / {e['p99_ms'] - a['p99_ms']:.2f} | {a['rps']:.0f} | "
            f"{f['rps']:.0f} ({f['rps'] / a['rps']:.2f}) | {e['rps']:.0f} ({e['rps'] / a['rps']:.2f}) | "
            f"{f['server_cpu_ms']:.2f} / {e['server_cpu_ms']:.2f} | "
            f"{d.get('parse', 0):.3f} / {d.get('tokenize', 0):.3f} / {d.get('schedule', 0):.3f} |"
        )

    if any("baseline" in row for row in rows):
        print()
        print("Before (--baseline) / after, same run:")
        print(
            "| prompt tokens | server CPU per request, pass-through / before / after (ms) | CPU above the pass-through, before / after (ms) "
            "| tokenize phase, before / after (ms, mean) | speed-up | req/s before / after |"
        )
        print("|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            f, e, b = row["passthrough"], row["extproc"], row["baseline"]
            tb, ta = row["baseline_decision_ms"].get("tokenize", 0), row["decision_ms"].get("tokenize", 0)
            label = f"{row['prompt_tokens']} (shared context)" if row["shared"] else str(row["prompt_tokens"])
            print(
                f"| {label} | {f['server_cpu_ms']:.2f} / {b['server_cpu_ms']:.2f} / {e['server_cpu_ms']:.2f} | "
                f"{b['server_cpu_ms'] - f['server_cpu_ms']:.2f} / {e['server_cpu_ms'] - f['server_cpu_ms']:.2f} | "
                f"{tb:.3f} / {ta:.3f} | {tb / ta if ta else float('nan'):.1f}× | {b['rps']:.0f} / {e['rps']:.0f} |"
            )
    if any("variant" in row for row in rows):
        print()
        print(f"Variant {json.dumps(args.variant)} (this tree), same run:")
        print("| prompt tokens | server CPU per request, after / variant (ms) | req/s after / variant |")
        print("|---:|---:|---:|")
        for row in rows:
            e, v = row["extproc"], row["variant"]
            label = f"{row['prompt_tokens']} (shared context)" if row["shared"] else str(row["prompt_tokens"])
            print(f"| {label} | {e['server_cpu_ms']:.2f} / {v['server_cpu_ms']:.2f} | {e['rps']:.0f} / {v['rps']:.0f} |")
    if floods:
        print()
        print(f"Flood: {args.flood_chars} characters per prompt, concurrency {args.flood_concurrency}, {args.flood_duration:.0f} s, straight to gRPC")
        print("| server | decisions/s | decision p50 / p99 (ms) | routed on the estimate | server CPU (s) | busy after the flood (s) |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in floods.items():
            share = r["estimated"] / r["answered"] if r["answered"] else float("nan")  # those answered after the window too
            print(
                f"| {name} | {r['decisions_per_s']:.1f} | {r['p50_ms']:.0f} / {r['p99_ms']:.0f} | {share:.0%} | "
                f"{r['server_cpu_s']:.1f} | {r['idle_after_s']:.0f} |"
            )


if __name__ == "__main__":
    asyncio.run(main())
