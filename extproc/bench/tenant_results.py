"""Per-tenant accounting of a multi-tenant run, and its JSON report (`bench --tenants --json`).

    {"tenants": [{"tenant", "offered_rps", "requests", "sent", "ok", "refused_429", "refused_503",
                  "other_errors": {reason: count}, "gave_up",
                  "ttft_ms": {"p50", "p99"}, "tpot_ms": {"p50", "p99"},
                  "goodput_rps", "completed_tokens", "completed_tokens_per_s", "completed_tokens_while_sending",
                  "behind_schedule_fraction"}],
     "slo": {"ttft_ms", "itl_ms"}, "duration_s", "time_unit", "speed", "settings"}

Definitions:
  - a *request* is one workload entry; each send of it is an *attempt* (`RetryPolicy`).
    `sent` counts attempts; `refused_429` / `refused_503` count attempts so answered;
    `other_errors` counts other failed attempts by reason; `ok` counts requests that
    completed; `gave_up` counts requests none of whose attempts completed;
  - `ttft_ms` is the client's: from the request's first attempt to its first token
    (`waited_s + ttft_s` of the attempt that completed), so waiting out refusals counts;
  - `tpot_ms` is the per-request mean time per output token after the first,
    (E2E − TTFT) / (output tokens − 1), the `itl_ms` of `bench` reports;
  - `goodput_rps`: completed requests with TTFT ≤ `slo.ttft_ms` and TPOT ≤ `slo.itl_ms`
    (a one-token answer meets the TPOT half), per second of the run;
  - `completed_tokens`: prompt + output tokens of completed requests (the engine's `usage`
    when sent, else the workload's prompt length); per second of the run;
  - `completed_tokens_while_sending`: the same, of requests that ended before the run's last
    first send (every tenant's arrivals still coming): the share each tenant got while all were
    sending, before the backlog drains (a drain serves whoever is left, whatever the weights);
  - the run's duration is first send to last end over every tenant, in the run's time unit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from rich.table import Table

from extproc.bench.loadgen import RequestResult, RunRecord
from extproc.bench.results import SLO, TailPercentiles, clock_note, percentiles

__all__ = ["TenantReport", "TenantSummary", "render_tenants", "summarize_tenant", "tenant_report"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantSummary(_Model):
    """One tenant's outcome over a run (see the module doc for definitions)."""

    tenant: str
    offered_rps: float
    requests: int
    sent: int
    ok: int
    refused_429: int
    refused_503: int
    other_errors: dict[str, int]
    gave_up: int
    ttft_ms: TailPercentiles
    tpot_ms: TailPercentiles
    goodput_rps: float | None
    completed_tokens: int
    completed_tokens_per_s: float | None
    behind_schedule_fraction: float
    completed_tokens_while_sending: int | None = None


class TenantReport(_Model):
    """The `--json` document of a multi-tenant run; `settings` records how it was made."""

    tenants: list[TenantSummary]
    slo: SLO
    duration_s: float
    time_unit: Literal["simulated", "wall"]
    speed: float
    settings: dict[str, Any] | None = None


def _client_ttft_s(r: RequestResult) -> float | None:
    return None if r.ttft_s is None else r.waited_s + r.ttft_s


def summarize_tenant(
    name: str, results: Sequence[RequestResult], *, offered_rps: float, duration_s: float, slo: SLO,
    lag_threshold_s: float = 0.050, sending_until_wall_s: float | None = None,
) -> TenantSummary:  # fmt: skip
    """One tenant's summary from its attempts (`duration_s`: the run's, in its time unit;
    `sending_until_wall_s`: the run's last first send, wall seconds from its start)."""
    ok = [r for r in results if r.ok]
    status = Counter(r.status for r in results if not r.ok)
    other = Counter(r.error or str(r.status) for r in results if not r.ok and r.status not in (429, 503))
    requests = {r.index for r in results}
    ttft = percentiles((t for r in ok if (t := _client_ttft_s(r)) is not None), (50, 99), scale=1000)
    tpot = percentiles((r.itl_s for r in ok if r.itl_s is not None), (50, 99), scale=1000)
    good = sum(
        1
        for r in ok
        if (t := _client_ttft_s(r)) is not None
        and t * 1000 <= slo.ttft_ms
        and (r.itl_s is None or r.itl_s * 1000 <= slo.itl_ms)
    )
    def work(rs: list[RequestResult]) -> int:
        return sum((r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens) + (r.output_tokens or 0) for r in rs)

    tokens = work(ok)
    while_sending = None
    if sending_until_wall_s is not None:
        while_sending = work([r for r in ok if r.done_wall_s is not None and r.done_wall_s <= sending_until_wall_s])
    first = [r for r in results if r.attempt == 0]
    behind = sum(1 for r in first if r.lag_s > lag_threshold_s)
    return TenantSummary(
        tenant=name,
        offered_rps=offered_rps,
        requests=len(requests),
        sent=len(results),
        ok=len(ok),
        refused_429=status.get(429, 0),
        refused_503=status.get(503, 0),
        other_errors=dict(other.most_common()),
        gave_up=len(requests) - len({r.index for r in ok}),
        ttft_ms=TailPercentiles(p50=ttft[0], p99=ttft[1]),
        tpot_ms=TailPercentiles(p50=tpot[0], p99=tpot[1]),
        goodput_rps=good / duration_s if duration_s > 0 else None,
        completed_tokens=tokens,
        completed_tokens_per_s=tokens / duration_s if duration_s > 0 else None,
        behind_schedule_fraction=behind / len(first) if first else 0.0,
        completed_tokens_while_sending=while_sending,
    )


def tenant_report(
    records: Sequence[tuple[str, float, RunRecord]], slo: SLO, settings: dict[str, Any] | None = None
) -> TenantReport:
    """The report of one run: `(tenant, offered requests/s, its record)` per tenant, recorded
    side by side on one clock (`RequestResult.sent_wall_s` from a shared start).

    Raises:
        ValueError: no tenants, or records in different time units or at different speeds.
    """
    if not records:
        raise ValueError("no tenants to report")
    units = {rec.time_unit for _, _, rec in records}
    scales = {rec.time_scale for _, _, rec in records}
    if len(units) > 1 or len(scales) > 1:
        raise ValueError(f"tenants were measured on different clocks ({sorted(units)}, speeds {sorted(scales)})")
    results = [r for _, _, rec in records for r in rec.results]
    ends = [r.done_wall_s for r in results if r.done_wall_s is not None]
    wall = (max(ends) - min(r.sent_wall_s for r in results)) if ends else 0.0
    scale = scales.pop()
    duration = wall * scale
    last_send = max((r.sent_wall_s for r in results if r.attempt == 0), default=None)
    tenants = [
        summarize_tenant(
            name, rec.results, offered_rps=rate, duration_s=duration, slo=slo, lag_threshold_s=rec.lag_threshold_s,
            sending_until_wall_s=last_send,
        )  # fmt: skip
        for name, rate, rec in records
    ]
    return TenantReport(
        tenants=tenants, slo=slo, duration_s=duration, time_unit=units.pop(), speed=scale, settings=settings
    )  # fmt: skip


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render_tenants(report: TenantReport, title: str = "tenants") -> Table:
    """The report as a table, one row per tenant."""
    note = clock_note(report.time_unit, report.speed)
    table = Table(title=f"{title} ({report.duration_s:,.1f} s{note}; SLO TTFT ≤ {report.slo.ttft_ms:g} ms, "
                        f"TPOT ≤ {report.slo.itl_ms:g} ms)")  # fmt: skip
    for column in ("tenant", "offered/s", "requests", "sent", "ok", "429", "503", "other", "TTFT p50", "TTFT p99",
                   "TPOT p50", "TPOT p99", "goodput/s", "work tok/s"):  # fmt: skip
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for t in report.tenants:
        table.add_row(
            t.tenant, _fmt(t.offered_rps, 2), f"{t.requests:,}", f"{t.sent:,}", f"{t.ok:,}", f"{t.refused_429:,}",
            f"{t.refused_503:,}", f"{sum(t.other_errors.values()):,}", _fmt(t.ttft_ms.p50), _fmt(t.ttft_ms.p99),
            _fmt(t.tpot_ms.p50, 1), _fmt(t.tpot_ms.p99, 1), _fmt(t.goodput_rps, 2), _fmt(t.completed_tokens_per_s),
        )  # fmt: skip
    return table
