"""DNS discovery against a real DNS server (dnsmasq): records added, removed, changed, the
name gone, and the server down then back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from extproc.datastore.endpoints import Datastore
from extproc.discovery.dns import Params, ResolverDown, Source
from extproc.discovery.manager import Discovery
from tests.agent.agent_helpers import eventually
from tests.discovery.dnsmasq import DNSMASQ, Dnsmasq

pytestmark = pytest.mark.skipif(not Path(DNSMASQ).exists(), reason="dnsmasq is not installed (apt-get install dnsmasq)")

NAME = "vllm.svc.test"


@pytest.fixture
def dnsmasq(tmp_path: Path):
    server = Dnsmasq(tmp_path)
    server.write({NAME: ["10.0.0.1", "10.0.0.2"]})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def source(port: int, **kw) -> Source:
    params = Params(name=NAME, port=8000, models=["m"], labels={"engine": "vllm"}, nameservers=[f"127.0.0.1:{port}"], interval_s=0.1, timeout_s=0.5, **kw)
    return Source(params)


@pytest_asyncio.fixture
async def fleet(dnsmasq: Dnsmasq) -> AsyncIterator[tuple[Datastore, Source, Dnsmasq]]:
    store = Datastore([])
    src = source(dnsmasq.port)
    d = Discovery(store, [src], initial_wait_s=5)
    await d.start()
    try:
        yield store, src, dnsmasq
    finally:
        await d.aclose()


def addresses(store: Datastore) -> set[str]:
    return {ep.address for ep in store.all()}


async def test_resolve_reads_a_and_aaaa_records(dnsmasq: Dnsmasq):
    dnsmasq.write({NAME: ["10.0.0.2", "10.0.0.1", "fd00::7"], "other.svc.test": ["10.9.9.9"]})
    assert await source(dnsmasq.port).resolve() == ["10.0.0.1", "10.0.0.2", "fd00::7"]
    assert await source(dnsmasq.port, record_types=["AAAA"]).resolve() == ["fd00::7"]


async def test_endpoints_follow_the_records(fleet):
    store, src, dns = fleet
    assert addresses(store) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    first = store.get("10.0.0.1:8000")
    assert first.models == frozenset({"m"}) and first.labels == {"engine": "vllm"}

    dns.write({NAME: ["10.0.0.1", "10.0.0.2", "10.0.0.3", "fd00::3"]})  # scale up
    await eventually(lambda: addresses(store) == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "[fd00::3]:8000"})
    assert store.get("10.0.0.1:8000") is first  # unchanged ones keep their state

    held = store.reserve(store.get("10.0.0.2:8000"))
    dns.write({NAME: ["10.0.0.1", "10.0.0.3", "fd00::3"]})  # 10.0.0.2 leaves with a request in flight
    await eventually(lambda: store.get("10.0.0.2:8000") is not None and store.get("10.0.0.2:8000").draining)
    assert "10.0.0.2:8000" not in {e.address for e in store.for_model("m")}
    held.release()
    assert store.get("10.0.0.2:8000") is None

    dns.write({NAME: ["10.0.0.1", "10.0.0.4", "fd00::3"]})  # a pod replaced: new IP
    await eventually(lambda: addresses(store) == {"10.0.0.1:8000", "10.0.0.4:8000", "[fd00::3]:8000"})

    dns.write({"other.svc.test": ["10.9.9.9"]})  # the name is gone (NXDOMAIN): scaled to zero
    await eventually(lambda: addresses(store) == set())


async def test_a_resolver_outage_keeps_the_endpoints_and_recovery_applies_the_new_records(fleet):
    store, src, dns = fleet
    port = dns.port
    dns.stop()
    failures = src.failures
    await eventually(lambda: src.failures >= failures + 2)
    assert addresses(store) == {"10.0.0.1:8000", "10.0.0.2:8000"}  # unknown is not empty
    with pytest.raises(ResolverDown):
        await source(port).resolve()
    dns.write({NAME: ["10.0.0.2", "10.0.0.5"]})
    dns.start(port)
    await eventually(lambda: addresses(store) == {"10.0.0.2:8000", "10.0.0.5:8000"})
