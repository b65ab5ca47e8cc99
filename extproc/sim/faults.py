"""Fault injection: what can go wrong with a simulated engine, switchable at run time.

`POST /sim/faults` merges a JSON object into the current set (`{}` or `DELETE` clears it);
`GET /sim/faults` shows it. Besides the persistent faults below, an update may carry two
actions: `"restart": true` (drop all requests, clear the prefix cache, zero the counters, as a
crashed and restarted vLLM) and `"for_s": <seconds>` (revert this update's faults after that
many wall-clock seconds, so a client can switch off listening without locking itself out).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["MAX_JITTER_MS", "Faults", "FaultUpdate", "parse_fault_update"]

MAX_JITTER_MS = 60_000.0
"""Most jitter per chunk (simulated ms): a minute between chunks is already a dead stream
(`die_after_chunks` and `metrics_hang` say so directly); inf or 1e308 hung every stream."""


class Faults(BaseModel):
    """The persistent faults.

    Attributes:
        error_rate: fraction of generation requests answered 500 (0..1).
        error_body: whether those 500s carry vLLM's JSON error body; False answers them with no
            body at all (as a proxy in front of an engine, or a crashed handler, may).
        die_after_chunks: a streamed response aborts its connection after this many SSE
            chunks (None: never). Non-streamed responses are unaffected.
        metrics_hang: `/metrics` never answers (until the fault is cleared).
        health_fail: `/health` answers 503.
        refuse_connections: the server stops listening; open keep-alive connections still work.
        jitter_ms: extra random delay before each streamed chunk, uniform in [0, jitter_ms]
            simulated milliseconds; at most `MAX_JITTER_MS`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    error_rate: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    error_body: bool = True
    die_after_chunks: int | None = Field(default=None, ge=0)
    metrics_hang: bool = False
    health_fail: bool = False
    refuse_connections: bool = False
    jitter_ms: float = Field(default=0.0, ge=0.0, le=MAX_JITTER_MS, allow_inf_nan=False)

    def merged(self, update: FaultUpdate) -> Faults:
        """These faults with the fields set in `update` replaced."""
        changes = update.model_dump(exclude_unset=True, exclude={"restart", "for_s"})
        # null clears die_after_chunks; for the other fields it means "leave as is"
        changes = {k: v for k, v in changes.items() if v is not None or k == "die_after_chunks"}
        return self.model_copy(update=changes)

    def active(self) -> dict[str, Any]:
        """The faults that differ from the defaults."""
        return self.model_dump(exclude_defaults=True)


class FaultUpdate(BaseModel):
    """A `POST /sim/faults` body: any fault fields, plus the actions `restart` and `for_s`."""

    model_config = ConfigDict(extra="forbid")

    error_rate: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    error_body: bool | None = None
    die_after_chunks: int | None = Field(default=None, ge=0)
    metrics_hang: bool | None = None
    health_fail: bool | None = None
    refuse_connections: bool | None = None
    jitter_ms: float | None = Field(default=None, ge=0.0, le=MAX_JITTER_MS, allow_inf_nan=False)
    restart: bool = False
    for_s: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)


def parse_fault_update(data: object) -> FaultUpdate:
    """Validate a fault update.

    Raises:
        ValueError: not an object, an unknown key or a value out of range (message names it).
    """
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object of faults")
    try:
        return FaultUpdate.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise ValueError(f"{loc}: {first.get('msg')}") from None
