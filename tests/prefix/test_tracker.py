from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest

from extproc.config.schema import PrefixConfig
from extproc.datastore.endpoints import Endpoint
from extproc.datastore.scraper import EngineMetrics
from extproc.prefix.sessions import SessionTable, session_key
from extproc.prefix.tracker import PrefixMetrics, PrefixTracker
from extproc.types import LLMRequest, RequestKind


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _req(ids: list[int]) -> LLMRequest:
    return LLMRequest(kind=RequestKind.CHAT, model="m", prompt_tokens=len(ids), token_ids=ids)


def _tracker(**cfg) -> tuple[PrefixTracker, list[Endpoint], CollectorRegistry, Clock]:
    reg = CollectorRegistry()
    clock = Clock()
    tr = PrefixTracker(PrefixConfig(**cfg), PrefixMetrics(reg), clock, registry=reg)
    return tr, [Endpoint(f"127.0.0.1:{9000 + i}", frozenset({"m"})) for i in range(3)], reg, clock


def test_a_pick_counts_at_once_and_short_matches_count_as_none():
    tr, (a, b, _), _, _ = _tracker()
    ids = [random.Random(1).randrange(150_000) for _ in range(1000)]
    m = tr.lookup(_req(ids), [a, b], lambda ep: 16)
    assert m is not None and m.matched == {}
    tr.on_pick(a, 16, m, None)
    m2 = tr.lookup(_req(ids), [a, b], lambda ep: 16)
    assert m2.matched == {a.address: 62} and m2.uncached_tokens(a.address) == 1000 - 62 * 16
    # a 100-token prompt sharing 6 blocks with it: under min_match_tokens (128), no affinity
    assert tr.lookup(_req(ids[:100]), [a, b], lambda ep: 16).matched == {}
    assert tr.lookup(_req(ids[:10]), [a, b], lambda ep: 16) is None  # no full block at all
    assert tr.lookup(LLMRequest(kind=RequestKind.CHAT, model="m", prompt_tokens=500), [a], lambda ep: 16) is None  # estimated: no ids


def test_an_engine_restart_or_capacity_bounds_the_index():
    tr, (a, _, _), reg, _ = _tracker()
    ids = list(range(4000))
    tr.on_pick(a, 16, tr.lookup(_req(ids), [a], lambda ep: 16), None)
    assert tr.index.blocks(a.address) == 249
    a.engine = EngineMetrics(num_gpu_blocks=100, block_size=16, prefix_queries=5000, prefix_hits=1000)
    tr.on_scrape(a)
    assert tr.index.blocks(a.address) == 100  # the engine cannot hold more than its pool
    a.engine = EngineMetrics(num_gpu_blocks=100, block_size=16, prefix_queries=9000, prefix_hits=3000)
    tr.on_scrape(a)
    assert tr.describe(a)["engine_hit_rate"] == 0.5 and tr.index.blocks(a.address) == 100
    a.engine = EngineMetrics(num_gpu_blocks=100, block_size=16, prefix_queries=10, prefix_hits=0)
    tr.on_scrape(a)  # counters went backwards: restarted, its cache is empty
    assert tr.index.blocks(a.address) == 0 and tr.describe(a)["resets"] == 1
    assert 'llm_extproc_prefix_index_resets_total{endpoint="127.0.0.1:9000",reason="restart"} 1.0' in generate_latest(reg).decode()


def test_an_endpoint_leaving_drops_its_entries_sessions_and_metric_labels():
    tr, (a, b, _), reg, _ = _tracker()
    key = tr.session_of("conv-9", None)
    tr.on_pick(a, 16, tr.lookup(_req(list(range(800))), [a, b], lambda ep: 16), key)
    assert tr.session_endpoint(key) == a.address
    assert a.address in generate_latest(reg).decode()
    tr.drop_endpoint(a.address)
    assert tr.index.blocks(a.address) == 0 and tr.session_endpoint(key) is None
    assert a.address not in generate_latest(reg).decode()


def test_sessions_come_from_the_header_or_the_user_and_are_kept_hashed():
    tr, (a, b, _), _, clock = _tracker(session_ttl_s=60)
    assert tr.session_of(None, None) is None and tr.session_of("", "") is None
    assert tr.session_of("s1", "alice") == tr.session_of("s1", None)  # the header wins
    by_user = tr.session_of(None, "alice")
    assert by_user is not None and b"alice" not in by_user
    tr.on_pick(b, 16, None, by_user)
    assert tr.session_endpoint(by_user) == b.address
    clock.now += 61
    assert tr.session_endpoint(by_user) is None  # expired
    off, *_ = _tracker(session_from_user=False)
    assert off.session_of(None, "alice") is None


def test_session_table_is_lru_bounded():
    t = SessionTable(max_sessions=2, ttl_s=10)
    for i, k in enumerate((b"a", b"b", b"c")):
        t.bind(k, f"ep{i}", 0.0)
    assert len(t) == 2 and t.get(b"a", 1.0) is None and t.get(b"c", 1.0) == "ep2"


def test_hot_prefix_seeding_is_counted():
    tr, (a, b, _), reg, clock = _tracker(hot={"min_count": 2})
    system = list(range(3000))
    sample = reg.get_sample_value
    for i in range(4):
        ids = system + [100_000 + i] * 40
        tr.on_pick(a, 16, tr.lookup(_req(ids), [a, b], lambda ep: 16), None)
    # the 1st shares nothing yet; the 2nd and 3rd share the system prompt (2 in the window: hot);
    # the 4th is hot and sent where it is warm
    assert sample("llm_extproc_prefix_hot_hits_total") == 1.0
    ids = system + [200_000] * 40
    tr.on_pick(b, 16, tr.lookup(_req(ids), [a, b], lambda ep: 16), None)  # a cold endpoint seeded
    assert sample("llm_extproc_prefix_hot_seeded_total") == 1.0
    hottest = tr.summary()["hot_prefixes"]
    assert hottest and hottest[0]["requests"] == 4 and hottest[0]["tokens"] == 187 * 16
    clock.now += 61  # the window slid past them: nothing is hot any more
    assert tr.summary()["hot_prefixes"] == []


def test_sessions_per_endpoint_are_counted_as_bindings_change(monkeypatch):
    # count_for used to scan the whole table: the admin API asks it for every endpoint, so 100k
    # sessions × 256 endpoints held the event loop for 3 s. Now a count kept up to date.
    import random

    rng = random.Random(7)
    t = SessionTable(max_sessions=50, ttl_s=5)
    eps = [f"10.0.0.{i}:8000" for i in range(4)]
    for step in range(3000):
        now = step * 0.01
        key = session_key(str(rng.randrange(80)))
        op = rng.random()
        if op < 0.6:
            t.bind(key, rng.choice(eps), now)
        elif op < 0.98:
            t.get(key, now + rng.choice([0, 10]))  # sometimes expired
        else:
            t.drop_endpoint(rng.choice(eps))
        truth = {ep: sum(1 for a, _ in t._table.values() if a == ep) for ep in eps}
        assert {ep: t.count_for(ep) for ep in eps} == truth
    monkeypatch.setattr(t, "_table", None)  # no scan left in count_for
    assert sum(t.count_for(ep) for ep in eps) == sum(truth.values())
