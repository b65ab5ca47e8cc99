"""Priority classes and saturation shedding: sheddable first, standard next, critical never."""

from __future__ import annotations

import time

import pytest

from extproc.admission.priority import check_shedding, fleet_saturation, parse_priority
from extproc.config.schema import EndpointConfig, PriorityConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.scraper import EngineMetrics
from extproc.errors import RateLimitedError, ValidationError

CFG = PriorityConfig()


@pytest.mark.parametrize(("value", "expected"), [(None, "standard"), ("", "standard"), ("critical", "critical"), (" Sheddable ", "sheddable")])
def test_parse_priority(value, expected):
    assert parse_priority(value, CFG) == expected


@pytest.mark.parametrize("value", ["urgent", "1", "critical;drop table", "\xff"])
def test_unknown_priority_is_400(value):
    with pytest.raises(ValidationError) as info:
        parse_priority(value, CFG)
    assert info.value.status == 400 and "x-llm-priority" in info.value.message


def test_saturation_from_engine_kv_and_queues():
    store = Datastore([EndpointConfig(address=f"10.0.0.{i}:1", models=["m"]) for i in (1, 2)])
    a, b = store.all()
    now = time.monotonic()
    a.engine = EngineMetrics(kv_usage=0.9, num_gpu_blocks=100, waiting=0, scraped_at=now)
    b.engine = EngineMetrics(kv_usage=0.5, num_gpu_blocks=100, waiting=64, scraped_at=now)
    # KV mean 0.7; queue mean (0 + 64/32)/2 = 1.0 → saturation 1.0
    assert fleet_saturation([a, b], 32) == pytest.approx(1.0)
    b.engine.waiting = 0
    store.reserve(a, 10)  # our reservations are real blocks: a at 1.0 effective
    assert fleet_saturation([a, b], 32) == pytest.approx(0.75)
    assert fleet_saturation([], 32) == 0.0


@pytest.mark.parametrize(
    ("saturation", "refused"),
    [(0.5, set()), (0.8, {"sheddable"}), (0.99, {"sheddable"}), (1.0, {"sheddable", "standard"}), (5.0, {"sheddable", "standard"})],
)
def test_shedding_order(saturation, refused):
    got = set()
    for cls in ("critical", "standard", "sheddable"):
        try:
            check_shedding(cls, saturation, CFG)
        except RateLimitedError as err:
            assert err.status == 429 and err.headers()["retry-after"] == "1"
            assert err.code == f"shed_{cls}"
            got.add(cls)
    assert got == refused
