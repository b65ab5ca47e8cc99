"""KV-event subscriptions follow the endpoints the server has, however they came: an endpoint a
static-file reload adds with `kv_events` gets a subscriber (its engine's events reach the prefix
index), one whose publisher a reload changes is subscribed to the new one, and one that loses
`kv_events` is no longer precise; an endpoint a DNS source discovers gets the subscriber its
source's `kv_events` template names. The simulator's publisher stands in for the engines."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from extproc.config.loader import config_from_mapping, load_config
from extproc.pipeline.request import ModelRuntime
from extproc.server.app import ExtProcApp
from extproc.sim.kv_publisher import KVEventPublisher
from tests.discovery.dnsmasq import DNSMASQ, Dnsmasq
from tests.prefix.test_precise import OURS, PROMPT, stored

MODEL = "Qwen/Qwen3-8B"
A, B = "127.0.0.1:18041", "127.0.0.1:18042"  # nothing listens: health checks and scrapes are off


def write_config(path: Path, endpoints: list[dict]) -> None:
    """The configuration file, replaced whole (a new inode, as a ConfigMap swap does)."""
    raw = {
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "limits": {"shutdown_grace_s": 1},
        "models": [{"name": MODEL}],
        "endpoints": [{"models": [MODEL], **e} for e in endpoints],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}, "block_size": 16},
        "discovery": {"sources": [{"type": "static", "poll_interval_s": 0.05, "sighup": False}]},
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(raw))
    os.replace(tmp, path)


async def until(cond, what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not in time"
        await asyncio.sleep(0.02)


async def publish_until(publisher: KVEventPublisher, cond, what: str) -> None:
    """PUB/SUB joins in the background: publish the prompt's blocks until `cond` holds."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not in time"
        publisher.publish([stored([901, 902, 903, 904], None, PROMPT)])
        await asyncio.sleep(0.05)


async def test_a_discovered_endpoint_with_kv_events_gets_a_subscriber(qwen_counter, tmp_path: Path) -> None:
    first, second = KVEventPublisher("tcp://127.0.0.1:*"), KVEventPublisher("tcp://127.0.0.1:*")
    first.start()
    second.start()
    path = tmp_path / "llm-extproc.yaml"
    write_config(path, [{"address": A}])
    cfg = load_config(path)
    app = ExtProcApp(cfg, registry=CollectorRegistry(), models={m.name: ModelRuntime(m, qwen_counter) for m in cfg.models}, config_path=path)
    await app.start()
    try:
        assert app.kv_events.subscribers == []
        # A reload adds B with its engine's publisher: subscribed at once, its events indexed.
        write_config(path, [{"address": A}, {"address": B, "kv_events": first.endpoint}])
        await until(lambda: [s.address for s in app.kv_events.subscribers] == [B], "the subscription")
        assert app.store.get(B).kv_events == first.endpoint and B in app.prefix.precise
        await publish_until(first, lambda: app.prefix.index.match(OURS).get(B, 0) == 4, "B's blocks from the first publisher")
        # A reload points B at another publisher: the old subscription goes, the new one reads.
        write_config(path, [{"address": A}, {"address": B, "kv_events": second.endpoint}])
        await until(lambda: [s.endpoint for s in app.kv_events.subscribers] == [second.endpoint], "the new subscription")
        last = app.kv_events.indexer.last_seq(B)
        assert last is None, "a new publisher starts a new mirror"
        await publish_until(second, lambda: app.kv_events.indexer.last_seq(B) is not None, "an event from the second publisher")
        # A reload drops kv_events: no subscriber, B no longer precise.
        write_config(path, [{"address": A}, {"address": B}])
        await until(lambda: not app.kv_events.subscribers and B not in app.prefix.precise, "the unsubscription")
    finally:
        await app.aclose(grace_s=0)
        await first.aclose()
        await second.aclose()


async def test_an_endpoint_discovered_by_dns_subscribes_to_the_publisher_its_template_names(qwen_counter, tmp_path: Path) -> None:
    if not Path(DNSMASQ).exists():
        pytest.skip("dnsmasq is not installed (apt-get install dnsmasq)")
    publisher = KVEventPublisher("tcp://127.0.0.1:*")
    publisher.start()
    pub_port = publisher.endpoint.rsplit(":", 1)[1]
    dns = Dnsmasq(tmp_path)
    dns.write({"vllm.svc.test": ["127.0.0.1"]})
    dns.start()
    source = {
        "type": "dns", "name": "vllm.svc.test", "nameservers": [f"127.0.0.1:{dns.port}"], "interval_s": 0.1,
        "port": 18043, "models": [MODEL], "kv_events": f"tcp://{{host}}:{pub_port}",
    }  # fmt: skip
    cfg = config_from_mapping({
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "limits": {"shutdown_grace_s": 1},
        "models": [{"name": MODEL}],
        "scheduling": {"health_check": {"enabled": False}, "metrics": {"enabled": False}, "block_size": 16},
        "discovery": {"sources": [source]},
    })  # fmt: skip
    app = ExtProcApp(cfg, registry=CollectorRegistry(), models={m.name: ModelRuntime(m, qwen_counter) for m in cfg.models})
    await app.start()
    address = "127.0.0.1:18043"
    try:
        await until(lambda: [s.endpoint for s in app.kv_events.subscribers] == [publisher.endpoint], "the discovered endpoint's subscription")
        assert app.store.get(address).kv_events == publisher.endpoint and address in app.prefix.precise
        await publish_until(publisher, lambda: app.prefix.index.match(OURS).get(address, 0) == 4, "the discovered endpoint's blocks")
        dns.write({"other.svc.test": ["127.0.0.2"]})  # the name gone: the endpoint drains away, unsubscribed
        await until(lambda: not app.kv_events.subscribers and address not in app.prefix.precise, "the unsubscription")
    finally:
        await app.aclose(grace_s=0)
        await publisher.aclose()
        dns.stop()
