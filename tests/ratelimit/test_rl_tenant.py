"""Tenant identity: trusted header, hashed API keys, anonymous; keys never in ids or labels."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from extproc.ratelimit.config import RateLimitConfig
from extproc.ratelimit.tenant import TenantResolver, key_digest

KEY = "sk-live-0123456789abcdef"


def _cfg(**kw) -> RateLimitConfig:
    return RateLimitConfig(enabled=True, **kw)


def test_bearer_key_of_a_named_tenant():
    r = TenantResolver(_cfg(tenants={"acme": {"api_key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "tokens_per_minute": 10}}))
    t = r.resolve({"authorization": f"Bearer {KEY}"})
    assert (t.id, t.label, t.named, t.limits.tokens_per_minute) == ("acme", "acme", True, 10)
    assert r.resolve({"x-api-key": KEY}).id == "acme"


def test_unknown_key_is_its_own_tenant_known_by_hash_only():
    r = TenantResolver(_cfg(unknown_api_keys="per_key", default={"tokens_per_minute": 5}))
    t = r.resolve({"authorization": f"bearer {KEY}"})
    digest = key_digest(KEY)
    assert t.id == f"key:{digest}" and t.label == f"key-{digest[:8]}" and not t.named
    assert KEY not in t.id and KEY not in t.label
    assert t.limits.tokens_per_minute == 5
    assert r.resolve({"authorization": f"Bearer {KEY}"}).id == t.id
    assert r.resolve({"authorization": "Bearer other"}).id != t.id


def test_trusted_header_only_when_configured():
    hdrs = {"x-llm-tenant": "acme", "authorization": f"Bearer {KEY}"}
    untrusted = TenantResolver(_cfg(unknown_api_keys="per_key", tenants={"acme": {"tokens_per_minute": 10}}))
    assert untrusted.resolve(hdrs).id.startswith("key:")
    trusted = TenantResolver(_cfg(tenant_header="X-LLM-Tenant", tenants={"acme": {"tokens_per_minute": 10}}))
    assert trusted.resolve(hdrs).id == "acme"
    other = trusted.resolve({"x-llm-tenant": "beta"})
    assert other.id.startswith("hdr:") and other.label.startswith("hdr-") and not other.named


def test_anonymous_tenant():
    r = TenantResolver(_cfg(default={"requests_per_minute": 3}))
    t = r.resolve({})
    assert (t.id, t.label, t.limits.requests_per_minute) == ("anonymous", "anonymous", 3)
    r = TenantResolver(_cfg(anonymous_tenant="public", tenants={"public": {"requests_per_minute": 1}}))
    assert r.resolve({"authorization": "   "}).limits.requests_per_minute == 1


def test_unknown_keys_share_one_budget_by_default():
    digest = key_digest(KEY)
    r = TenantResolver(_cfg(default={"tokens_per_minute": 5}, tenants={"acme": {"api_key_sha256": [digest], "tokens_per_minute": 10}}))
    made_up = [r.resolve({"authorization": f"Bearer sk-random-{i}"}) for i in range(5)] + [r.resolve({"x-api-key": "another"})]
    assert {t.id for t in made_up} == {"unknown-keys"} and made_up[0].limits.tokens_per_minute == 5
    assert r.resolve({"authorization": f"Bearer {KEY}"}).id == "acme"  # listed keys keep their tenant
    assert r.resolve({}).id == "anonymous"  # no key: still the anonymous tenant, a budget of its own
    assert "unknown-keys" in {t.id for t in r.named}  # the admin API shows the group
    # The group takes its own limits when named under `tenants`.
    r = TenantResolver(_cfg(default={"tokens_per_minute": 5}, tenants={"unknown-keys": {"tokens_per_minute": 50, "max_concurrent_requests": 2}}))
    t = r.resolve({"authorization": "Bearer whatever"})
    assert (t.id, t.limits.tokens_per_minute, t.limits.max_concurrent_requests) == ("unknown-keys", 50, 2)


def test_unknown_keys_can_be_the_anonymous_tenant():
    r = TenantResolver(_cfg(unknown_api_keys="anonymous", anonymous_tenant="public", tenants={"public": {"requests_per_minute": 7}}))
    t = r.resolve({"authorization": "Bearer sk-made-up"})
    assert t is r.resolve({}) and (t.id, t.limits.requests_per_minute) == ("public", 7)


def test_labels_are_capped():
    r = TenantResolver(_cfg(unknown_api_keys="per_key", max_tenant_labels=2))
    labels = [r.resolve({"x-api-key": f"k{i}"}).label for i in range(4)]
    assert labels[:2] == [f"key-{key_digest('k0')[:8]}", f"key-{key_digest('k1')[:8]}"]
    assert labels[2:] == ["other", "other"]
    assert r.resolve({"x-api-key": "k0"}).label == labels[0]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"tenants": {"a": {"api_key_sha256": [KEY]}}}, "64 lower-case hex"),
        ({"buckets": 7}, "divide 60000"),
        ({"default": {"tokens_per_minute": 0}}, "greater than or equal to 1"),
        ({"tenants": {"a": {"api_key_sha256": ["a" * 64]}, "b": {"api_key_sha256": ["a" * 64]}}}, "already listed"),
        ({"backend": "etcd"}, "backend"),
        ({"surprise": 1}, "surprise"),
        ({"default": {"burst_tokens": 100}}, "set tokens_per_minute too"),
        ({"default": {"max_concurrent_requests": 0}}, "greater than or equal to 1"),
        ({"unknown_api_keys": "trust"}, "unknown_api_keys"),
    ],
)
def test_bad_config_is_a_clear_error(raw, needle):
    with pytest.raises(ValidationError) as exc:
        RateLimitConfig(**raw)
    assert needle in str(exc.value)
