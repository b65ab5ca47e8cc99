"""`AgentWatcher`: the ext_proc server's subscription to node agents, against real agents."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from extproc.config.schema import EndpointConfig
from extproc.datastore.agent_client import AgentWatcher, NodeReport, backoff_delay
from extproc.datastore.endpoints import Datastore
from tests.agent.agent_helpers import FakeEngine, eventually

ENDPOINT = "127.0.0.1:8001"


def store_for(agent_port: int | None) -> Datastore:
    cfgs = [
        EndpointConfig(address=ENDPOINT, models=["m"], agent=None if agent_port is None else f"127.0.0.1:{agent_port}"),
        EndpointConfig(address="127.0.0.1:8002", models=["m"]),  # no agent: never watched
    ]
    return Datastore(cfgs)


@pytest.fixture
async def watchers():
    made: list[AgentWatcher] = []

    async def start(store: Datastore, **kw) -> AgentWatcher:
        kw.setdefault("backoff_initial_s", 0.05)
        kw.setdefault("backoff_max_s", 0.2)
        w = AgentWatcher(store, rng=random.Random(7), **kw)
        await w.start()
        made.append(w)
        return w

    yield start
    for w in made:
        await w.aclose()


def node(store: Datastore, address: str = ENDPOINT) -> NodeReport | None:
    ep = store.get(address)
    assert ep is not None
    return ep.node


async def test_node_report_follows_a_loading_gpu(engine: FakeEngine, start_agent, watchers) -> None:
    engine.gpu["utilization"] = 0.1
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}")
    store = store_for(agent.grpc_port)
    w = await watchers(store)
    assert w.agents == [f"127.0.0.1:{agent.grpc_port}"]
    await eventually(lambda: node(store) is not None, what="first report")
    idle = node(store)
    assert idle.gpu_util == pytest.approx(0.1) and idle.usable and not idle.stale()
    assert (idle.memory_used_bytes, idle.memory_total_bytes) == (10 * 2**30, 80 * 2**30)
    assert (idle.kv_blocks_free, idle.kv_blocks_total, idle.device_fault) == (1000, 1000, None)

    engine.gpu.update(utilization=0.95, memory_used_bytes=79 * 2**30)
    engine.kv_usage = 0.75
    await eventually(lambda: node(store).gpu_util == pytest.approx(0.95), what="loaded report")
    loaded = node(store)
    assert loaded.memory_used_bytes == 79 * 2**30 and loaded.kv_blocks_free == 250
    assert loaded.weight < idle.weight and loaded.usable  # load lowers the weight, never usability
    assert node(store, "127.0.0.1:8002") is None


async def test_device_fault_makes_the_endpoint_unusable(engine: FakeEngine, start_agent, watchers) -> None:
    agent = await start_agent(engine.url, gpu=f"sim:{engine.url}")
    store = store_for(agent.grpc_port)
    await watchers(store)
    await eventually(lambda: node(store) is not None and node(store).usable, what="usable report")
    engine.gpu = {}  # the GPU can no longer be read: a device fault
    await eventually(lambda: not node(store).usable, what="fault reported")
    n = node(store)
    assert n.device_fault is not None and n.device_fault.startswith("GPU 0: ")
    assert not n.healthy and n.weight == 0.0


async def test_reconnects_after_the_agent_restarts_on_the_same_port(engine: FakeEngine, start_agent, watchers) -> None:
    first = await start_agent(engine.url, node="before")
    port = first.grpc_port
    store = store_for(port)
    w = await watchers(store, stale_after_s=0.3)
    await eventually(lambda: node(store) is not None and node(store).node == "before", what="first agent's report")
    await first.aclose()
    await eventually(lambda: node(store).stale(), what="report goes stale while the agent is down")
    await start_agent(engine.url, node="after", grpc_port=port)
    await eventually(lambda: node(store).node == "after" and not node(store).stale(), timeout_s=10, what="new agent's report")
    assert w.connects[f"127.0.0.1:{port}"] >= 2


async def test_a_silent_stream_is_abandoned_and_reopened(engine: FakeEngine, start_agent, watchers) -> None:
    agent = await start_agent(engine.url, period_s=0.05)
    store = store_for(agent.grpc_port)
    # Ask for one report per 2 s but give up on a stream silent for 0.3 s: every stream is cut.
    w = await watchers(store, min_interval_s=2.0, idle_timeout_s=0.3)
    addr = f"127.0.0.1:{agent.grpc_port}"
    await eventually(lambda: w.connects.get(addr, 0) >= 3, what="reconnects after idle timeouts")
    assert node(store) is not None


@pytest.mark.parametrize("attempt", [0, 1, 3, 10, 100], ids=lambda a: f"attempt-{a}")
def test_backoff_is_capped_exponential_with_equal_jitter(attempt: int) -> None:
    rng = random.Random(attempt)
    d = min(5.0, 0.1 * 2**attempt)
    for _ in range(50):
        assert d / 2 <= backoff_delay(attempt, initial_s=0.1, max_s=5.0, rng=rng) <= d


@pytest.mark.parametrize(
    ("agent", "ok"),
    [("10.0.0.1:9100", True), ("gpu-node-3.internal:9100", True), ("[::1]:9100", True),
     ("10.0.0.1", False), ("10.0.0.1:0", False), ("10.0.0.1:70000", False)],
    ids=["ip", "hostname", "ipv6", "no-port", "port-0", "port-range"],
)
def test_endpoint_agent_address_is_validated(agent: str, ok: bool) -> None:
    if ok:
        assert EndpointConfig(address="10.0.0.1:8000", models=["m"], agent=agent).agent == agent
    else:
        with pytest.raises(ValidationError, match="agent"):
            EndpointConfig(address="10.0.0.1:8000", models=["m"], agent=agent)


async def test_the_same_agent_for_another_object_of_the_same_address_keeps_its_stream(engine: FakeEngine, start_agent, watchers) -> None:
    """`add` is keyed on the endpoint's address (Endpoint compares by identity): the same
    address and agent again, as a new `Endpoint` object (an endpoint removed, then re-added by
    a reload or discovery), keeps the open stream, and its reports go to the new object."""
    agent = await start_agent(engine.url, period_s=0.05)
    addr = f"127.0.0.1:{agent.grpc_port}"
    store = store_for(agent.grpc_port)
    w = await watchers(store)
    await eventually(lambda: node(store) is not None, what="first report")
    first = store.remove_endpoint(ENDPOINT)
    again = store.add_endpoint(EndpointConfig(address=ENDPOINT, models=["m"], agent=addr))
    assert first is not None and again is not first and again.node is None
    connects = w.connects[addr]
    w.add(again, addr)
    await eventually(lambda: again.node is not None, what="a report on the new object")
    assert w.connects[addr] == connects and w.agents == [addr]
