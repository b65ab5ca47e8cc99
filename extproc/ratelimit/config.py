"""Configuration of tenants and their token rate limits (`ratelimit:` in the config file).

Shape::

    ratelimit:
      enabled: true
      backend: memory            # or redis (limits shared by every replica)
      tenant_header: null        # e.g. x-llm-tenant, set by a trusted layer (auth filter)
      unknown_api_keys: shared    # or per_key (keys validated in front), anonymous
      default: {tokens_per_minute: 100000, requests_per_minute: 600,
                max_concurrent_requests: 16, burst_tokens: 20000}
      tenants:
        acme:
          api_key_sha256: ["<sha256 hex of the key>"]
          tokens_per_minute: 1000000
          max_concurrent_requests: 64
          models: {"Qwen/Qwen3-8B": {tokens_per_minute: 200000}}
      redis: {url: "redis://127.0.0.1:6379/0", on_error: open}
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from extproc.config_base import ConfigProblem, Strict, key_text, raise_problems

__all__ = ["LimitValues", "TenantConfig", "RedisConfig", "RateLimitConfig", "WINDOW_S"]

WINDOW_S = 60
"""The window is one minute: limits are tokens and requests per minute (OpenAI's TPM / RPM)."""

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class LimitValues(Strict):
    """Limits of one scope (a tenant, or a tenant on one model); None means unlimited.

    Attributes:
        tokens_per_minute: tokens charged in any 60 s window (see `RateLimitConfig.cost`).
        requests_per_minute: requests admitted in any 60 s window.
        max_concurrent_requests: requests in flight at once (admitted, not yet ended).
        burst_tokens: paces `tokens_per_minute`: a token bucket refilled at
            `tokens_per_minute / 60` tokens per second holding at most this many tokens, so the
            minute's allowance cannot arrive as one burst (decision 0190). Needs
            `tokens_per_minute`; a request costing more than the burst waits for a full bucket.
    """

    tokens_per_minute: int | None = Field(default=None, ge=1)
    requests_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    burst_tokens: int | None = Field(default=None, ge=1)

    @property
    def limited(self) -> bool:
        return self.tokens_per_minute is not None or self.requests_per_minute is not None or self.max_concurrent_requests is not None

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> LimitValues:
        if self.burst_tokens is not None and self.tokens_per_minute is None:
            raise ValueError("burst_tokens paces tokens_per_minute: set tokens_per_minute too")
        return self


class TenantConfig(LimitValues):
    """A named tenant.

    Attributes:
        api_key_sha256: SHA-256 digests (lower-case hex) of the API keys / bearer tokens that
            belong to this tenant (`printf %s "$KEY" | sha256sum`); keys never appear in clear.
        models: per-model limits (canonical model names) on top of the tenant's own.
    """

    api_key_sha256: list[str] = Field(default_factory=list)
    models: dict[str, LimitValues] = Field(default_factory=dict)

    @field_validator("api_key_sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        for i, h in enumerate(v):
            if not _SHA256.match(h):
                raise ValueError(f"api_key_sha256[{i}] must be 64 lower-case hex digits (a SHA-256 digest), not a key")
        return v


class RedisConfig(Strict):
    """The shared Redis backend.

    Attributes:
        url: `redis://host:port/db` (or `rediss://` for TLS, `unix:///path?db=N` for a socket;
            credentials in the URL are never logged). Checked with redis-py's own parser at load.
        key_prefix: prefix of every key (one hash per tenant scope, expiring by itself).
        timeout_ms: connect and command timeout (milliseconds); one decision is one round trip.
        on_error: `open` admits without counting while Redis is unreachable; `closed` refuses
            with 503. Either way a metric counts the failures and a log line says so (at most
            one per `log_interval_s`); the next request tries Redis again (no restart).
        log_interval_s: least seconds between two "Redis unreachable" log lines.
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "llm-extproc:rl:"
    timeout_ms: int = Field(default=50, ge=1)
    on_error: Literal["open", "closed"] = "open"
    log_interval_s: float = Field(default=10.0, gt=0)

    @field_validator("url")
    @classmethod
    def _redis_accepts(cls, v: str) -> str:
        # Parsed as the client will parse it (redis-py's own parser): a URL it refuses (port
        # 99999, http://) passed the config check and `serve` then died with a traceback when
        # the rate limiter or replica sync built its client.
        from redis.connection import parse_url

        try:
            port = parse_url(v).get("port")
        except ValueError as exc:
            reason = str(exc)
            if "@" in v and "cast to integer" in reason:  # redis-py quotes the "port", there a piece of the password
                reason = "its port is not a number; percent-encode any '/', '@', '#' or '?' in its user name or password"
            raise ValueError(f"not a Redis URL redis-py accepts: {reason}") from None
        if port == 0:
            raise ValueError("port 0 is not a port a Redis server listens on (1-65535)")
        return v


class RateLimitConfig(Strict):
    """Tenants and their token / request rate limits over a sliding one-minute window.

    Attributes:
        enabled: rate limiting at all (off: tenants are not even identified).
        backend: `memory` (per process) or `redis` (one limit across every replica).
        buckets: the window's resolution: 60 s in this many buckets (60 → 1 s; must divide
            60,000 ms evenly). A charge leaves the window 59–60 s after it was made.
        tenant_header: request header naming the tenant, set by a trusted layer in front of
            Envoy's ext_proc filter; None trusts no header. Envoy must remove a client's copy
            (envoy/*.yaml strip `x-llm-tenant`; strip yours likewise if you pick another name).
        api_key_headers: headers carrying an API key when no tenant header is set (first present
            wins; `authorization: Bearer <key>` reads the key). The tenant is then the configured
            one listing the key's SHA-256, else one per key, known only by its hash.
        anonymous_tenant: the tenant of requests with neither.
        unknown_api_keys: what an API key listed by no tenant is (decision 0191). `shared`
            (default): every such key is the one tenant `unknown_keys_tenant`, so random keys
            share one budget; `anonymous`: they are the anonymous tenant; `per_key`: each key is
            a tenant of its own with the `default` limits — only when a layer in front rejects
            keys it does not know, or anyone gets a fresh budget per made-up key.
        unknown_keys_tenant: the tenant of unknown keys under `shared`; give it its own limits
            by naming it under `tenants` (else `default` applies to the group).
        inflight_lease_s: how long a request counts against `max_concurrent_requests` at most
            (seconds): a request whose end was never settled (its replica died) frees its slot
            then. Longer than any request you serve.
        cost: `tokens` — prompt tokens + output budget (`max_tokens` × n, or the model's
            `default_output_tokens`) at admission, settled to prompt + output actually generated
            at the end; `size` — the design notes' `size_cost_base + max(1, body_bytes // 1024)`,
            known at admission (no settlement).
        size_cost_base: the `base` of the size cost (tokens).
        settle_from_response: stream the responses of token-limited tenants through the server
            to read their real usage (costs ~0.3 ms of CPU per body chunk, docs/benchmarks.md);
            off, a request is charged its reservation in full.
        default: limits of tenants with no entry under `tenants`.
        tenants: named tenants (the anonymous tenant may be one of them).
        max_tenant_labels: metric label values for tenants without a name (short hashes);
            later ones share the label `other`.
        redis: the Redis backend's settings.
    """

    enabled: bool = False
    backend: Literal["memory", "redis"] = "memory"
    buckets: int = Field(default=60, ge=1, le=60_000)
    tenant_header: str | None = None
    api_key_headers: list[str] = Field(default_factory=lambda: ["authorization", "x-api-key", "api-key"])
    anonymous_tenant: str = Field(default="anonymous", min_length=1)
    unknown_api_keys: Literal["shared", "anonymous", "per_key"] = "shared"
    unknown_keys_tenant: str = Field(default="unknown-keys", min_length=1)
    inflight_lease_s: float = Field(default=900.0, gt=0)
    cost: Literal["tokens", "size"] = "tokens"
    size_cost_base: int = Field(default=1, ge=0)
    settle_from_response: bool = True
    default: LimitValues = Field(default_factory=LimitValues)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    max_tenant_labels: int = Field(default=100, ge=0)
    redis: RedisConfig = Field(default_factory=RedisConfig)

    @field_validator("tenant_header")
    @classmethod
    def _lower_opt(cls, v: str | None) -> str | None:
        return v.lower() if v else None

    @field_validator("api_key_headers")
    @classmethod
    def _lower(cls, v: list[str]) -> list[str]:
        return [h.lower() for h in v]

    @model_validator(mode="after")
    def _checks(self) -> RateLimitConfig:
        if (WINDOW_S * 1000) % self.buckets:
            raise ValueError(f"buckets ({self.buckets}) must divide 60000 ms evenly (60 → 1 s buckets)")
        seen: dict[str, str] = {}
        problems: list[ConfigProblem] = []  # every tenant's, not only the first's
        for name, t in self.tenants.items():
            for h in t.api_key_sha256:
                if h in seen:
                    problems.append(ConfigProblem(f"tenants{key_text(name)}.api_key_sha256", f"key digest already listed by tenant {seen[h]!r}"))
                    continue
                seen[h] = name
        raise_problems("RateLimitConfig", problems)
        return self
