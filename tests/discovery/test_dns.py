"""DNS discovery against a real DNS server (dnsmasq): records added, removed, changed, the
name gone, and the server down then back; answers dnsmasq cannot give (YXDOMAIN) from a
scripted UDP server built on dnspython's own message code."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
import pytest_asyncio

from extproc.datastore.endpoints import Datastore
from extproc.discovery.dns import Params, ResolverDown, Source
from extproc.discovery.manager import Discovery
from tests.agent.agent_helpers import eventually
from tests.discovery.dnsmasq import DNSMASQ, Dnsmasq


NAME = "vllm.svc.test"


@pytest.fixture
def dnsmasq(tmp_path: Path):
    if not Path(DNSMASQ).exists():
        pytest.skip("dnsmasq is not installed (apt-get install dnsmasq)")
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


class ScriptedDns(asyncio.DatagramProtocol):
    """A UDP DNS server on 127.0.0.1 answering every A query with `ips`, or with `rcode` when
    set (YXDOMAIN, REFUSED: answers dnsmasq does not give for a name it serves)."""

    def __init__(self) -> None:
        self.ips: list[str] = []
        self.rcode: int | None = None
        self.refuse_aaaa = False  # REFUSED for AAAA only, as dnsmasq without --local answers
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram endpoint's

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        reply = dns.message.make_response(query)
        question = query.question[0]
        if self.rcode is not None:
            reply.set_rcode(self.rcode)
        elif self.refuse_aaaa and question.rdtype == dns.rdatatype.AAAA:
            reply.set_rcode(dns.rcode.REFUSED)
        elif question.rdtype == dns.rdatatype.A and self.ips:
            reply.answer.append(dns.rrset.from_text_list(question.name, 5, "IN", "A", self.ips))
        assert self.transport is not None
        self.transport.sendto(reply.to_wire(), addr)


async def test_yxdomain_and_other_resolver_errors_keep_the_endpoints_and_do_not_crash_the_source(
    caplog: pytest.LogCaptureFixture,
):
    server = ScriptedDns()
    server.ips = ["10.0.0.1"]
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(lambda: server, local_addr=("127.0.0.1", 0))
    store = Datastore([])
    src = source(transport.get_extra_info("sockname")[1])
    d = Discovery(store, [src], initial_wait_s=5)
    try:
        await d.start()
        assert addresses(store) == {"10.0.0.1:8000"}
        for rcode in (dns.rcode.YXDOMAIN, dns.rcode.REFUSED):  # YXDOMAIN: used to end run()
            server.rcode = rcode
            failures = src.failures
            await eventually(lambda: src.failures >= failures + 3)
            assert addresses(store) == {"10.0.0.1:8000"}  # unknown is not empty
            server.rcode = None
            resolutions = src.resolutions
            await eventually(lambda: src.resolutions > resolutions)
        server.ips = ["10.0.0.2"]
        await eventually(lambda: addresses(store) == {"10.0.0.2:8000"})
    finally:
        await d.aclose()
        transport.close()
    assert "restarting" not in caplog.text  # the manager never had to restart the source
    down = [r.getMessage() for r in caplog.records if "no answer" in r.getMessage()]
    assert len(down) == 2 and "YXDOMAIN" in down[0]  # once per outage, naming the error


async def test_a_refused_aaaa_query_does_not_cost_the_a_records():
    # A server refusing AAAA (dnsmasq without --local) made the whole resolution fail: a new
    # user's fleet stayed empty though every A record was there.
    server = ScriptedDns()
    server.ips, server.refuse_aaaa = ["10.0.0.1"], True
    transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(lambda: server, local_addr=("127.0.0.1", 0))
    try:
        src = source(transport.get_extra_info("sockname")[1])
        assert await src.resolve() == ["10.0.0.1"]
        server.rcode = dns.rcode.REFUSED  # every type refused: unknown, not empty
        with pytest.raises(ResolverDown, match="A: .*AAAA: "):
            await src.resolve()
    finally:
        transport.close()


def test_a_name_that_is_not_a_dns_name_is_a_configuration_error():
    with pytest.raises(ValueError, match="not a DNS name"):
        Params(name="a" * 64 + ".svc", port=8000, models=["m"])
    with pytest.raises(ValueError, match="not a DNS name"):
        Params(name="vllm..svc", port=8000, models=["m"])


async def test_discovered_addresses_get_their_own_kv_event_sockets_and_agent(dnsmasq: Dnsmasq):
    dnsmasq.write({NAME: ["10.0.0.1", "fd00::3"]})
    store = Datastore([])
    sockets = {"kv_events": "tcp://{host}:5557", "kv_events_replay": "tcp://{host}:5558", "agent": "{host}:9100"}
    d = Discovery(store, [source(dnsmasq.port, **sockets)], initial_wait_s=5)
    await d.start()
    try:
        four, six = store.get("10.0.0.1:8000"), store.get("[fd00::3]:8000")
        assert (four.kv_events, four.kv_events_replay, four.agent) == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "10.0.0.1:9100")
        assert (six.kv_events, six.kv_events_replay, six.agent) == ("tcp://[fd00::3]:5557", "tcp://[fd00::3]:5558", "[fd00::3]:9100")
        dnsmasq.write({NAME: ["10.0.0.1", "10.0.0.7"]})  # a new pod: its own sockets
        await eventually(lambda: store.get("10.0.0.7:8000") is not None)
        assert store.get("10.0.0.7:8000").kv_events == "tcp://10.0.0.7:5557"
    finally:
        await d.aclose()
