"""LoRA state of endpoints: both vLLM metric generations parsed, the router's own memory of the
adapters it sent, the residency tiers that follow, and adapters learned from the engines."""

from __future__ import annotations

import pytest

from extproc.datastore.engine_check import listed_adapters
from extproc.datastore.lora import AdapterNames, LoraMetrics, SentAdapters, residency_tier
from extproc.datastore.scraper import parse_vllm_metrics

ACTIVITY = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7000000001e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="c",waiting_lora_adapters="d"} 1.7000000009e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7000000005e+09
"""

RESIDENCY = """# TYPE vllm:lora_adapter_loaded gauge
vllm:lora_adapter_loaded{adapter_name="a",level="gpu",pinned="false",rank="16"} 1.0
vllm:lora_adapter_loaded{adapter_name="b",level="cpu",pinned="false",rank="16"} 1.0
# TYPE vllm:num_gpu_loaded_lora_adapters gauge
vllm:num_gpu_loaded_lora_adapters 1.0
# TYPE vllm:max_gpu_lora_adapters gauge
vllm:max_gpu_lora_adapters 2.0
"""


def test_activity_generation_takes_the_newest_series_by_its_timestamp_value():
    lora = parse_vllm_metrics(ACTIVITY).lora
    assert lora == LoraMetrics("activity", running=frozenset({"c"}), waiting=frozenset({"d"}), max_gpu=4)


def test_residency_generation_reads_levels_and_slots():
    lora = parse_vllm_metrics(RESIDENCY).lora
    assert lora is not None and lora.generation == "residency"
    assert lora.gpu == {"a"} and lora.cpu == {"b"} and lora.max_gpu == 2


def test_no_lora_metrics_is_none():
    assert parse_vllm_metrics("vllm:num_requests_running 1\n").lora is None


def test_residency_tiers_from_the_engines_own_word():
    lora = parse_vllm_metrics(RESIDENCY).lora
    assert residency_tier("a", lora, None, 0.0, 1) == "gpu"
    assert residency_tier("b", lora, None, 0.0, 1) == "cpu"
    assert residency_tier("z", lora, None, 0.0, 1) == "free"  # 1 of 2 slots used
    full = LoraMetrics("residency", gpu=frozenset({"a", "b"}), running=frozenset({"a"}), max_gpu=2)
    assert residency_tier("z", full, None, 0.0, 1) == "evictable"  # b is idle
    busy = LoraMetrics("residency", gpu=frozenset({"a", "b"}), running=frozenset({"a", "b"}), max_gpu=2)
    assert residency_tier("z", busy, None, 0.0, 1) == "full"


def test_activity_metric_alone_misses_an_idle_loaded_adapter_the_router_remembers():
    # llm-d-router #2605: nothing running, so the old metric says nothing is loaded.
    idle = LoraMetrics("activity", max_gpu=2)
    assert residency_tier("a", idle, None, 100.0, 1) == "free"
    sent = SentAdapters()
    sent.note("a", 90.0)
    sent.note("b", 95.0)
    assert residency_tier("a", idle, sent, 100.0, 1) == "gpu"
    # the engine's LRU holds 2: a third adapter sent later pushes the oldest out of the guess
    sent.note("c", 99.0)
    assert residency_tier("a", idle, sent, 100.0, 1) == "evictable"
    # the memory decays: long after, nothing is believed loaded
    assert residency_tier("c", idle, sent, 99.0 + 3600, 1) == "free"


def test_sent_counts_decay_and_stay_bounded():
    sent = SentAdapters()
    for _ in range(4):
        sent.note("a", 0.0)
    assert sent.rate("a", 0.0) == pytest.approx(4.0)
    assert sent.rate("a", 30.0) == pytest.approx(2.0)  # one half-life
    for i in range(300):
        sent.note(f"x{i}", 1.0)
    assert len(sent.entries) == 256 and "a" not in sent.entries
    # The running total is the remembered adapters' rates summed, evictions and decay included.
    for t in (1.0, 45.0, 600.0):
        assert sent.total(t) == pytest.approx(sum(sent.rate(n, t) for n in sent.entries), rel=1e-9)


def test_adapter_names_configured_learned_and_bounded_labels():
    names = AdapterNames({"sql": "base"}, reserved={"base", "alias"}, learning={"base"}, max_learned=2)
    assert names.base_of("sql") == "base" and names.base_of("x") is None
    assert not names.learn("alias", "base")  # a model name is never an adapter
    assert not names.learn("y", "other-model")  # that model does not learn
    assert names.can_learn and not AdapterNames({}, reserved=set(), learning=set()).can_learn
    assert names.learn("x", "base") and names.learn("y", "base") and not names.learn("z", "base")
    assert not names.can_learn  # full: an unknown name no longer scans the endpoints
    assert names.base_of("x") == "base"
    assert [names.label(a) for a in ("sql", "x", None)] == ["sql", "other", ""]


def test_v1_models_listing_gives_adapters_with_their_parent():
    listing = {"data": [{"id": "base", "parent": None}, {"id": "sql", "parent": "base"}, {"id": 3, "parent": "base"}, "junk"]}
    assert listed_adapters(listing) == {"sql": "base"}
    assert listed_adapters(["not", "a", "listing"]) == {}


def test_config_adapters_must_not_collide_with_model_names():
    from extproc.config.loader import config_from_mapping
    from extproc.config.loader import ConfigError

    base = {"name": "Qwen/Qwen3-8B", "aliases": ["qwen"], "adapters": ["sql-lora", "chat-lora"]}
    cfg = config_from_mapping({"models": [base], "endpoints": [{"address": "127.0.0.1:1", "models": ["Qwen/Qwen3-8B"]}]}, env={})
    assert cfg.models[0].adapters == ["sql-lora", "chat-lora"] and cfg.models[0].learn_adapters
    for bad in (["qwen"], ["x", "x"], [" x"]):
        with pytest.raises(ConfigError):
            config_from_mapping({"models": [{**base, "adapters": bad}], "endpoints": [{"address": "127.0.0.1:1", "models": ["Qwen/Qwen3-8B"]}]}, env={})
