"""Priority classes and saturation shedding: sheddable first, standard next, critical never."""

from __future__ import annotations

import time

import pytest

from extproc.admission.priority import check_shedding, claim_priority, fleet_saturation, parse_priority
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


# ── claim bounds (issue 18, finding 5) ──────────────────────────────────────────────────────


@pytest.mark.parametrize("value", ["critical", "CRITICAL", "critical\t", " Critical "])
def test_client_claim_of_critical_is_downgraded_by_default(value):
    claim = claim_priority(value, CFG)
    assert (claim.priority, claim.claimed, claim.downgraded) == ("standard", "critical", True)


@pytest.mark.parametrize("value", ["standard", "SHEDDABLE", None, ""])
def test_claimable_classes_pass(value):
    claim = claim_priority(value, CFG)
    assert not claim.downgraded and claim.priority == parse_priority(value, CFG)


def test_trusted_header_may_claim_critical_and_wins():
    cfg = PriorityConfig(trusted_header="X-Trusted-Priority")
    assert cfg.trusted_header == "x-trusted-priority"
    assert claim_priority("sheddable", cfg, trusted_value="critical").priority == "critical"
    with pytest.raises(ValidationError):
        claim_priority(None, cfg, trusted_value="urgent")


def test_tenant_hook_extends_what_may_be_claimed():
    assert claim_priority("critical", CFG, extra_claimable=("critical",)).priority == "critical"


def test_reject_mode_refuses_with_400():
    cfg = PriorityConfig(on_unclaimable="reject")
    with pytest.raises(ValidationError) as info:
        claim_priority("CRITICAL", cfg)
    assert info.value.code == "priority_not_allowed" and info.value.status == 400


def test_downgrade_goes_to_the_highest_claimable_class_below():
    cfg = PriorityConfig(claimable=("sheddable",))
    assert claim_priority("critical", cfg).priority == "sheddable"
    assert claim_priority("standard", cfg).priority == "sheddable"


def test_trusted_header_must_differ_from_the_client_header():
    with pytest.raises(ValueError, match="trusted_header"):
        PriorityConfig(trusted_header="X-LLM-Priority")
