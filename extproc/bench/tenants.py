"""Multi-tenant bench workloads: who sends what, how fast, with which API key, and how it retries.

A tenants file (YAML, or the same mapping inline) for `llm-extproc bench --tenants`:

    duration_s: 30            # simulated seconds of arrivals, every tenant
    tenants:
      - name: steady
        load: 0.3             # × the fleet's capacity for this tenant's requests; or rate: 3.5 (req/s)
        arrival: poisson      # poisson | constant | trace (the trace's own gaps, rescaled to the rate)
        workload: synthetic   # or a trace file (formats of `analyze`), read in place
        start_offset_s: 0     # the slice of the trace this tenant replays (trace seconds skipped)
      - name: flood
        load: 3.0
        retry: immediate      # never | immediate (ignores retry-after) | retry-after
        max_attempts: 5       # sends of one request in all
        limits: {max_concurrent_requests: 8}   # the rate limiter's limits for this tenant
    extproc_config: {}        # laid over llm-extproc's generated config (flow control, shedding)

Each tenant is a rate-limiter tenant of its own (`ratelimit.tenants.<name>`, identified by the
SHA-256 of its API key, sent as `authorization: Bearer <key>`); keys default to `bench-<name>`
(local, throw-away: the generated config lists only their digests).

Capacity (`load`): the fleet's prefill throughput (`runner.fleet_prefill_capacity`, tokens/s,
what `bench --rate-scale auto` uses) divided by the tenant's mean prompt + output tokens per
request; `load: 1` offers exactly that many requests per second. Prefill capacity ignores decode,
so the fleet saturates somewhat below load 1 (`bench`'s auto load of 0.8 already saturates
Envoy's least-request balancer).

Tenants share no prefixes: each tenant's prefix block ids and session ids are made its own (a
shared trace slice would otherwise look like cross-tenant cache hits).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from extproc.bench.loadgen import RetryPolicy
from extproc.bench.runner import Workload, fit_context, fleet_prefill_capacity
from extproc.bench.traces import TraceRequest, load_trace
from extproc.bench.workload import WorkloadSpec, synthetic_workload
from extproc.ratelimit.tenant import key_digest

__all__ = [
    "ARRIVALS",
    "TenantSpec",
    "TenantSpecError",
    "TenantsSpec",
    "capacity_rps",
    "parse_tenants",
    "ratelimit_overrides",
    "tenant_workload",
]

ARRIVALS = ("poisson", "constant", "trace")
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-_")
_SAMPLE_REQUESTS = 4000
"""Requests read (or generated) to learn a tenant's mean tokens per request before its rate is known."""
_MAX_REQUESTS = 200_000
_BLOCK_ID_STRIDE = 1 << 40
"""Tenant i's prefix block ids are offset by (i + 1) × this: no two tenants share a block."""
_TENANT_KEYS = frozenset({
    "name", "rate", "load", "arrival", "workload", "format", "start_offset_s", "api_key", "retry",
    "max_attempts", "retry_wait_s", "limits", "seed",
})  # fmt: skip
_TOP_KEYS = frozenset({"duration_s", "tenants", "extproc_config"})


class TenantSpecError(ValueError):
    """A tenants file that cannot be run (the message names the field and what is wrong)."""


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant of a multi-tenant run.

    Attributes:
        name: the tenant's name (lower-case letters, digits, `-`, `_`): its rate-limiter tenant.
        rate: arrivals per simulated second, or None when `load` says it.
        load: arrivals as a multiple of the fleet's capacity for this tenant's requests (see the
            module doc), or None when `rate` says it.
        arrival: `poisson`, `constant` (equal gaps), or `trace` (the trace's own gaps, scaled
            so that their mean rate is the tenant's).
        workload: `synthetic` or a trace file.
        format: the trace format (`auto` detects it).
        start_offset_s: trace seconds skipped before the tenant's slice.
        api_key: the key sent as `authorization: Bearer <key>`.
        retry: what the tenant's client does with a 429 / 503.
        limits: the rate limiter's limits for the tenant (`ratelimit.tenants.<name>` keys other
            than `api_key_sha256`), e.g. `{"max_concurrent_requests": 8}`.
        seed: offset added to the run's seed for this tenant's draws.
    """

    name: str
    rate: float | None = None
    load: float | None = None
    arrival: str = "poisson"
    workload: str = "synthetic"
    format: str = "auto"
    start_offset_s: float = 0.0
    api_key: str = ""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    limits: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    @property
    def key(self) -> str:
        """The API key sent (the configured one, else `bench-<name>`)."""
        return self.api_key or f"bench-{self.name}"


@dataclass(frozen=True, slots=True)
class TenantsSpec:
    """A multi-tenant run: its tenants, how long they send, and config laid over llm-extproc's.

    Attributes:
        tenants: at least one, names and keys distinct.
        duration_s: arrivals span this many simulated seconds for every tenant (> 0).
        extproc_config: merged into llm-extproc's generated config (`stacks.merge_config`).
    """

    tenants: tuple[TenantSpec, ...]
    duration_s: float = 30.0
    extproc_config: Mapping[str, Any] = field(default_factory=dict)


def _number(where: str, value: Any, *, minimum: float = 0.0, strict: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TenantSpecError(f"{where} must be a number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise TenantSpecError(f"{where} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def _check_keys(where: str, raw: Any, known: frozenset[str]) -> Mapping[str, Any]:
    """`raw` when it is a mapping of known keys only (else a `TenantSpecError` naming `where`)."""
    if not isinstance(raw, Mapping):
        raise TenantSpecError(f"{where} must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TenantSpecError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return raw


def _tenant(i: int, raw: Any) -> TenantSpec:
    where = f"tenants[{i}]"
    raw = _check_keys(where, raw, _TENANT_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS:
        raise TenantSpecError(f"{where}.name must be lower-case letters, digits, '-' or '_', got {name!r}")
    where = f"tenant {name!r}"
    if ("rate" in raw) == ("load" in raw):
        raise TenantSpecError(f"{where}: give exactly one of rate (requests/s) or load (× capacity)")
    rate = _number(f"{where}.rate", raw["rate"]) if "rate" in raw else None
    load = _number(f"{where}.load", raw["load"]) if "load" in raw else None
    arrival = raw.get("arrival", "poisson")
    if arrival not in ARRIVALS:
        raise TenantSpecError(f"{where}.arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    workload = raw.get("workload", "synthetic")
    if not isinstance(workload, str) or not workload:
        raise TenantSpecError(f"{where}.workload must be 'synthetic' or a trace file, got {workload!r}")
    if arrival == "trace" and workload == "synthetic":
        raise TenantSpecError(f"{where}: arrival 'trace' needs a trace file as workload")
    fmt = raw.get("format", "auto")
    if not isinstance(fmt, str):
        raise TenantSpecError(f"{where}.format must be a trace format name, got {fmt!r}")
    offset = _number(f"{where}.start_offset_s", raw.get("start_offset_s", 0.0), strict=False)
    api_key = raw.get("api_key", "")
    if not isinstance(api_key, str) or any(c.isspace() for c in api_key):
        raise TenantSpecError(f"{where}.api_key must be a string without spaces")
    retry_mode = raw.get("retry", "never")
    attempts = raw.get("max_attempts", 1 if retry_mode == "never" else 5)
    if isinstance(attempts, bool) or not isinstance(attempts, int):
        raise TenantSpecError(f"{where}.max_attempts must be an integer, got {attempts!r}")
    wait = _number(f"{where}.retry_wait_s", raw.get("retry_wait_s", 1.0), strict=False)
    try:
        retry = RetryPolicy(mode=retry_mode, max_attempts=attempts, default_wait_s=wait)
    except ValueError as exc:
        raise TenantSpecError(f"{where}: {exc}") from None
    limits = raw.get("limits", {})
    if not isinstance(limits, Mapping) or "api_key_sha256" in limits:
        raise TenantSpecError(f"{where}.limits must be a mapping of rate-limit values (no api_key_sha256)")
    seed = raw.get("seed", i)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TenantSpecError(f"{where}.seed must be an integer, got {seed!r}")
    return TenantSpec(
        name=name, rate=rate, load=load, arrival=arrival, workload=workload, format=fmt, start_offset_s=offset,
        api_key=api_key, retry=retry, limits=dict(limits), seed=seed,
    )  # fmt: skip


def parse_tenants(raw: Any) -> TenantsSpec:
    """A `TenantsSpec` from the parsed YAML mapping (see the module doc).

    Raises:
        TenantSpecError: anything missing, unknown, out of range or duplicated (names, keys).
    """
    raw = _check_keys("the tenants spec", raw, _TOP_KEYS)
    items = raw.get("tenants")
    if not isinstance(items, list) or not items:
        raise TenantSpecError("tenants must be a non-empty list")
    tenants = tuple(_tenant(i, t) for i, t in enumerate(items))
    names = [t.name for t in tenants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TenantSpecError(f"two tenants share a name: {', '.join(dupes)}")
    keys = [t.key for t in tenants]
    sharing = [t.name for t in tenants if keys.count(t.key) > 1]  # names only: a key is a secret
    if sharing:
        raise TenantSpecError(f"tenants {', '.join(sharing)} share an api_key: each tenant needs its own")
    duration = _number("duration_s", raw.get("duration_s", 30.0))
    extra = raw.get("extproc_config", {})
    if not isinstance(extra, Mapping):
        raise TenantSpecError("extproc_config must be a mapping")
    return TenantsSpec(tenants=tenants, duration_s=duration, extproc_config=dict(extra))


def capacity_rps(requests: Sequence[TraceRequest], profiles: Sequence[str]) -> float:
    """Requests per second the fleet's prefill throughput serves for requests like these:
    `fleet_prefill_capacity(profiles)` / mean (prompt + output tokens).

    Raises:
        ValueError: no requests.
    """
    if not requests:
        raise ValueError("no requests to size the capacity by")
    mean = sum(r.input_tokens + r.output_tokens for r in requests) / len(requests)
    return fleet_prefill_capacity(profiles) / mean


def _sample(tenant: TenantSpec, seed: int) -> list[TraceRequest]:
    """The tenant's candidate requests (arrivals as in the source, first at 0)."""
    if tenant.workload == "synthetic":
        return synthetic_workload(WorkloadSpec(requests=_SAMPLE_REQUESTS, rate=1.0, seed=seed))
    trace = load_trace(
        Path(tenant.workload), format=tenant.format, limit=_SAMPLE_REQUESTS, start_offset=tenant.start_offset_s, seed=seed
    )
    return trace.requests


def _arrivals(arrival: str, rate: float, count: int, source: Sequence[TraceRequest], rng: np.random.Generator) -> list[float]:
    if arrival == "constant":
        return [i / rate for i in range(count)]
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, count)
        return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist() if count else []
    times = [r.arrival_s for r in source[:count]]
    span = times[-1] - times[0] if times else 0.0
    if span <= 0:  # a single instant: spread evenly instead
        return [i / rate for i in range(count)]
    scale = (count - 1) / rate / span  # the slice's mean gap becomes 1 / rate
    return [(t - times[0]) * scale for t in times]


def tenant_workload(
    tenant: TenantSpec, index: int, duration_s: float, profiles: Sequence[str], *, seed: int = 0, max_model_len: int | None = None
) -> tuple[Workload, float]:
    """The tenant's requests over `duration_s` simulated seconds, and its rate (requests/s).

    Lengths come from the tenant's workload (its slice of a trace, or the synthetic draw);
    arrivals from its arrival process at its rate (`rate`, or `load` × `capacity_rps`).
    Prefix block ids are offset by tenant `index` and session ids prefixed with its name, so
    tenants share nothing. With `max_model_len`, prompts are fitted to the context (`fit_context`).

    Raises:
        TenantSpecError: the slice holds too few requests for the rate and duration.
        TraceFormatError: an unreadable trace.
    """
    run_seed = seed * 1009 + tenant.seed
    source = _sample(tenant, run_seed)
    if not source:
        raise TenantSpecError(f"tenant {tenant.name!r}: no requests in {tenant.workload} from {tenant.start_offset_s:g} s")
    rate = tenant.rate if tenant.rate is not None else (tenant.load or 0.0) * capacity_rps(source, profiles)
    count = max(1, math.floor(rate * duration_s) + 1)
    if count > _MAX_REQUESTS:
        raise TenantSpecError(f"tenant {tenant.name!r}: {count:,} requests over {duration_s:g} s is more than {_MAX_REQUESTS:,}")
    if count > len(source):
        if tenant.workload != "synthetic":
            raise TenantSpecError(
                f"tenant {tenant.name!r}: needs {count:,} requests ({rate:.2f}/s × {duration_s:g} s) but reads at most "
                f"{len(source):,} from {tenant.workload}; lower the rate or the duration"
            )
        source = synthetic_workload(WorkloadSpec(requests=count, rate=1.0, seed=run_seed))
    rng = np.random.default_rng(run_seed + 7)
    times = _arrivals(tenant.arrival, rate, count, source, rng)
    offset = (index + 1) * _BLOCK_ID_STRIDE
    requests = [
        dataclasses.replace(
            r,
            arrival_s=t,
            prefix_blocks=tuple(b + offset for b in r.prefix_blocks) if r.prefix_blocks else r.prefix_blocks,
            session=f"{tenant.name}/{r.session}" if r.session is not None else None,
        )
        for r, t in zip(source[:count], times)
    ]
    workload = Workload(f"{tenant.name}:{Path(tenant.workload).name}", requests)
    if max_model_len is not None:
        workload, _ = fit_context(workload, max_model_len)
    return workload, rate


def ratelimit_overrides(spec: TenantsSpec) -> dict[str, Any]:
    """The `ratelimit` section naming every tenant by its key's SHA-256, with its limits
    (tenants without limits are identified and unlimited)."""
    tenants = {t.name: {"api_key_sha256": [key_digest(t.key)], **t.limits} for t in spec.tenants}
    return {"ratelimit": {"enabled": True, "tenants": tenants}}
