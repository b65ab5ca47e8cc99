"""Endpoints that come and go: the datastore's add / drain / remove, the discovery manager's
merge of source reports, and what a removed endpoint leaves behind (nothing)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extproc.config.loader import config_from_mapping
from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.overrides import set_override
from extproc.discovery.base import Discovered, DiscoverySource, Publish
from extproc.discovery.manager import Discovery
from extproc.prefix.sessions import session_key
from extproc.server.app import ExtProcApp

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def ep(addr: str, *models: str, **labels: str) -> EndpointConfig:
    return EndpointConfig(address=addr, models=list(models or ["m"]), labels=labels)


def test_add_update_and_remove_keep_the_model_index_in_step():
    store = Datastore([ep(A), ep(B)])
    added, removed = [], []
    store.on_added.append(lambda e: added.append(e.address))
    store.on_removed.append(lambda e: removed.append(e.address))
    store.add_endpoint(ep(C, "m", "n", gpu="h100"))
    assert [e.address for e in store.for_model("m")] == [A, B, C]
    assert [e.address for e in store.for_model("n")] == [C]
    before = store.get(C)
    store.add_endpoint(ep(C, "n"))  # models changed: same endpoint, reindexed, no hook
    assert store.get(C) is before and store.get(C).labels == {}
    assert [e.address for e in store.for_model("m")] == [A, B]
    assert added == [C]
    assert store.remove_endpoint(C) is before
    assert store.for_model("n") == [] and store.get(C) is None and removed == [C]
    assert store.remove_endpoint(C) is None  # unknown: nothing happens twice


def test_a_list_handed_out_before_a_change_stays_as_it_was():
    store = Datastore([ep(A), ep(B)])
    pool = store.for_model("m")
    store.drain_endpoint(A)
    assert [e.address for e in pool] == [A, B]
    assert [e.address for e in store.for_model("m")] == [B]


def test_draining_stops_new_picks_and_removes_after_the_last_request():
    store = Datastore([ep(A), ep(B)])
    a = store.get(A)
    r1, r2 = store.reserve(a, 4, prompt_tokens=10), store.reserve(a)
    removed = []
    store.on_removed.append(lambda e: removed.append(e.address))
    assert store.drain_endpoint(A)
    assert a.draining and store.get(A) is a  # still listed: its requests are in flight
    assert [e.address for e in store.for_model("m")] == [B]
    assert [e.address for e in store.routable()] == [B]
    r1.mark_first_token()
    r1.release()
    assert store.get(A) is a and removed == []
    r2.release()
    assert store.get(A) is None and removed == [A]
    assert store.open_reservations == 0 and a.inflight == 0 and a.reserved_blocks == 0
    r2.release()  # idempotent after removal too
    assert removed == [A]


def test_drain_of_an_idle_endpoint_removes_it_at_once():
    store = Datastore([ep(A)])
    assert store.drain_endpoint(A) and store.get(A) is None
    assert not store.drain_endpoint(A)


def test_an_endpoint_back_before_its_drain_ended_keeps_its_state():
    store = Datastore([ep(A)])
    a = store.get(A)
    r = store.reserve(a)
    store.drain_endpoint(A)
    store.add_endpoint(ep(A))
    assert store.get(A) is a and not a.draining and store.for_model("m") == [a]
    r.release()
    assert store.get(A) is a  # not removed: it is back


def test_a_reservation_on_an_endpoint_removed_and_added_again_releases_against_the_old_one():
    store = Datastore([ep(A)])
    old = store.get(A)
    r = store.reserve(old)
    store.remove_endpoint(A)  # forced (drain timeout)
    new = store.add_endpoint(ep(A))
    assert new is not old
    new_r = store.reserve(new)
    r.release()
    assert store.get(A) is new and new.inflight == 1 and old.inflight == 0
    new_r.release()


class FakeSource(DiscoverySource):
    """Publishes what the test tells it to (the real sources have their own tests)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.publish: Publish | None = None
        self.ready = asyncio.Event()

    async def run(self, publish: Publish) -> None:
        self.publish = publish
        self.ready.set()
        await asyncio.Event().wait()

    def report(self, endpoints: Mapping[str, Discovered]) -> None:
        assert self.publish is not None
        self.publish(endpoints)


def found(*addrs: str, ready: bool = True, model: str = "m") -> dict[str, Discovered]:
    return {a: Discovered(ep(a, model), ready) for a in addrs}


async def test_the_manager_merges_sources_and_drains_what_none_reports_as_ready():
    store = Datastore([])
    s1, s2 = FakeSource("one"), FakeSource("two")
    d = Discovery(store, [s1, s2], initial_wait_s=0.05)
    start = asyncio.create_task(d.start())
    await asyncio.wait_for(s1.ready.wait(), 10)
    await asyncio.wait_for(s2.ready.wait(), 10)
    s1.report(found(A, B))
    assert {e.address for e in store.all()} == {A, B}
    s1.report(found(A))  # s2 has not reported yet: B may be its own, so it stays
    assert store.get(B) is not None and not store.get(B).draining
    s2.report(found(B, C, model="n"))
    assert store.get(B).models == frozenset({"n"}) and store.get(C).models == frozenset({"n"})
    s1.report(found(A, B))  # an address both report: the first source's wins
    assert store.get(B).models == frozenset({"m"})
    held = store.reserve(store.get(C))
    s2.report({**found(B), **found(C, ready=False, model="n")})  # not ready: no new picks, in-flight finish
    assert store.get(C).draining and store.for_model("n") == []
    held.release()
    assert store.get(C) is None
    s1.report({})
    s2.report({})
    assert store.all() == []
    await start
    await d.aclose()


async def test_a_source_that_never_answers_keeps_nothing_from_being_drained_only_until_start_gives_up():
    store = Datastore([ep(A)])
    s1, silent = FakeSource("one"), FakeSource("silent")
    d = Discovery(store, [s1, silent], initial_wait_s=0.2)
    start = asyncio.create_task(d.start())
    await asyncio.wait_for(s1.ready.wait(), 10)
    s1.report(found(B))
    assert store.get(A) is not None  # the silent source might report A
    await start  # gave up waiting: the wanted set is what has been reported
    assert store.get(A) is None and store.get(B) is not None
    await d.aclose()


def test_a_drain_past_its_deadline_removes_the_endpoint_with_requests_still_in_flight():
    store = Datastore([ep(A), ep(B)])
    d = Discovery(store, [], drain_timeout_s=10.0)
    r = store.reserve(store.get(A))
    store.drain_endpoint(A, now=100.0)
    assert d.expire_drains(now=105.0) == 0 and store.get(A) is not None
    assert d.expire_drains(now=110.0) == 1 and store.get(A) is None
    r.release()  # the detached endpoint's accounting still balances
    assert store.open_reservations == 0


def _series_with(registry: CollectorRegistry, address: str) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if not line.startswith("#") and re.search(rf'"{re.escape(address)}"', line)]


def test_a_removed_endpoint_leaves_every_index_and_metric_series():
    cfg = config_from_mapping(
        {
            "models": [{"name": "m", "path": "builtin:qwen3-8b"}],
            "endpoints": [{"address": A, "models": ["m"]}, {"address": B, "models": ["m"]}],
        }
    )
    app = ExtProcApp(cfg)
    m = app.metrics
    a = app.store.get(A)
    # State under A's address in every place that keeps some, as traffic leaves it.
    app.prefix.index.add(A, [1, 2, 3])
    app.prefix.sessions.bind(session_key("conversation-1"), A, 0.0)
    app.prefix.reset(A, "restart")
    app.prefix._stats(A)
    app.prefix.warmer._warmed[(A, 7)] = None
    m.child(m.endpoint_routed, A).inc()
    m.child(m.endpoint_ejections, A).inc()
    m.endpoint_healthy.labels(A).set(1)
    m.endpoint_metrics_age.labels(A).set(0.1)
    m.endpoint_weight.labels(A).set(0.5)
    m.endpoint_score.labels(A, "queue").set(0.5)
    m.endpoint_override_factor.labels(A).set(0.5)
    m.scrape_seconds.labels(A).observe(0.01)
    m.scrape_errors.labels(A).inc()
    app.telemetry.backpressure.labels(A).set(1)
    app.telemetry.ttft.labels("m", A).observe(0.2)
    a.prefill_fit.add(1000, 0.5, 1.0)
    a.ejected_until, a.ejections = 1e12, 3
    set_override(a, 0.5, 60, reason="test", source="api")
    m.child(m.endpoint_routed, B).inc()
    assert len(_series_with(m.registry, A)) >= 12

    assert app.store.drain_endpoint(A)

    assert app.store.get(A) is None
    assert _series_with(m.registry, A) == []
    assert not any(k == A or (isinstance(k, tuple) and A in k) for children in m._children.values() for k in children)
    assert app.prefix.index.blocks(A) == 0 and app.prefix.sessions.count_for(A) == 0 and A not in app.prefix.stats
    assert not any(key[0] == A for key in app.prefix.warmer._warmed)
    assert _series_with(m.registry, B)  # the other endpoint's series stay
    back = app.store.add_endpoint(EndpointConfig(address=A, models=["m"]))
    # Back with nothing learned or imposed before: speeds, ejections, overrides start afresh.
    assert back is not a and back.prefill_fit.samples == 0 and back.ejections == 0 and back.override is None
    assert back.stream_stats is not None
    assert 'llm_extproc_endpoint_inflight_requests{endpoint="10.0.0.1:8000"} 0.0' in generate_latest(m.registry).decode()


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"models": [{"name": "m", "path": "builtin:qwen3-8b"}]}, "at least one endpoint"),
        ({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "endpoints": [{"address": A, "models": ["m"]}], "discovery": {"sources": [{"type": "dns", "name": "x", "port": 80, "models": ["m"]}]}}, "static source's list"),
        ({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [{"type": "dns", "name": "x", "port": 80, "models": ["n"]}]}}, "discovery.sources[0].models: 'n'"),
        ({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [{"type": "dsn"}]}}, "did you mean 'dns'"),
        ({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [{"type": "dns", "name": "x", "port": 0, "models": ["m"]}]}}, "port"),
        ({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [{"type": "dns", "name": "x", "port": 80, "models": ["m"], "nameservers": ["dns.example"]}]}}, "IP address"),
    ],
)
def test_discovery_configuration_errors_name_the_problem(raw, message):
    from extproc.config.loader import ConfigError

    with pytest.raises(ConfigError) as exc:
        config_from_mapping(raw)
    assert message in str(exc.value)


def test_a_dns_only_configuration_needs_no_endpoint_list():
    cfg = config_from_mapping({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "discovery": {"sources": [{"type": "dns", "name": "vllm.test", "port": 8000, "models": ["m"]}]}})
    assert cfg.endpoints == [] and cfg.discovery.sources[0].type == "dns"
    assert ExtProcApp(cfg).store.all() == []


async def test_a_source_that_keeps_failing_backs_off_and_logs_its_traceback_once(monkeypatch, caplog):
    # A source failing at once was restarted every second for ever, a traceback each time.
    import logging

    from extproc.discovery import manager

    monkeypatch.setattr(manager, "RESTART_INITIAL_S", 0.01)
    monkeypatch.setattr(manager, "RESTART_MAX_S", 0.2)

    class Broken(DiscoverySource):
        name = "broken"
        runs = 0

        async def run(self, publish: Publish) -> None:
            Broken.runs += 1
            raise RuntimeError("bug in a source")

    caplog.set_level(logging.ERROR, logger="extproc.discovery.manager")
    d = Discovery(Datastore([]), [Broken()], initial_wait_s=0.01)
    await d.start()
    try:
        await asyncio.sleep(1.0)
    finally:
        await d.aclose()
    # Restarted again and again, ever more slowly (capped at 0.2 s here: 5-15 in a second).
    assert 4 <= Broken.runs <= 20, Broken.runs
    tracebacks = [r for r in caplog.records if "failed; restarting" in r.getMessage()]
    assert len(tracebacks) == 1 and tracebacks[0].exc_info is not None
