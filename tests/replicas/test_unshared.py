"""`serve`'s warnings for one of several replicas without shared state (extproc.replicas.unshared)."""

from __future__ import annotations

import pytest

from extproc.config.loader import config_from_mapping
from extproc.replicas.unshared import REPLICAS_ENV, declared_replicas, unshared_state_warnings

MODEL = "Qwen/Qwen3-8B"
BASE = {"models": [{"name": MODEL}], "endpoints": [{"address": "127.0.0.1:9", "models": [MODEL]}]}
SYNC = {"replicas": {"sync": "redis"}}


def warnings(raw: dict, workers: int = 1, replicas: str | None = None) -> list[str]:
    env = {} if replicas is None else {REPLICAS_ENV: replicas}
    return unshared_state_warnings(config_from_mapping({**BASE, **raw}), workers, env)


def test_one_process_alone_is_not_warned():
    assert warnings({}) == [] and warnings({}, replicas="1") == [] and warnings({}, replicas="") == []


def test_several_workers_or_declared_pods_without_sync_are_warned_and_they_multiply():
    (w,) = warnings({}, workers=2)
    assert "one of 2 replicas (--workers 2) with replicas.sync off" in w and "replicas.sync: redis" in w
    (w,) = warnings({}, replicas="3")
    assert f"one of 3 replicas ({REPLICAS_ENV}=3)" in w
    (w,) = warnings({}, workers=2, replicas="3")
    assert f"one of 6 replicas (--workers 2 x {REPLICAS_ENV}=3)" in w
    assert warnings(SYNC, workers=2, replicas="3") == []


def test_per_replica_rate_limits_only_with_the_memory_backend_and_a_limit():
    limited = {"ratelimit": {"enabled": True, "tenants": {"a": {"models": {MODEL: {"tokens_per_minute": 9}}}}}, **SYNC}
    (w,) = warnings(limited, replicas="3")
    assert "rate limits are per replica" in w and "the effective limit is the configured one x 3" in w
    assert warnings(limited) == []
    assert warnings({"ratelimit": {"enabled": True}, **SYNC}, workers=3) == []
    shared = {"ratelimit": {"enabled": True, "backend": "redis", "default": {"requests_per_minute": 5}}, **SYNC}
    assert warnings(shared, workers=3) == []
    assert len(warnings({"ratelimit": {"enabled": True, "default": {"requests_per_minute": 5}}}, workers=3)) == 2


@pytest.mark.parametrize("value", ["0", "-2", "three", "2.5"])
def test_a_replica_count_that_is_not_a_positive_integer_is_refused_by_name(value: str):
    with pytest.raises(ValueError, match=REPLICAS_ENV):
        declared_replicas({REPLICAS_ENV: value})
