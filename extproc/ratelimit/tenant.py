"""Who a request belongs to.

In order: the trusted tenant header (when configured; Envoy must strip a client's copy), else an
API key (`authorization: Bearer <key>`, `x-api-key`, `api-key`: the configured tenant listing
the key's SHA-256, else — `unknown_api_keys` — the shared unknown-keys tenant, the anonymous
tenant, or a tenant of its own known only by that hash), else the anonymous tenant.

A key is hashed the moment it is read and never kept, logged or exported: a tenant's `id` (used
in backend keys) and `label` (used in metrics, logs and the admin API) are configured names or
hash prefixes. Unnamed tenants get at most `max_tenant_labels` distinct labels (`key-<8 hex>`,
`hdr-<8 hex>`), then share `other`, so a flood of keys cannot blow up metric cardinality.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.ratelimit.config import LimitValues, RateLimitConfig

__all__ = ["Tenant", "TenantResolver", "key_digest"]

OTHER_LABEL = "other"


def key_digest(secret: str) -> str:
    """SHA-256 of a key (lower-case hex), as `api_key_sha256` lists it (`printf %s KEY | sha256sum`)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """A resolved tenant.

    Attributes:
        id: stable identity across replicas (a configured name, `key:<sha256>` or `hdr:<sha256>`).
        label: what metrics, logs and the admin API show (a configured name or a short hash).
        limits: the tenant's own limits.
        models: per-model limits (canonical model name → limits).
        named: configured under `tenants` (or the anonymous tenant).
    """

    id: str
    label: str
    limits: LimitValues
    models: Mapping[str, LimitValues]
    named: bool


class TenantResolver:
    """Request headers → `Tenant` (see the module docstring).

    Args:
        config: the `ratelimit` section.
    """

    def __init__(self, config: RateLimitConfig) -> None:
        self._cfg = config
        self._header = config.tenant_header
        self._key_headers = tuple(config.api_key_headers)
        self._by_digest = {h: name for name, t in config.tenants.items() for h in t.api_key_sha256}
        self._named = {name: self._named_tenant(name) for name in config.tenants}
        self._anonymous = self._named.get(config.anonymous_tenant) or Tenant(
            config.anonymous_tenant, config.anonymous_tenant, config.default, {}, True
        )
        self._unknown_keys: Tenant | None = None
        if config.unknown_api_keys == "anonymous":
            self._unknown_keys = self._anonymous
        elif config.unknown_api_keys == "shared":
            name = config.unknown_keys_tenant
            self._unknown_keys = self._named.get(name) or Tenant(name, name, config.default, {}, True)
        self._labels: dict[str, str] = {}

    @property
    def headers(self) -> frozenset[str]:
        """The request headers `resolve` reads (lower case)."""
        return frozenset((*([self._header] if self._header else []), *self._key_headers))

    @property
    def named(self) -> list[Tenant]:
        """Every configured tenant, the anonymous one and the shared unknown-keys one."""
        out = list(self._named.values())
        for extra in (self._anonymous, self._unknown_keys):
            if extra is not None and extra.id not in self._named and extra not in out:
                out.append(extra)
        return out

    def _named_tenant(self, name: str) -> Tenant:
        t = self._cfg.tenants[name]
        limits = LimitValues.model_validate(t.model_dump(include=set(LimitValues.model_fields)))
        return Tenant(name, name, limits, t.models, True)

    def _unnamed(self, kind: str, digest: str) -> Tenant:
        tid = f"{kind}:{digest}"
        label = self._labels.get(tid)
        if label is None:
            label = f"{kind}-{digest[:8]}" if len(self._labels) < self._cfg.max_tenant_labels else OTHER_LABEL
            if label != OTHER_LABEL:
                self._labels[tid] = label
        return Tenant(tid, label, self._cfg.default, {}, False)

    def resolve(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request, from its headers (lower-case names → values).

        Never raises: a malformed header falls through to the next source.
        """
        if self._header:
            value = headers.get(self._header, "").strip()
            if value:
                named = self._named.get(value)
                return named if named is not None else self._unnamed("hdr", key_digest(value))
        for name in self._key_headers:
            value = headers.get(name, "").strip()
            if not value:
                continue
            if name == "authorization":
                scheme, _, rest = value.partition(" ")
                if scheme.lower() == "bearer" and rest.strip():
                    value = rest.strip()
            digest = key_digest(value)
            named_as = self._by_digest.get(digest)
            if named_as is not None:
                return self._named[named_as]
            if self._unknown_keys is not None:
                return self._unknown_keys
            return self._unnamed("key", digest)
        return self._anonymous
