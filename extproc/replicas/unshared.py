"""Warnings for a process that is one of several replicas without shared state.

Replicas that share nothing each count only their own requests in flight, KV reservations and
prefix picks (an endpoint another replica just filled looks free), each apply only the weight
overrides posted to them, and with the in-memory rate limiter each enforces a tenant's limit on
its own share of the traffic: the effective limit is the configured one x N. `serve` says so at
start when it can tell it is one of several:

* `--workers N` (N processes on this host);
* `LLM_EXTPROC_REPLICAS` in the environment: how many pods (or hosts) run this configuration.
  A Kubernetes pod cannot read its Deployment's replica count, so the manifests set it beside
  `replicas:` (deploy/k8s; tests/deploy checks the two agree).

The two multiply (3 pods of `--workers 2` are 6 replicas).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.config.schema import Config

__all__ = ["REPLICAS_ENV", "declared_replicas", "unshared_state_warnings"]

REPLICAS_ENV = "LLM_EXTPROC_REPLICAS"
"""How many pods or hosts run this configuration (a positive integer; unset: 1)."""

_LIMIT_FIELDS = ("tokens_per_minute", "requests_per_minute", "max_concurrent_requests", "burst_tokens")


def declared_replicas(environ: Mapping[str, str] | None = None) -> int:
    """`LLM_EXTPROC_REPLICAS` (default `os.environ`), 1 when unset or empty.

    Raises:
        ValueError: set to something that is not a positive integer (names the variable).
    """
    raw = (os.environ if environ is None else environ).get(REPLICAS_ENV, "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{REPLICAS_ENV} must be a positive integer (the pods running this configuration), got {raw[:40]!r}")
    return int(raw)


def unshared_state_warnings(config: Config, workers: int = 1, environ: Mapping[str, str] | None = None) -> list[str]:
    """The warnings `serve` logs at start: replica sync off, and per-replica rate limits (rate
    limiting on, `backend: memory` and some limit configured), when this process is one of
    several (`workers` x `LLM_EXTPROC_REPLICAS` > 1). Empty when it is alone or shares state.

    Raises:
        ValueError: see `declared_replicas`.
    """
    pods = declared_replicas(environ)
    total = workers * pods
    if total <= 1:
        return []
    how = " x ".join(w for w in ((f"--workers {workers}" if workers > 1 else ""), (f"{REPLICAS_ENV}={pods}" if pods > 1 else "")) if w)
    out = []
    if config.replicas.sync != "redis":
        out.append(
            f"one of {total} replicas ({how}) with replicas.sync off: each counts only the requests it routed, "
            "so an endpoint another replica filled looks free, and a weight override reaches only the replica "
            "it was posted to; set replicas.sync: redis (docs/replicas.md)"
        )
    rl = config.ratelimit
    scopes = [rl.default, *rl.tenants.values(), *(m for t in rl.tenants.values() for m in t.models.values())]
    if rl.enabled and rl.backend == "memory" and any(getattr(s, f) is not None for s in scopes for f in _LIMIT_FIELDS):
        out.append(
            f"rate limits are per replica: ratelimit.backend is memory, so each of the {total} replicas ({how}) counts "
            f"a tenant's requests on its own and the effective limit is the configured one x {total}; "
            "set ratelimit.backend: redis for one limit across replicas (docs/replicas.md)"
        )
    return out
