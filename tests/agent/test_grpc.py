"""The agent's gRPC port: grpc.health.v1 (Check, Watch) and llm_extproc.v1.NodeLoad (Get, Watch)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc._proto.llm_extproc.v1 import node_load_pb2 as pb
from extproc._proto.llm_extproc.v1 import node_load_pb2_grpc as pb_grpc
from extproc.agent.service import NODE_LOAD_SERVICE
from tests.agent.agent_helpers import FakeEngine, eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def statuses(channel: grpc.aio.Channel, services: list[str]) -> dict[str, int]:
    stub = health_pb2_grpc.HealthStub(channel)
    out = {}
    for s in services:
        out[s] = (await stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=2)).status
    return out


def test_node_load_service_name() -> None:
    assert NODE_LOAD_SERVICE == "llm_extproc.v1.NodeLoad"


async def test_engine_health_failure_flips_not_serving_and_recovery_flips_back(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}")
    all_services = ["", NODE_LOAD_SERVICE, "gpu", "engine"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        assert await statuses(ch, all_services) == dict.fromkeys(all_services, SERVING)
        engine.health_status = 503
        await eventually(lambda: agent.latest is not None and not agent.latest.healthy, what="engine unhealthy")
        assert await statuses(ch, all_services) == {"": NOT_SERVING, NODE_LOAD_SERVICE: NOT_SERVING, "gpu": SERVING, "engine": NOT_SERVING}
        report = await pb_grpc.NodeLoadStub(ch).Get(pb.GetLoadRequest(), timeout=2)
        assert not report.healthy and report.weight == 0.0 and "status 503" in report.reason
        engine.health_status = 200
        await eventually(lambda: agent.latest is not None and agent.latest.healthy, what="engine healthy again")
        assert await statuses(ch, all_services) == dict.fromkeys(all_services, SERVING)


async def test_health_watch_streams_the_flip(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=NODE_LOAD_SERVICE))
        assert (await asyncio.wait_for(call.read(), 2)).status == SERVING
        engine.health_status = 500
        assert (await asyncio.wait_for(call.read(), 2)).status == NOT_SERVING
        call.cancel()


async def test_load_alone_never_flips_health(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}")
    engine.running, engine.waiting, engine.kv_usage = 256, 900, 1.0
    engine.gpu["utilization"] = 1.0
    engine.gpu["memory_used_bytes"] = engine.gpu["memory_total_bytes"]
    await eventually(lambda: agent.latest is not None and agent.latest.engine.waiting == 900, what="loaded sample")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        assert (await statuses(ch, [NODE_LOAD_SERVICE]))[NODE_LOAD_SERVICE] == SERVING
        report = await pb_grpc.NodeLoadStub(ch).Get(pb.GetLoadRequest(), timeout=2)
    assert report.healthy
    # Full KV, busy GPU, no latency figure: both known terms are 0.
    assert report.weight == pytest.approx(0.0)


async def test_sim_gpu_failure_is_a_gpu_fault(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}")
    engine.gpu = {"memory_used_bytes": "lots"}  # not the /sim/gpu shape
    await eventually(lambda: agent.latest is not None and agent.latest.gpu_fault is not None, what="gpu fault")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        st = await statuses(ch, ["", "gpu", "engine"])
    assert st == {"": NOT_SERVING, "gpu": NOT_SERVING, "engine": SERVING}


async def test_get_reports_devices_and_engine(engine: FakeEngine, start_agent) -> None:
    engine.running, engine.waiting, engine.kv_usage = 4, 1, 0.5
    engine.gpu["utilization"] = 0.6
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}", node="gpu-node-7")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        r = await pb_grpc.NodeLoadStub(ch).Get(pb.GetLoadRequest(), timeout=2)
    assert r.node == "gpu-node-7" and r.healthy and r.reason == ""
    assert abs(r.time.ToDatetime().timestamp() - time.time()) < 30
    (d,) = r.devices
    assert (d.index, d.uuid, d.memory_used_bytes, d.memory_total_bytes) == (0, "sim-0", 10 * 2**30, 80 * 2**30)
    assert d.gpu_utilization == pytest.approx(0.6)
    assert not d.HasField("temperature_c") and not d.HasField("ecc_errors")  # the sim has none
    e = r.engine
    assert (e.url, e.reachable, e.healthy) == (engine.url, True, True)
    assert (e.kv_blocks_total, e.kv_blocks_free, e.block_size, e.kv_usage) == (1000, 500, 16, 0.5)
    assert (e.requests_running, e.requests_waiting) == (4, 1)
    assert not e.HasField("ttft_p95_ms")  # no request in the window
    # KV half free, GPU 60 % busy, latency unknown: (0.5 + 0.4) / 2.
    assert r.weight == pytest.approx(0.45)


async def test_watch_delivers_one_report_per_period(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url, period_s=0.1)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        times = []
        async for _ in pb_grpc.NodeLoadStub(ch).Watch(pb.WatchLoadRequest(), timeout=10):
            times.append(time.monotonic())
            if len(times) == 11:
                break
    gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))  # the first arrives at once
    median = gaps[len(gaps) // 2]
    assert 0.05 < median < 0.3, gaps  # 0.1 s period, loose on a loaded machine


async def test_watch_honours_a_longer_min_interval(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url, period_s=0.05)
    req = pb.WatchLoadRequest()
    req.min_interval.FromMilliseconds(300)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        times = []
        async for _ in pb_grpc.NodeLoadStub(ch).Watch(req, timeout=10):
            times.append(time.monotonic())
            if len(times) == 4:
                break
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= 0.29, gaps  # never sooner than asked, though samples come every 0.05 s


async def test_watch_rejects_a_negative_interval(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url)
    req = pb.WatchLoadRequest()
    req.min_interval.FromMilliseconds(-5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in pb_grpc.NodeLoadStub(ch).Watch(req, timeout=5):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_watch_streams_end_cleanly_when_the_agent_stops(engine: FakeEngine, start_agent) -> None:
    agent = await start_agent(engine.url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.grpc_port}") as ch:
        call = pb_grpc.NodeLoadStub(ch).Watch(pb.WatchLoadRequest())
        assert isinstance(await asyncio.wait_for(call.read(), 2), pb.LoadReport)
        await agent.aclose()
        while (msg := await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
            assert isinstance(msg, pb.LoadReport)
        assert await call.code() == grpc.StatusCode.OK
