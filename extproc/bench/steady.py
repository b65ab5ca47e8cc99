"""Steady-state figures of one replay: a warm-up left out, the achieved rate, hotspot, validity.

A replay's first seconds measure how an empty fleet fills (cold caches, empty queues), and a
short burst measures how a queue drains: neither is the steady state the field's benchmarks
report. Here a run's figures are taken over the requests *scheduled* after `warmup_s` of trace
time (the requests before still load the fleet; they are only not counted), and the run says
how long that steady span was, the rate it offered and the rate the client achieved.

A run is **invalid** (its figures are printed, marked, and left out of comparisons) when the
client, not the fleet, was the bottleneck:

  - late sends: more than `max_late_fraction` of the steady span's requests were sent more than
    the load generator's lag threshold (50 ms wall) behind schedule (the open loop fell behind,
    so the fleet saw less load than planned);
  - client CPU saturation: the bench process (the load generator's one event loop) used more than
    `max_client_cpu` of a core over the replay (an event loop near 100 % delays every
    timestamp it takes: TTFTs include the client's own queueing).

A steady span shorter than `min_steady_s` (by more than 1 %: the arrivals of a 300 s window
span a little less) is not invalid but is said ("steady span 140 s <
300 s"): it is a shorter measurement, not a wrong one.

**hotspot** (vllm-project/router's figure): endpoints × the largest endpoint's share of the
requests: 1 when spread evenly, N when one of N endpoints took everything. On a heterogeneous
fleet an even spread is not the goal (an H100 should take more than an A100), so it is also
given per endpoint class (GPU type): within each class, its endpoints × the largest one's share
of the class's requests, beside the class's share of all requests.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict

from extproc.bench.loadgen import RunRecord
from extproc.bench.results import SLO, LabeledRun, RunSummary, summarize_run

__all__ = [
    "ClientUsage",
    "SteadyRun",
    "SteadySettings",
    "client_usage",
    "engine_request_counts",
    "hotspot",
    "hotspot_by_class",
    "steady_record",
    "steady_run",
]


@dataclass(frozen=True, slots=True)
class SteadySettings:
    """What makes a run steady and valid.

    Attributes:
        warmup_s: requests scheduled in the first this-many trace seconds load the fleet but are
            not counted (simulated seconds, >= 0).
        min_steady_s: the steady span the issue asks for (arrivals over >= 5 minutes of the
            fleet's time); shorter spans are said, not refused (simulated seconds).
        max_late_fraction: above this share of late sends in the steady span the run is invalid
            (the share `bench` already warns at: 1 %).
        max_client_cpu: above this share of one core used by the bench process over the replay
            the run is invalid (0.9: an asyncio loop at 90 % queues its own callbacks).
    """

    warmup_s: float = 60.0
    min_steady_s: float = 300.0
    max_late_fraction: float = 0.01
    max_client_cpu: float = 0.9

    def __post_init__(self) -> None:
        for name in ("warmup_s", "min_steady_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not 0 <= self.max_late_fraction <= 1:
            raise ValueError(f"max_late_fraction must be in [0, 1], got {self.max_late_fraction}")
        if not self.max_client_cpu > 0:
            raise ValueError(f"max_client_cpu must be > 0, got {self.max_client_cpu}")


@dataclass(frozen=True, slots=True)
class ClientUsage:
    """CPU the bench process used over a replay.

    Attributes:
        cpu_s: user + system CPU seconds of this process (children excluded).
        wall_s: wall seconds the replay took.
        load_average: the machine's 1-minute load average at the end (all processes, all cores).
    """

    cpu_s: float
    wall_s: float
    load_average: float

    @property
    def cpu_share(self) -> float:
        """Cores' worth of CPU the client used (cpu_s / wall_s; 1.0 = one core saturated)."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class client_usage:  # noqa: N801 - a context manager read like a function
    """`with client_usage() as usage: ...` then `usage.result` (a `ClientUsage`)."""

    def __enter__(self) -> client_usage:
        r = resource.getrusage(resource.RUSAGE_SELF)
        self._cpu, self._wall = r.ru_utime + r.ru_stime, time.monotonic()
        self.result: ClientUsage | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.result = ClientUsage(r.ru_utime + r.ru_stime - self._cpu, time.monotonic() - self._wall, os.getloadavg()[0])


class SteadyRun(BaseModel):
    """One policy, one seed, one load: the steady span's figures and whether they count.

    Attributes:
        summary: `results.RunSummary` over the steady span's requests (latencies in ms of the
            run's time unit; goodput and tokens/s over the span's first send to last end).
        seed: the seed of the trace sample and the simulators.
        load: the load label (e.g. the rate multiple `1`).
        warmup_s / steady_span_s: trace seconds left out, and between the first and last
            counted arrival (simulated seconds).
        offered_rps: counted requests / steady span (the schedule).
        achieved_rps: counted requests / the span between their actual first and last sends
            (simulated seconds): below `offered_rps` when the client fell behind or, with
            closed-loop conversations, when slow answers held later turns back.
        client_cpu: cores' worth of CPU the bench process used (see `ClientUsage`).
        load_average: the machine's 1-minute load average at the end of the replay.
        hotspot: endpoints × the largest endpoint's share (1 = even); None without per-endpoint counts.
        hotspot_by_class: the same within each endpoint class (GPU), by class.
        class_share: each class's share of the requests.
        endpoint_source: where the shares came from: `header` (each answer named its endpoint,
            steady span only) or `engines` (the engines' request counters over the whole run, for
            fronts that name none).
        valid: False when the client was the bottleneck; `invalid_reasons` say why.
        notes: things to know that do not invalidate (a short steady span).
    """

    model_config = ConfigDict(extra="forbid")

    policy: str
    workload: str
    seed: int
    load: str
    summary: RunSummary
    warmup_s: float
    steady_span_s: float
    offered_rps: float | None
    achieved_rps: float | None
    client_cpu: float
    load_average: float
    hotspot: float | None
    hotspot_by_class: dict[str, float]
    class_share: dict[str, float]
    endpoint_source: str | None
    valid: bool
    invalid_reasons: list[str]
    notes: list[str]


def steady_record(record: RunRecord, warmup_s: float) -> RunRecord:
    """`record` with only the requests scheduled at least `warmup_s` trace seconds after the first
    one sent; its wall duration is recomputed (first counted send to last counted end).

    Raises:
        ValueError: no request left after the warm-up (the run was shorter than it).
    """
    if not record.results:
        raise ValueError("the run sent no request")
    start = min(r.scheduled_s for r in record.results) + warmup_s
    kept = [r for r in record.results if r.scheduled_s >= start]
    if not kept:
        raise ValueError(f"no request was scheduled after the {warmup_s:g} s warm-up: make the run longer")
    ends = [r.done_wall_s for r in kept if r.done_wall_s is not None]
    wall = (max(ends) - min(r.sent_wall_s for r in kept)) if ends else 0.0
    return replace(record, results=kept, wall_duration_s=wall, planned=len(kept))


def hotspot(shares: Mapping[str, float], endpoints: int) -> float | None:
    """`endpoints` × the largest share (shares of requests, 0..1, by endpoint; `unknown` ignored).

    1.0 = even over `endpoints`, `endpoints` = all on one. None when no share is known.

    Raises:
        ValueError: `endpoints` < 1.
    """
    if endpoints < 1:
        raise ValueError(f"endpoints must be >= 1, got {endpoints}")
    named = {k: v for k, v in shares.items() if k != "unknown"}
    total = sum(named.values())
    if total <= 0:
        return None
    return endpoints * max(named.values()) / total


def hotspot_by_class(shares: Mapping[str, float], classes: Mapping[str, str]) -> tuple[dict[str, float], dict[str, float]]:
    """Per endpoint class: (hotspot within the class, the class's share of all named requests).

    Args:
        shares: share of requests by endpoint address (`unknown` and addresses not in `classes`
            are ignored).
        classes: class (e.g. GPU name) by endpoint address: every endpoint of the fleet, so that
            one that served nothing still counts in its class's size.
    """
    named = {k: v for k, v in shares.items() if k in classes}
    total = sum(named.values())
    members: dict[str, list[str]] = {}
    for address, cls in classes.items():
        members.setdefault(cls, []).append(address)
    spots: dict[str, float] = {}
    class_share: dict[str, float] = {}
    for cls, addresses in members.items():
        within = {a: named.get(a, 0.0) for a in addresses}
        class_share[cls] = sum(within.values()) / total if total > 0 else 0.0
        spot = hotspot(within, len(addresses))
        if spot is not None:
            spots[cls] = spot
    return spots, class_share


def _shares(counts: Mapping[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total > 0 else {}


def steady_run(
    run: LabeledRun,
    *,
    seed: int,
    load: str,
    settings: SteadySettings,
    usage: ClientUsage,
    classes: Mapping[str, str],
    engine_counts: Mapping[str, float] | None = None,
    slo: SLO | None = None,
) -> SteadyRun:
    """The steady-state figures of `run` and its validity (see the module docstring).

    Args:
        classes: endpoint class (GPU) by endpoint address, every endpoint of the fleet.
        engine_counts: requests each engine finished over the whole run (its own counter), used
            for hotspot when the answers named no endpoint (peer routers).

    Raises:
        ValueError: nothing scheduled after the warm-up.
    """
    record = steady_record(run.record, settings.warmup_s)
    summary = summarize_run(replace(run, record=record), slo)
    results = record.results
    scheduled = [r.scheduled_s for r in results]
    span = max(scheduled) - min(scheduled)
    sends = [r.sent_wall_s for r in results]
    send_span = (max(sends) - min(sends)) * record.time_scale
    named = Counter(r.endpoint for r in results if r.endpoint in classes)
    source: str | None = None
    if named:
        shares, source = _shares(named), "header"
    elif engine_counts:
        shares, source = _shares(engine_counts), "engines"
    else:
        shares = {}
    spot = hotspot(shares, len(classes)) if shares and classes else None
    by_class, class_share = hotspot_by_class(shares, classes) if shares else ({}, {})
    reasons: list[str] = []
    late = summary.behind_schedule
    if late.fraction > settings.max_late_fraction:
        reasons.append(
            f"{late.fraction:.1%} of sends more than {late.threshold_ms:g} ms late (max {late.max_lag_ms:,.0f} ms wall): "
            "the load generator fell behind its schedule"
        )
    if usage.cpu_share > settings.max_client_cpu:
        reasons.append(f"the client used {usage.cpu_share:.0%} of a core: its own event loop delayed sends and timestamps")
    notes = []
    if span < 0.99 * settings.min_steady_s:  # n arrivals in a window span a little less than it
        notes.append(f"steady span {span:,.0f} s < {settings.min_steady_s:g} s")
    if source == "engines":
        notes.append("hotspot from the engines' request counters over the whole run (warm-up included)")
    return SteadyRun(
        policy=run.policy,
        workload=run.trace,
        seed=seed,
        load=load,
        summary=summary,
        warmup_s=settings.warmup_s,
        steady_span_s=span,
        offered_rps=len(results) / span if span > 0 else None,
        achieved_rps=len(results) / send_span if send_span > 0 else None,
        client_cpu=usage.cpu_share,
        load_average=usage.load_average,
        hotspot=spot,
        hotspot_by_class=by_class,
        class_share=class_share,
        endpoint_source=source,
        valid=not reasons,
        invalid_reasons=reasons,
        notes=notes,
    )


def engine_request_counts(metrics_texts: Sequence[str], addresses: Sequence[str]) -> dict[str, float]:
    """Requests each engine finished (`vllm:request_success_total`, summed over labels), by address.

    Raises:
        ValueError: `metrics_texts` and `addresses` differ in length.
    """
    from prometheus_client.parser import text_string_to_metric_families

    if len(metrics_texts) != len(addresses):
        raise ValueError(f"{len(metrics_texts)} metrics pages for {len(addresses)} endpoints")
    out: dict[str, float] = {}
    for address, text in zip(addresses, metrics_texts):
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:request_success_total":
                    total += sample.value
        out[address] = total
    return out
