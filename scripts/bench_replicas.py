#!/usr/bin/env python3
"""Replicas that act as one router: what sharing picks through Redis costs and what it buys.

Every replica is a real `llm-extproc serve` process (replicas.sync: redis, or off), driven over
ext_proc as Envoy would (`extproc.replicas.probe`), its decisions held open so that in-flight
accounting shows; the four endpoints are never contacted (decisions only). Redis is a real
redis-server on 127.0.0.1.

    spread   a burst of 40 requests (one every 5 ms, alternating replicas) with 1 process, 2
             replicas without sync and 2 with sync: per-endpoint counts, for short distinct
             prompts and for prompts sharing a ~3k-token system prompt (how many endpoints end up
             prefilling the shared prefix); and 20 long prompts each sent twice, to replica a then
             50 ms later to replica b: how often the repeat lands on the first's endpoint.
    reuseport  40 requests through Envoy (--concurrency 2, restarted per trial) to 2 replicas
             sharing one port (SO_REUSEPORT) or each on its own port listed in the cluster: how
             many ext_proc streams each replica decides.
    delay    pick → applied on another replica (ms, p50/p99): a separate probe process subscribes
             and times each batch from the moment replica a queued it (one host: one clock);
             idle (one decision every 20 ms) and under a flood (16 concurrent streams).
    cpu      replica a's CPU per decision (from /proc, user + system) with sync off and on, in
             alternating rounds, and replica b's CPU per decision of a's that it applies; plus
             the in-process cost of the hooks on the decision path (µs per reserve + release).
    publish  in process with a real Redis: CPU per decision without sync, publishing only, and
             publishing + subscribed, at flush_ms 0 and 5.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_replicas.py all [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
import msgpack
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.replicas.probe import chat_body, decide  # noqa: E402
from extproc.stack.redis import RedisProcess  # noqa: E402
from extproc.stack.server import ExtProcServerProcess  # noqa: E402

MODEL = "Qwen/Qwen3-8B"
ENDPOINTS = [f"127.0.0.1:{18201 + i}" for i in range(4)]
WORDS = "prefill decode block cache tensor kernel batch token queue replica router shard".split()
CHANNEL = "bench:replicas"


def text(seed: int, words: int) -> str:
    return f"Document {seed}: " + " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(words))


def config(redis_url: str, sync: bool) -> dict:
    return {
        "models": [{"name": MODEL, "max_model_len": 32768}],
        "endpoints": [{"address": a, "models": [MODEL]} for a in ENDPOINTS],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}},
        "ratelimit": {"redis": {"url": redis_url, "timeout_ms": 200}},
        "replicas": {"sync": "redis" if sync else "off", "channel": CHANNEL},
    }


class Replica:
    def __init__(self, server: ExtProcServerProcess) -> None:
        self.server = server
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")

    async def decide(self, content: str, **extra):
        return await decide(self.channel, chat_body(MODEL, content, max_tokens=64, **extra))

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    async def aclose(self) -> None:
        await self.channel.close()
        await self.server.aclose()


async def start(tmp: Path, redis_url: str, name: str, sync: bool) -> Replica:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(redis_url, sync)), encoding="utf-8")
    server = ExtProcServerProcess(path, workdir=tmp, name=name, log_level="warning")
    await server.start()
    return Replica(server)


async def until_idle(group: list[Replica]) -> None:
    import httpx

    async with httpx.AsyncClient(trust_env=False, timeout=5) as c:
        for _ in range(500):
            views = [(await c.get(f"{r.server.admin_url}/api/v1/endpoints")).json() for r in group]
            if all(sum(e["inflight"] for e in v["endpoints"]) == 0 for v in views):
                return
            await asyncio.sleep(0.02)
    raise RuntimeError("replicas did not become idle")


# -- spread ---------------------------------------------------------------------------------


def ranked(picks: list[str | None]) -> Counter[int]:
    """Requests per endpoint, busiest first, keyed by rank (0..3): summed over rounds, the
    busiest endpoint of each round adds to rank 0."""
    counts = sorted(Counter(picks).values(), reverse=True) + [0] * 4
    return Counter({i: counts[i] for i in range(4)})


async def burst(group: list[Replica], prompts: list[str], gap_s: float = 0.005) -> list[str | None]:
    async def one(i: int):
        await asyncio.sleep(i * gap_s)
        return await group[i % len(group)].decide(prompts[i])

    held = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    out = [h.endpoint for h in held]
    for h in held:
        await h.end()
    await until_idle(group)
    return out


async def skewed(group: list[Replica], r: int) -> list[str | None]:
    """12 requests sharing a ~8.5k-token prefix sent to replica a (the prefix pulls them
    together), then 28 fresh short requests split across the replicas: where all 40 are in flight."""
    system = text(5000 + r, 5000)
    sticky = [await group[0].decide(f"{system}\nQuestion {i}?") for i in range(12)]
    await asyncio.sleep(0.05)

    async def one(i: int):
        await asyncio.sleep(i * 0.005)
        return await group[i % len(group)].decide(f"Fresh {r}-{i}.")

    fresh = await asyncio.gather(*(one(i) for i in range(28)))
    out = [h.endpoint for h in [*sticky, *fresh]]
    for h in [*sticky, *fresh]:
        await h.end()
    await until_idle(group)
    return out


async def follow(group: list[Replica], seeds: range) -> float:
    a, b = group[0], group[-1]
    same = 0
    for s in seeds:
        p = text(s, 2000)
        first = await a.decide(p)
        await asyncio.sleep(0.05)
        second = await b.decide(p)
        same += first.endpoint == second.endpoint
        await first.end()
        await second.end()
    await until_idle(group)
    return same / len(seeds)


async def spread(tmp: Path, redis_url: str, rounds: int) -> None:
    print("## Burst spread: 1 process, 2 replicas without sync, 2 with sync\n")
    print(f"40 requests one every 5 ms (alternating replicas), {rounds} rounds; requests per endpoint, busiest first, summed over rounds.\n")
    print("| setup | short prompts: per endpoint | max/mean | shared 3k-token prefix: per endpoint | endpoints prefilling the prefix (mean) | "
          "12 on one 8k prefix via a, then 28 fresh: per endpoint | max/mean | repeat follows (20 pairs, 50 ms) |")
    print("|---|---|---|---|---|---|---|---|")
    setups = [("1 process", 1, True), ("2 replicas, no sync", 2, False), ("2 replicas, sync", 2, True)]
    for label, n, sync in setups:
        group = [await start(tmp, redis_url, f"{label[:1]}{n}{sync}-{i}", sync) for i in range(n)]
        try:
            await asyncio.sleep(1.0)  # subscribed
            short: Counter[str] = Counter()
            shared: Counter[str] = Counter()
            holders = []
            skew: Counter[str] = Counter()
            for r in range(rounds):
                skew.update(ranked(await skewed(group, r)))
                picks = await burst(group, [f"Say hello {r}-{i}." for i in range(40)])
                short.update(ranked(picks))
                system = text(1000 + r, 2000)
                picks = await burst(group, [f"{system}\nQuestion {i}: why?" for i in range(40)])
                shared.update(ranked(picks))
                holders.append(len(set(picks)))
            follows = await follow(group, range(2000 + 100 * n + 10 * sync, 2020 + 100 * n + 10 * sync))
            s, k = [short[i] for i in range(4)], [skew[i] for i in range(4)]
            print(
                f"| {label} | {s} | {max(s) / (sum(s) / 4):.2f} | {[shared[i] for i in range(4)]} | "
                f"{statistics.mean(holders):.1f} | {k} | {max(k) / (sum(k) / 4):.2f} | {follows:.0%} |"
            )
        finally:
            for r in group:
                await r.aclose()
    print()


# -- one port (SO_REUSEPORT) or one port per worker ------------------------------------------


def _routed(metrics_text: str) -> float:
    return sum(float(x.rsplit(" ", 1)[1]) for x in metrics_text.splitlines() if x.startswith('llm_extproc_requests_total{outcome="routed"'))


async def reuseport(tmp: Path, redis_url: str, trials: int = 6) -> None:
    """40 requests through Envoy (2 worker threads) to 2 replicas: sharing one gRPC port with
    SO_REUSEPORT, or each on its own port listed in the cluster. Envoy restarted per trial (a
    fresh set of upstream connections)."""
    import httpx

    from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
    from extproc.stack.ports import free_port
    from tests.e2e.fake_engines import Backend

    print("## One shared port (SO_REUSEPORT) or one port per replica, behind Envoy\n")
    engines = [Backend("a"), Backend("b")]
    for e in engines:
        await e.start()
    shared_port = free_port()
    shared = []
    for i in range(2):
        path = tmp / f"rp-{i}.yaml"
        path.write_text(yaml.safe_dump(config(redis_url, True) | {"endpoints": [{"address": e.address, "models": [MODEL]} for e in engines]}))
        srv = ExtProcServerProcess(path, workdir=tmp, name=f"rp-{i}", grpc_port=shared_port, log_level="warning")
        await srv.start()
        shared.append(srv)
    own = []
    for i in range(2):
        path = tmp / f"op-{i}.yaml"
        path.write_text(yaml.safe_dump(config(redis_url, True) | {"endpoints": [{"address": e.address, "models": [MODEL]} for e in engines]}))
        srv = ExtProcServerProcess(path, workdir=tmp, name=f"op-{i}", log_level="warning")
        await srv.start()
        own.append(srv)
    rows = []
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=30) as admin:
            for label, servers, settings in (
                ("one port, SO_REUSEPORT", shared, RunSettings(extproc=("127.0.0.1", shared_port))),
                ("a port each, both listed", own, RunSettings(extproc=own[0].grpc_address, extproc_replicas=[own[1].grpc_address])),
            ):
                splits = []
                for t in range(trials):
                    cfg = rewrite_config(load_envoy_config("fail-closed"), settings)
                    envoy = EnvoyProcess(cfg, workdir=tmp, name=f"envoy-{len(rows)}-{t}", concurrency=2)
                    await envoy.start()
                    before = [_routed((await admin.get(f"{s.admin_url}/metrics")).text) for s in servers]
                    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
                        got = await asyncio.gather(*(c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}]}) for i in range(40)))
                    assert all(r.status_code == 200 for r in got), [r.status_code for r in got]
                    after = [_routed((await admin.get(f"{s.admin_url}/metrics")).text) for s in servers]
                    splits.append(tuple(int(x - y) for x, y in zip(after, before)))
                    await envoy.aclose()
                rows.append((label, splits))
    finally:
        for srv in shared + own:
            await srv.aclose()
        for e in engines:
            await e.aclose()
    print(f"40 concurrent requests per trial, Envoy --concurrency 2 restarted each trial; streams decided by replica 1 / replica 2.\n")
    print("| ext_proc cluster | per trial | trials with one replica idle |\n|---|---|---|")
    for label, splits in rows:
        print(f"| {label} | {' '.join(f'{a}/{b}' for a, b in splits)} | {sum(1 for a, b in splits if a == 0 or b == 0)} of {len(splits)} |")
    print()


# -- delay ----------------------------------------------------------------------------------


def probe_main(url: str, out: str, seconds: float) -> None:
    """Subscribe and write `delay_ms` of every batch carrying a pick, for `seconds`."""
    import redis

    client = redis.Redis.from_url(url)
    ps = client.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(CHANNEL)
    delays = []
    end = time.monotonic() + seconds
    print("ready", flush=True)
    try:
        while time.monotonic() < end:
            msg = ps.get_message(timeout=0.2)
            if msg is None:
                continue
            now = time.time()
            _, sent_at, events = msgpack.unpackb(msg["data"], raw=False)
            if any(e[0] == "p" for e in events):
                delays.append((now - sent_at) * 1000)
    finally:
        Path(out).write_text("\n".join(f"{d:.4f}" for d in delays))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def delay(tmp: Path, redis_url: str, decisions: int) -> None:
    print("## Propagation of a pick to another replica\n")
    a = await start(tmp, redis_url, "delay-a", True)
    try:
        rows = []
        for label, conc, n, gap in (("idle: one decision every 20 ms", 1, max(20, decisions // 5), 0.02), ("flood: 16 concurrent streams", 16, decisions, 0.0)):
            out = tmp / f"delays-{conc}.txt"
            probe = subprocess.Popen(
                [sys.executable, __file__, "probe", "--url", redis_url, "--out", str(out), "--seconds", "60"],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert probe.stdout is not None and probe.stdout.readline().strip() == "ready"
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            queue = list(range(n))

            async def worker():
                while queue:
                    i = queue.pop()
                    h = await a.decide(f"Tell me about {i}: " + text(i, 400))
                    await h.end()
                    if gap:
                        await asyncio.sleep(gap)

            await asyncio.gather(*(worker() for _ in range(conc)))
            rate = n / (time.monotonic() - t0)
            await asyncio.sleep(0.5)
            probe.terminate()  # SIGTERM: its loop is cut; write what it has
            probe.wait(timeout=10)
            if not out.exists():
                probe_results = []
            else:
                probe_results = [float(x) for x in out.read_text().split()]
            rows.append((label, rate, probe_results))
        print("| load on replica a | decisions/s | batches | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|---|")
        for label, rate, xs in rows:
            if xs:
                print(f"| {label} | {rate:.0f} | {len(xs)} | {pct(xs, 0.5):.2f} | {pct(xs, 0.99):.2f} | {max(xs):.2f} |")
            else:
                print(f"| {label} | {rate:.0f} | 0 | - | - | - |")
        print()
    finally:
        await a.aclose()


# -- cpu ------------------------------------------------------------------------------------


async def cpu(tmp: Path, redis_url: str, rounds: int, n: int) -> None:
    print("## CPU per decision: publishing and applying\n")
    pairs = {}
    for sync in (False, True):
        pairs[sync] = [await start(tmp, redis_url, f"cpu-{sync}-{i}", sync) for i in range(2)]
    try:
        await asyncio.sleep(1.0)
        per: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(rounds):
            for sync in (False, True):
                a, b = pairs[sync]
                queue = list(range(n))

                async def worker(a=a, queue=queue, r=r):
                    while queue:
                        i = queue.pop()
                        h = await a.decide(f"Round {r} item {i}: " + text(i, 600))
                        await h.end()

                await asyncio.sleep(0.5)
                ca, cb = a.cpu_s(), b.cpu_s()
                await asyncio.gather(*(worker() for _ in range(8)))
                await asyncio.sleep(0.5)  # b applies the last batches; a's heartbeats are in both
                per[sync].append(((a.cpu_s() - ca) / n * 1000, (b.cpu_s() - cb) / n * 1000))
        off_a = statistics.median(x for x, _ in per[False])
        on_a = statistics.median(x for x, _ in per[True])
        off_b = statistics.median(y for _, y in per[False])
        on_b = statistics.median(y for _, y in per[True])
        print(f"{n} decisions per round (~1k-token prompts, 8 concurrent streams to replica a), {rounds} rounds alternating; medians.\n")
        print("| | sync off | sync on | added |\n|---|---|---|---|")
        print(f"| replica a (deciding), ms CPU per decision | {off_a:.3f} | {on_a:.3f} | {on_a - off_a:+.3f} |")
        print(f"| replica b (idle; applying a's picks), ms CPU per decision of a | {off_b:.3f} | {on_b:.3f} | {on_b - off_b:+.3f} |")
        print(f"\nRounds (a off, b off / a on, b on): {[(round(x, 3), round(y, 3)) for x, y in per[False]]} / {[(round(x, 3), round(y, 3)) for x, y in per[True]]}\n")
    finally:
        for group in pairs.values():
            for r in group:
                await r.aclose()
    hooks()


def hooks(n: int = 100_000) -> None:
    """The decision path's share, in process: reserve + release with and without the listener,
    and the prefix hook with 64 block hashes (a 1k-token prompt at 16 tokens per block)."""
    from extproc.config.schema import EndpointConfig, PrefixConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.prefix.tracker import PrefixTracker
    from extproc.ratelimit.config import RedisConfig
    from extproc.replicas.config import ReplicasConfig
    from extproc.replicas.sync import ReplicaSync

    def run(listen: bool) -> tuple[float, float]:
        store = Datastore([EndpointConfig(address=a, models=[MODEL]) for a in ENDPOINTS])
        sync = ReplicaSync(ReplicasConfig(sync="redis", max_queue=10**9), RedisConfig(), store, PrefixTracker(PrefixConfig())) if listen else None
        if sync is None:
            store.listener = None
        ep = store.get(ENDPOINTS[0])
        hashes = list(range(1 << 40, (1 << 40) + 64))
        hook = pack = 0.0
        for _ in range(n // 16):
            t0 = time.perf_counter()
            for _ in range(16):
                r = store.reserve(ep, 4, prompt_tokens=1000, context_tokens=1100)
                if sync is not None:
                    sync.shared(ep.address, 16, hashes, None)
                r.mark_first_token(learn=False)
                r.release()
            t1 = time.perf_counter()
            hook += t1 - t0
            if sync is not None:  # what the publisher does with them, once per loop turn
                batch, sync._queue = sync._queue, []
                msgpack.packb([sync.id, 0.0, batch])
                pack += time.perf_counter() - t1
        hook, pack = hook / n * 1e6, pack / n * 1e6
        return hook, pack

    base, _ = run(False)
    hooked, pack = run(True)
    print(f"In process ({n} reservations): reserve + first token + release {base:.2f} µs without sync, {hooked:.2f} µs with the")
    print(f"hooks queueing 4 events (64 block hashes) — {hooked - base:+.2f} µs on the decision path; the publisher's msgpack")
    print(f"of them {pack:.2f} µs per decision (off the decision, 16 decisions a batch).\n")


async def publish_cost(redis_url: str, n: int = 2000) -> None:
    """In process, with a real Redis: CPU per decision of reserve → first token → release
    ~0.6 ms apart, without sync, with sync publishing only, and with sync subscribed too."""
    from extproc.config.schema import EndpointConfig, PrefixConfig
    from extproc.datastore.endpoints import Datastore
    from extproc.prefix.tracker import PrefixTracker
    from extproc.ratelimit.config import RedisConfig
    from extproc.replicas.config import ReplicasConfig
    from extproc.replicas.sync import ReplicaSync

    async def run(mode: str, flush_ms: float) -> float:
        store = Datastore([EndpointConfig(address=a, models=[MODEL]) for a in ENDPOINTS])
        sync = None
        if mode != "off":
            sync = ReplicaSync(ReplicasConfig(sync="redis", flush_ms=flush_ms), RedisConfig(url=redis_url), store, PrefixTracker(PrefixConfig()))
            await sync.start()
            if mode == "publish only":
                sync._tasks[1].cancel()
            await asyncio.sleep(0.5)
        ep = store.get(ENDPOINTS[0])
        hashes = list(range(1 << 40, (1 << 40) + 62))
        t0 = time.process_time()
        for _ in range(n):
            r = store.reserve(ep, 4, prompt_tokens=1000, context_tokens=1100)
            if sync is not None:
                sync.shared(ep.address, 16, hashes, None)
            await asyncio.sleep(0)
            r.mark_first_token(learn=False)
            r.release()
            await asyncio.sleep(0.0005)
        await asyncio.sleep(0.3)
        cost = (time.process_time() - t0) / n * 1e6
        if sync is not None:
            await sync.aclose()
        return cost

    print(f"In process, {n} decisions ~0.6 ms apart, real Redis; µs of CPU per decision:\n")
    print("| flush_ms | sync off | publish only | publish + subscribe |\n|---|---|---|---|")
    for flush in (0.0, 5.0):
        print(f"| {flush:g} | {await run('off', flush):.0f} | {await run('publish only', flush):.0f} | {await run('full', flush):.0f} |")
    print()


async def main(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)\n")
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp_s:
        tmp = Path(tmp_s)
        redis = RedisProcess(workdir=tmp / "redis")
        await redis.start()
        try:
            if args.what in ("spread", "all"):
                await spread(tmp, redis.url, args.rounds)
            if args.what in ("reuseport", "all"):
                await reuseport(tmp, redis.url)
            if args.what in ("delay", "all"):
                await delay(tmp, redis.url, args.decisions)
            if args.what in ("cpu", "all"):
                await cpu(tmp, redis.url, args.rounds, args.decisions)
            if args.what in ("publish", "all"):
                await publish_cost(redis.url)
        finally:
            await redis.stop()
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["spread", "reuseport", "delay", "cpu", "publish", "hooks", "all", "probe"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decisions", type=int, default=1500)
    p.add_argument("--url", default="")
    p.add_argument("--out", default="")
    p.add_argument("--seconds", type=float, default=60)
    a = p.parse_args()
    if a.what == "probe":
        import signal

        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            probe_main(a.url, a.out, a.seconds)
        except KeyboardInterrupt:
            pass
    elif a.what == "hooks":
        hooks()
    else:
        asyncio.run(main(a))
