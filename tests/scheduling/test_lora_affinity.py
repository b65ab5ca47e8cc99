"""`lora-affinity-scorer` (residency tiers, the spread rule) and the activity-only comparison rule."""

from __future__ import annotations

import dataclasses
import random
import time

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.lora import LoraMetrics, SentAdapters
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.registry import build
from extproc.types import LLMRequest, RequestKind, TokenCount
from tests.scheduling.conftest import engine


def _store(n: int = 3) -> Datastore:
    return Datastore([EndpointConfig(address=f"10.0.0.{i}:8000", models=["m"]) for i in range(1, n + 1)])


def _ctx(adapter: str | None, slots: int = 2) -> SchedulingContext:
    req = LLMRequest(kind=RequestKind.CHAT, model=adapter or "m", served_model="m", prompt_tokens=TokenCount(100), adapter=adapter)
    return SchedulingContext(req, 28, 16, time.monotonic(), random.Random(1), lora_max_loras=slots)


def _with_lora(ep, lora: LoraMetrics | None) -> None:
    ep.engine = dataclasses.replace(engine(), lora=lora)


def test_tiers_order_gpu_cpu_free_evictable_full():
    eps = _store(5).all()
    _with_lora(eps[0], LoraMetrics("residency", gpu=frozenset({"a"}), max_gpu=2))
    _with_lora(eps[1], LoraMetrics("residency", cpu=frozenset({"a"}), gpu=frozenset({"x", "y"}), running=frozenset({"x", "y"}), max_gpu=2))
    _with_lora(eps[2], LoraMetrics("residency", gpu=frozenset({"x"}), max_gpu=2))
    _with_lora(eps[3], LoraMetrics("residency", gpu=frozenset({"x", "y"}), running=frozenset({"x"}), max_gpu=2))
    _with_lora(eps[4], LoraMetrics("residency", gpu=frozenset({"x", "y"}), running=frozenset({"x", "y"}), max_gpu=2))
    scorer = build("lora-affinity-scorer", {})
    assert scorer.score(_ctx("a"), eps) == [1.0, 0.7, 0.6, 0.3, 0.0]
    assert scorer.score(_ctx(None), eps) == [1.0] * 5  # the base model needs no slot


def test_idle_adapter_on_an_old_metric_engine_is_found_by_the_routers_memory():
    eps = _store(2).all()
    for ep in eps:
        _with_lora(ep, LoraMetrics("activity", max_gpu=2))  # nothing running: the old metric is empty
    eps[1].lora_sent = SentAdapters()
    eps[1].lora_sent.note("a", time.monotonic())
    assert build("lora-affinity-scorer", {}).score(_ctx("a"), eps) == [0.6, 1.0]
    # GIE's activity-only rule cannot tell them apart (llm-d-router #2605)
    assert build("lora-activity-scorer", {}).score(_ctx("a"), eps) == [0.8, 0.8]


def test_activity_rule_scores():
    eps = _store(3).all()
    _with_lora(eps[0], LoraMetrics("activity", running=frozenset({"a"}), max_gpu=1))
    _with_lora(eps[1], LoraMetrics("activity", running=frozenset({"b"}), max_gpu=1))
    _with_lora(eps[2], LoraMetrics("activity", max_gpu=1))
    assert build("lora-activity-scorer", {}).score(_ctx("a"), eps) == [1.0, 0.0, 0.8]


def test_spread_rule_lets_a_hot_adapter_load_where_there_is_room_and_keeps_cold_ones_packed():
    eps = _store(4).all()
    now = time.monotonic()
    for ep in eps:
        _with_lora(ep, LoraMetrics("residency", max_gpu=4))
        ep.lora_sent = SentAdapters()
    eps[0].engine = dataclasses.replace(eps[0].engine, lora=LoraMetrics("residency", gpu=frozenset({"hot", "cold"}), max_gpu=4))
    for _ in range(36):  # "hot" has 36 of 48 recent requests: 3 endpoints' fair share (12 each)
        eps[0].lora_sent.note("hot", now)
    for ep in eps[1:]:
        for _ in range(4):
            ep.lora_sent.note("other", now)
    scorer = build("lora-affinity-scorer", {})
    ctx = _ctx("hot", slots=4)
    ctx.now = now
    assert scorer.score(ctx, eps) == [1.0, 1.0, 1.0, 1.0]  # free slots count as loaded: load scorers decide
    ctx = _ctx("cold", slots=4)
    ctx.now = now
    assert scorer.score(ctx, eps) == [1.0, 0.6, 0.6, 0.6]  # a cold adapter stays where it is
    # the spread stops once the hot adapter is loaded on the endpoints its traffic fills
    for ep in eps[1:3]:
        ep.engine = dataclasses.replace(ep.engine, lora=LoraMetrics("residency", gpu=frozenset({"hot"}), max_gpu=4))
    ctx = _ctx("hot", slots=4)
    ctx.now = now
    assert scorer.score(ctx, eps) == [1.0, 1.0, 1.0, 0.6]
    # every slot taken (more adapters than slots): an idle adapter's slot is room for a hot one,
    # never a slot every running adapter needs
    eps[1].engine = dataclasses.replace(eps[1].engine, lora=LoraMetrics("residency", gpu=frozenset("abcd"), running=frozenset("a"), max_gpu=4))
    eps[2].engine = dataclasses.replace(eps[2].engine, lora=LoraMetrics("residency", gpu=frozenset("abcd"), running=frozenset("abcd"), max_gpu=4))
    assert scorer.score(ctx, eps) == [1.0, 1.0, 0.0, 1.0]
