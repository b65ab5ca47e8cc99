"""The configuration schema. Every model forbids unknown keys, so a typo is an error that names it.

Shape (see `deploy/config.example.yaml` for a commented example)::

    listen:    {grpc: "0.0.0.0:9002", admin: "0.0.0.0:9090"}
    limits:    {max_body_bytes: 4194304, decision_timeout_ms: 1500, ...}
    models:    [{name, aliases, tokenizer, architecture, max_model_len, dtype, ...}]
    endpoints: [{address: "10.0.0.1:8000", models: [...], labels: {...}}]
    scheduling: {picker: least-inflight, block_size: 16, health_check: {...}}
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AdminConfig",
    "Config",
    "EndpointConfig",
    "HealthCheckConfig",
    "LimitsConfig",
    "ListenConfig",
    "ModelConfig",
    "SchedulingConfig",
    "parse_host_port",
]


def parse_host_port(value: str) -> tuple[str, int]:
    """Split `host:port` (IPv6 as `[::1]:80`).

    Raises:
        ValueError: no port, or a port outside 1..65535.
    """
    host, sep, port_s = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"port must be an integer in {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, port


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    """Listen addresses. Env overrides: LLM_EXTPROC_GRPC_ADDRESS, LLM_EXTPROC_ADMIN_ADDRESS."""

    grpc: str = "0.0.0.0:9002"
    admin: str = "0.0.0.0:9090"

    @field_validator("grpc", "admin")
    @classmethod
    def _addr(cls, v: str) -> str:
        parse_host_port(v)
        return v


class AdminConfig(_Strict):
    """Admin HTTP server options."""

    enabled: bool = True


class LimitsConfig(_Strict):
    """Request limits.

    Attributes:
        max_body_bytes: largest request body accepted (bytes). Must equal Envoy's
            `per_connection_buffer_limit_bytes` so both layers answer the same 413.
        grpc_max_message_bytes: gRPC receive limit; must exceed max_body_bytes plus headers.
        decision_timeout_ms: our own budget for a decision (milliseconds); keep it below
            Envoy's ext_proc `message_timeout`.
        shutdown_grace_s: how long SIGTERM waits for in-flight streams (seconds).
    """

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    grpc_max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=4096)
    decision_timeout_ms: int = Field(default=1500, ge=10)
    shutdown_grace_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _grpc_above_body(self) -> LimitsConfig:
        if self.grpc_max_message_bytes < self.max_body_bytes + 64 * 1024:
            raise ValueError(
                f"grpc_max_message_bytes ({self.grpc_max_message_bytes}) must be at least "
                f"max_body_bytes + 65536 ({self.max_body_bytes + 65536}): a body near the limit "
                "plus its headers must fit one gRPC message"
            )
        return self


class ModelConfig(_Strict):
    """One served model.

    Attributes:
        name: canonical name, as the engines serve it (`--served-model-name`).
        aliases: other names clients may send.
        tokenizer: a local directory with `tokenizer.json`/`tokenizer_config.json`, or
            `builtin:qwen3`.
        architecture: a `config.json` path or directory, or `builtin:<name>`
            (see `extproc.models.builtin_architectures()`).
        max_model_len: context limit enforced as vLLM does (tokens).
        dtype: KV-cache dtype (`auto` = the weights' dtype).
        default_output_tokens: expected output length when a request sets no max_tokens
            (tokens); the KV estimate uses it instead of the max_model_len worst case.
    """

    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    tokenizer: str = "builtin:qwen3"
    architecture: str = "builtin:qwen3-8b"
    max_model_len: int = Field(default=40960, ge=16)
    dtype: str = "auto"
    default_output_tokens: int = Field(default=512, ge=1)


class EndpointConfig(_Strict):
    """One inference endpoint (a vLLM server).

    Attributes:
        address: `ip:port` written into `x-gateway-destination-endpoint`. Envoy's
            ORIGINAL_DST cluster connects to it as is, so it must be an IP literal.
        models: canonical model names it serves.
        labels: free-form labels (gpu, zone, ...), used by label filters.
    """

    address: str
    models: list[str] = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("address")
    @classmethod
    def _ip_port(cls, v: str) -> str:
        host, port = parse_host_port(v)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"endpoint address must be ip:port (Envoy's ORIGINAL_DST cluster does not resolve names), got {v!r}"
            ) from None
        if port == 0:
            raise ValueError(f"endpoint port must not be 0 in {v!r}")
        return v


class HealthCheckConfig(_Strict):
    """Active health checks of endpoints (`GET path`).

    Attributes:
        enabled: probe endpoints; when off every configured endpoint counts as healthy.
        path: probe path.
        interval_s: probe period (seconds). timeout_s: per-probe timeout (seconds).
        unhealthy_threshold / healthy_threshold: consecutive failures / successes to flip.
    """

    enabled: bool = True
    path: str = "/health"
    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=0.5, gt=0)
    unhealthy_threshold: int = Field(default=2, ge=1)
    healthy_threshold: int = Field(default=1, ge=1)


class SchedulingConfig(_Strict):
    """Scheduling settings.

    Attributes:
        picker: `least-inflight` (fewest in-flight requests counted by this server, random tie-break).
        block_size: KV block size of the engines (tokens), vLLM's default 16.
        health_check: active health checking.
        explain_header: add `x-llm-route-debug` to routed requests (upstream side only).
    """

    picker: Literal["least-inflight", "random"] = "least-inflight"
    block_size: int = Field(default=16, ge=1)
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    explain_header: bool = False


class Config(_Strict):
    """The whole configuration."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    models: list[ModelConfig] = Field(min_length=1)
    endpoints: list[EndpointConfig] = Field(min_length=1)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        names: dict[str, str] = {}
        for i, m in enumerate(self.models):
            for n in [m.name, *m.aliases]:
                if n in names:
                    raise ValueError(f"models[{i}]: name or alias {n!r} already used by model {names[n]!r}")
                names[n] = m.name
        canonical = {m.name for m in self.models}
        seen: set[str] = set()
        for i, e in enumerate(self.endpoints):
            if e.address in seen:
                raise ValueError(f"endpoints[{i}].address: {e.address!r} is listed twice")
            seen.add(e.address)
            for m in e.models:
                if m not in canonical:
                    raise ValueError(
                        f"endpoints[{i}].models: {m!r} is not a configured model name; configured: {sorted(canonical)}"
                    )
        return self
