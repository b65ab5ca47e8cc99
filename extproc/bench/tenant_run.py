"""Run a multi-tenant workload (`tenants.TenantsSpec`) through one llm-extproc stack.

    report = await run_tenants(spec, TenantRunOptions(settings=StackSettings(...)), console=console)

Every tenant gets its own load generator (its arrivals, its API key as `authorization: Bearer`,
its retry behaviour), all in this process's event loop, started together; the stack is the
`bench` stack for an llm-extproc policy (simulators, `llm-extproc serve`, Envoy), its config
naming each tenant as a rate-limiter tenant by its key's SHA-256, with the spec's and the
caller's overrides laid over it. Every child is stopped by PID on the way out, whatever happens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from extproc.bench.loadgen import LoadGenConfig, LoadGenerator, RetryPolicy, RunRecord
from extproc.bench.policies import POLICIES, Policy
from extproc.bench.prompts import PromptSynthesizer
from extproc.bench.results import SLO
from extproc.bench.runner import Workload
from extproc.bench.stacks import PolicyStack, StackSettings, merge_config
from extproc.bench.tenant_results import TenantReport, tenant_report
from extproc.bench.tenants import TenantsSpec, ratelimit_overrides, tenant_workload
from extproc.sim.profiles import PROFILES

__all__ = ["TenantRunOptions", "prepare_tenants", "run_tenants", "tenant_server_overrides"]


@dataclass(frozen=True, slots=True)
class TenantRunOptions:
    """How to run a tenants spec.

    Attributes:
        settings: the fleet and stack (its `speed` is the simulators' and the replay's;
            its `server_overrides` are laid over the tenants' config last).
        policy: an llm-extproc policy (the tenants need the rate limiter to be told apart).
        slo: goodput's TTFT / TPOT limits (milliseconds).
        seed: the workload draws' seed (tenant i draws with `seed × 1009 + its own seed`).
        request_timeout_s: per-attempt limit (simulated seconds).
        label: a name for the run in the report's settings.
    """

    settings: StackSettings
    policy: Policy = field(default_factory=lambda: POLICIES["llm-extproc"])
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    request_timeout_s: float = 120.0
    label: str = ""


def tenant_server_overrides(spec: TenantsSpec, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What is laid over llm-extproc's generated config: the tenants' `ratelimit` section, then
    the spec's `extproc_config`, then `extra`."""
    return merge_config(merge_config(ratelimit_overrides(spec), spec.extproc_config), extra or {})


def prepare_tenants(spec: TenantsSpec, options: TenantRunOptions) -> list[tuple[Workload, float]]:
    """Each tenant's workload (prompts fitted to the fleet's context, messages built) and rate.

    Raises:
        TenantSpecError / TraceFormatError: a tenant that cannot be built.
    """
    from extproc.pipeline.tokens import TokenCounter

    profiles = options.settings.profiles
    limit = min(PROFILES[p].max_model_len for p in profiles)
    prompts = PromptSynthesizer(TokenCounter.from_source("builtin:qwen3"))
    out = []
    for i, tenant in enumerate(spec.tenants):
        workload, rate = tenant_workload(tenant, i, spec.duration_s, profiles, seed=options.seed, max_model_len=limit)
        built = [
            dataclasses.replace(r, messages=prompts.messages_for(r, key=f"{tenant.name}/{j}"))
            for j, r in enumerate(workload.requests)
        ]
        out.append((Workload(workload.name, built), rate))
    return out


async def run_tenants(
    spec: TenantsSpec,
    options: TenantRunOptions,
    *,
    console: Console,
    workdir: Path,
    prepared: list[tuple[Workload, float]] | None = None,
) -> TenantReport:
    """Start the stack, send every tenant's workload at once, stop the stack, report per tenant.

    Args:
        workdir: the children's logs.
        prepared: `prepare_tenants`' result, when built already (else built here, in a thread).

    Raises:
        ProcessError / EnvoyError: the stack did not start (every child it started is stopped).
        ValueError: the policy is not an llm-extproc one.
    """
    if options.policy.kind != "extproc":
        raise ValueError(f"{options.policy.name}: tenants are told apart by llm-extproc's rate limiter; pick an llm-extproc policy")
    settings = dataclasses.replace(
        options.settings, server_overrides=tenant_server_overrides(spec, options.settings.server_overrides)
    )
    models = {PROFILES[p].model for p in settings.profiles}
    if len(models) != 1:
        raise ValueError(f"the fleet serves several models {sorted(models)}; tenants need one")
    model = models.pop()
    building = asyncio.ensure_future(asyncio.to_thread(prepare_tenants, spec, options)) if prepared is None else None
    stack = PolicyStack(options.policy, settings, workdir=workdir)
    try:
        await stack.start()
        if building is not None:
            prepared = await building
        assert prepared is not None
        speed = settings.speed
        generators = [
            LoadGenerator(
                LoadGenConfig(
                    base_url=stack.url, model=model, speed=speed, request_timeout_s=options.request_timeout_s / speed,
                    endpoint_headers=stack.endpoint_headers or ("x-llm-endpoint",),
                    headers={"authorization": f"Bearer {tenant.key}"}, retry=_bounded(tenant.retry, spec.duration_s / speed),
                )  # fmt: skip
            )
            for tenant in spec.tenants
        ]
        for tenant, (workload, rate) in zip(spec.tenants, prepared):
            console.print(
                f"  {tenant.name}: {len(workload.requests):,} requests of {workload.name}, {rate:.2f}/s "
                f"{tenant.arrival}, retry {tenant.retry.mode}", highlight=False,
            )  # fmt: skip
        records: list[RunRecord] = await asyncio.gather(
            *(g.run(w.requests) for g, (w, _) in zip(generators, prepared))
        )
    finally:
        if building is not None:
            building.cancel()
        await stack.aclose()
    run_settings = {
        "label": options.label, "seed": options.seed, "speed": settings.speed, "fleet": list(settings.profiles),
        "duration_s": spec.duration_s, "server_overrides": _redacted(settings.server_overrides or {}),
    }  # fmt: skip
    return tenant_report(
        [(t.name, rate, rec) for t, (_, rate), rec in zip(spec.tenants, prepared, records)], options.slo, run_settings
    )


def _bounded(retry: RetryPolicy, window_s: float) -> RetryPolicy:
    """`retry` giving up by the end of the send window (wall seconds) unless it says sooner: no
    resend outlasts the run's arrivals by more than that."""
    return retry if retry.give_up_after_s <= window_s else dataclasses.replace(retry, give_up_after_s=window_s)


def _redacted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`overrides` as recorded in a report: the tenants' key digests left out (not secrets, but
    noise)."""
    out = dict(overrides)
    ratelimit = out.get("ratelimit")
    if isinstance(ratelimit, Mapping) and isinstance(ratelimit.get("tenants"), Mapping):
        tenants = {n: {k: v for k, v in t.items() if k != "api_key_sha256"} for n, t in ratelimit["tenants"].items()}
        out["ratelimit"] = {**ratelimit, "tenants": tenants}
    return out
