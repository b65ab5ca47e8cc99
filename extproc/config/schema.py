"""The configuration schema. Every model forbids unknown keys, so a typo is an error that names it.

Shape (see `deploy/config.example.yaml` for a commented example)::

    listen:    {grpc: "127.0.0.1:9002", admin: "127.0.0.1:9090", reuse_port: true, grpc_tls: null}
    limits:    {max_body_bytes: 4194304, decision_timeout_ms: 1500, ...}
    models:    [{name, aliases, tokenizer, architecture, max_model_len, dtype, ...}]
    endpoints: [{address: "10.0.0.1:8000", models: [...], labels: {...}}]
    discovery: {sources: [{type: static}, {type: dns, ...}, {type: kubernetes, ...}], drain_timeout_s: 300}
    scheduling: {mode: endpoint, profile: load-aware, profiles: {...}, metrics: {...}, health_check: {...}}
    admission: {kv: {...}, priority: {...}}
    ratelimit: {enabled, backend, tenant_header, default, tenants: {...}, redis: {...}}
    decision_log: {path, max_bytes, backup_count, queue_size}
    replicas:  {sync: off|redis, channel, heartbeat_s, owner_timeout_s, ...}  (Redis: ratelimit.redis)
    protocol:  {mode: buffered | epp, fallbacks, destination_namespace, subset_namespace, chunk_bytes}
    flow_control: {enabled, fairness, ordering, weights, bands: {...}, gate: {...}, ...}  (extproc.flowcontrol.config)
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from extproc.config.diagnose import did_you_mean, undefined_profile, unknown_model
from extproc.config_base import ConfigProblem, Strict, key_text, raise_problems
from extproc.config_base import yaml_off
from extproc.datastore.prefill_fit import PREFILL_ATTENTION_RATIO, PREFILL_S_PER_TOKEN_BY_GPU, gpu_table, prefill_work
from extproc.flowcontrol.config import FlowControlConfig
from extproc.ratelimit.config import RateLimitConfig
from extproc.replicas.config import ReplicasConfig
from extproc.telemetry.observer import ObserverOptions
from extproc.telemetry.stats import StreamStatsParams

__all__ = [
    "AdminConfig",
    "Config",
    "EndpointConfig",
    "HealthCheckConfig",
    "LimitsConfig",
    "ProtocolConfig",
    "ListenConfig",
    "TLSConfig",
    "is_loopback",
    "ModelConfig",
    "SchedulingConfig",
    "MetricsScrapeConfig",
    "PluginSpec",
    "ProfileConfig",
    "SAFE_FILTERS",
    "TierConfig",
    "PrefixConfig",
    "HotPrefixConfig",
    "WarmupConfig",
    "PrefillModelConfig",
    "TruncationConfig",
    "OutputEstimateConfig",
    "AdmissionConfig",
    "DecisionLogConfig",
    "DiscoveryConfig",
    "KVAdmissionConfig",
    "PriorityConfig",
    "BUILTIN_PROFILES",
    "TelemetryConfig",
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


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals (127.0.0.0/8, ::1); False for anything else,
    wildcards (`0.0.0.0`, `::`, `*`) and names included."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TLSConfig(Strict):
    """TLS on the gRPC port (Envoy's `llm_extproc` cluster then needs its transport_socket:
    see the commented block in envoy/*.yaml).

    Attributes:
        cert_file / key_file: the server's PEM certificate chain and private key (paths).
        client_ca_file: PEM CA bundle (path); when set, clients must present a certificate it
            signed (mTLS) — only an Envoy holding such a certificate can hold reservations.
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @field_validator("cert_file", "key_file", "client_ca_file")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        if v is not None and not os.access(v, os.R_OK):
            raise ValueError(f"cannot read {v!r}")
        return v

    @model_validator(mode="after")
    def _pem(self) -> TLSConfig:
        # Checked here: grpc reports a bad file only as a failed bind ("address in use").
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(f"cert_file / key_file are not a PEM certificate chain and its private key: {exc}") from None
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(self.client_ca_file)
            except ssl.SSLError as exc:
                raise ValueError(f"client_ca_file is not a PEM CA bundle: {exc}") from None
        return self


class ListenConfig(Strict):
    """Listen addresses. Env overrides: LLM_EXTPROC_GRPC_ADDRESS, LLM_EXTPROC_ADMIN_ADDRESS.

    Both default to loopback (a sidecar beside Envoy): any client that reaches the gRPC port can
    hold reservations, and the admin port shows the fleet. A non-loopback gRPC address without
    `grpc_tls` is allowed but logged as a warning at start.

    Attributes:
        grpc / admin: `host:port` of the ext_proc gRPC server and the admin HTTP server.
        reuse_port: bind both with SO_REUSEPORT, so a replacement process can start and get
            ready while the old one still serves and drains (docs/decisions/0140-restarts-
            without-an-outage.md); Linux lets only processes of the same user share a port.
        grpc_tls: serve gRPC over TLS (mTLS with `client_ca_file`), or None for plaintext.
    """

    grpc: str = "127.0.0.1:9002"
    admin: str = "127.0.0.1:9090"
    reuse_port: bool = True
    grpc_tls: TLSConfig | None = None

    @field_validator("grpc", "admin")
    @classmethod
    def _addr(cls, v: str) -> str:
        parse_host_port(v)
        return v

    @model_validator(mode="after")
    def _distinct_ports(self) -> ListenConfig:
        # Both bind with SO_REUSEPORT: on one port the kernel split connections between the
        # gRPC and HTTP servers and no gRPC call got through, with nothing logged.
        (ghost, gport), (ahost, aport) = parse_host_port(self.grpc), parse_host_port(self.admin)
        wildcards = {"0.0.0.0", "::", "*", ""}
        overlap = ghost == ahost or ghost in wildcards or ahost in wildcards or (is_loopback(ghost) and is_loopback(ahost))
        if gport != 0 and gport == aport and overlap:
            raise ValueError(f"listen.grpc ({self.grpc}) and listen.admin ({self.admin}) must use different ports")
        return self


class AdminConfig(Strict):
    """Admin HTTP server options."""

    enabled: bool = True


class LimitsConfig(Strict):
    """Request limits.

    Attributes:
        max_body_bytes: largest request body accepted (bytes). Must equal Envoy's
            `per_connection_buffer_limit_bytes` so both layers answer the same 413.
        grpc_max_message_bytes: gRPC receive limit; must exceed max_body_bytes plus headers.
        decision_timeout_ms: our own budget for a decision (milliseconds); keep it below
            Envoy's ext_proc `message_timeout`. Token counting off the event loop may take half
            of it; past that the request is routed on a character estimate (the rest of a
            decision never waits).
        shutdown_grace_s: how long SIGTERM waits for in-flight streams (seconds).
        max_json_values: most JSON values (objects, arrays, strings, numbers, true/false/null;
            object keys not counted) in one request body; more is a 400 naming the limit,
            decided on the bytes before they are parsed (`extproc.protocol.jsonlimits`). A body
            under max_body_bytes can hold ~1.4M tiny values (`[],[],...`), and decoding,
            validating and walking them costs 0.3–1.5 µs each on the event loop: one such 4 MiB
            body stalled every stream for 8–10 s (measured on the 2-core development machine);
            refused now, it costs 5–12 ms. At the default, parse + validate + character walk of
            a body at the limit measured 0.4–9 ms for most shapes, 15–20 ms for a 200 kB tool
            schema (its characters walked) or for 2048 messages (max_messages' own cost), while
            the biggest real chats fit: 2048 messages are ~6k values; 500 messages with 128
            tools of 12 parameters each, 13.7k. A completions body may hold the longest model's
            `max_model_len` values more (one full-context prompt sent as token ids, one value
            per token).
        max_messages: most chat messages in one request (count); more is a 400, checked
            before the messages are validated.
        max_prompts: most prompts in one batched completions request (count); more is a 400.
        max_chars_per_token: a prompt longer than `max_chars_per_token × max_model_len`
            characters cannot fit the model and is refused with a 400 before it is tokenized
            (tokenizing megabytes only to refuse them would tie up the tokenizer threads;
            natural text averages ~4 characters per token).
        token_cache_bytes: memory bound of each tokenizer's segment cache (bytes; the text
            between two added tokens of a rendered prompt and its ids, LRU,
            `extproc.pipeline.tokens`). 64 MiB holds ~7M tokens of prose (`tokens.DEFAULT_CACHE_BYTES`); what it caches is
            resent history, so a fleet of long multi-turn chats gains from more.
    """

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_json_values: int = Field(default=16384, ge=64)
    max_messages: int = Field(default=2048, ge=1)
    max_prompts: int = Field(default=1024, ge=1)
    max_chars_per_token: int = Field(default=16, ge=1)
    token_cache_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
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


class TruncationConfig(Strict):
    """Head + tail truncation of over-long prompts (`extproc.pipeline.truncate`).

    A prompt is cut when its tokens plus the output budget (the request's `max_tokens`, else
    `min_output_tokens`) exceed `max_model_len`; otherwise it gets vLLM's 400 as before.

    Attributes:
        mode: `off` — never cut (the `x-llm-truncate` header is ignored); `head-tail` — cut every
            over-long prompt (a client may send `x-llm-truncate: off` to get the 400 instead);
            `on-request` — cut only when the client sends `x-llm-truncate: head-tail`.
        head_tokens: most leading tokens a cut text keeps (tokens; the design notes' 512): a
            completions prompt keeps `min(head_tokens, n / 4)` tokens of its head, the rest of the
            budget from its tail; a chat message cut inside keeps as much of its own head.
        min_output_tokens: output room left when the request sets no `max_tokens` (tokens).
    """

    mode: Literal["off", "head-tail", "on-request"] = "off"
    head_tokens: int = Field(default=512, ge=0)
    min_output_tokens: int = Field(default=1024, ge=1)

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return yaml_off(v)


MAX_OUTPUT_WINDOW = 100_000
"""Largest `models[].output_estimate.window` (count). Each completed response's length is
inserted into a sorted list on the event loop, an O(window) shift: measured 17.5 µs and 4.4 MB
per model at 100,000, 351 µs and 45 MB at 1,000,000, growing linearly (a typo of a few zeros
stalled every response's end). 100,000 is 1,000 s of a 1,000 request/s fleet at the default
`telemetry.sample_rate` of 0.1."""


class OutputEstimateConfig(Strict):
    """How many output tokens a model's requests really produce, learned from completed
    responses (`extproc.pipeline.output_estimate`): the scheduler's decode terms
    (`ttft-estimate-scorer`) and an endpoint's in-flight decode context use
    `min(max_tokens, estimate)` as a request's output length; the KV reservation keeps
    `max_tokens`. Clients that send `max_tokens: 32768` for 300-token answers otherwise make the
    decode terms dominate the cost (docs/decisions/0275).

    Attributes:
        enabled: learn and cap (false: `max_tokens` as the decode length, as before).
        quantile: which quantile of recent output lengths is the estimate, in (0, 1] (1: the
            window's longest). High, so that requests whose `max_tokens` is their real length
            are rarely capped.
        window: how many recent completed responses the quantile is taken over (count,
            1..`MAX_OUTPUT_WINDOW`).
        min_samples: completions needed before any cap (count, 1..window); before then the
            decode length is `max_tokens`. Only observed responses count
            (`telemetry.sample_rate` of them).
    """

    enabled: bool = True
    quantile: float = Field(default=0.95, gt=0, le=1, allow_inf_nan=False)
    window: int = Field(default=1000, ge=1, le=MAX_OUTPUT_WINDOW)
    min_samples: int = Field(default=20, ge=1)

    @model_validator(mode="after")
    def _samples_fit(self) -> OutputEstimateConfig:
        if self.min_samples > self.window:
            raise ValueError(
                f"output_estimate.min_samples ({self.min_samples}) must be at most window ({self.window}): "
                "the window never holds more lengths than that"
            )
        return self


def model_sources(name: str, path: Any, tokenizer: Any, architecture: Any) -> dict[str, Any]:
    """The `tokenizer` and `architecture` a model entry resolves to: each as set, else from
    `path` (a model directory supplies both; `builtin:<model>` the built-ins of that model),
    else the built-ins the model's `name` picks (`extproc.models.builtin_model`). A value that
    is not a string is returned as is, for the field check to refuse.

    Raises:
        ValueError: one of them is still unset: the message names the model, the fields and an
            example (a model no built-in serves must name its own).
    """
    from extproc.models import builtin_model

    given = {"tokenizer": tokenizer, "architecture": architecture}
    if isinstance(path, str) and path.startswith("builtin:"):
        entry = builtin_model(path.removeprefix("builtin:"))
        if entry is None or entry.tokenizer is None or entry.architecture is None:
            known = sorted({m.architecture.removeprefix("builtin:") for m in _complete_builtins()})
            raise ValueError(f"path {path!r}: no built-in model of that name ships both a tokenizer and an architecture; built-in models: {known}")
        implied = {"tokenizer": entry.tokenizer, "architecture": entry.architecture}
    elif path is not None and not isinstance(path, str):
        raise ValueError(f"path must be a model directory (a string), got {type(path).__name__}")
    elif isinstance(path, str):
        implied = {"tokenizer": path, "architecture": path}
        where = Path(path).expanduser()
        if (tokenizer is None or architecture is None) and not where.is_dir():
            # One clear line, not an architecture error whose cause is the directory (and a
            # tokenizer error the architecture's hid).
            relative = "" if where.is_absolute() else f" (relative to {Path.cwd()})"
            raise ValueError(
                f"path {path!r}: no such directory{relative}; `path` is the engines' model directory, "
                "holding config.json and the tokenizer files — or set `tokenizer` and `architecture` instead"
            )
    else:
        entry = builtin_model(name)
        implied = {"tokenizer": entry.tokenizer, "architecture": entry.architecture} if entry else {"tokenizer": None, "architecture": None}
    out = {k: v if v is not None else implied[k] for k, v in given.items()}
    missing = [k for k, v in out.items() if v is None]
    if missing:
        what = " and ".join(f"`{k}`" for k in missing)
        why = (
            "built-in tokenizers serve Qwen3 models only, and another model's prompts counted by one are silently wrong"
            if "tokenizer" in missing else "its shape (config.json) is not built in"
        )
        d = f"/models/{name.rsplit('/', 1)[-1]}"
        example = ", ".join(f"tokenizer: {d}" if k == "tokenizer" else f"architecture: {d}/config.json" for k in missing)
        raise ValueError(
            f"model {name!r} matches no built-in {' or '.join(missing)}, so it must name its {what}: set `path:` to "
            "the model directory the engines load (tokenizer.json, tokenizer_config.json and config.json in it), or "
            f"set {what}; e.g. `{{name: {name}, path: {d}}}` or `{{name: {name}, {example}}}`; {why}"
        )
    return out


def _complete_builtins() -> list[Any]:
    """The built-in models that ship both a tokenizer and an architecture."""
    from extproc.models import BUILTIN_MODELS

    return [m for m in BUILTIN_MODELS if m.tokenizer is not None and m.architecture is not None]


class ModelConfig(Strict):
    """One served model.

    Attributes:
        name: canonical name, as the engines serve it (`--served-model-name`).
        aliases: other names clients may send.
        path: the model directory the engines load (`vllm serve PATH`: `tokenizer.json`,
            `tokenizer_config.json` and `config.json` in it), or `builtin:<model>` for a model
            whose tokenizer and architecture both ship (`builtin:qwen3-8b`); it supplies
            `tokenizer` and `architecture` where those are not set.
        tokenizer: a local directory with `tokenizer.json`/`tokenizer_config.json`, or
            `builtin:qwen3`. This path and `architecture`'s expand `~`; a relative one is
            relative to the process's working directory, not to the config file. Unset (and no
            `path`), it is the built-in one of the model `name` names (`extproc.models.
            builtin_model`: Qwen3's first release); a name matching none is a configuration
            error, never a silent Qwen3 tokenizer (docs/decisions/0290).
        architecture: a `config.json` path or directory, or `builtin:<name>`
            (see `extproc.models.builtin_architectures()`); read when the config loads, so a
            missing or malformed one is a configuration error. Unset, as `tokenizer`. The
            router counts KV in the engines' own blocks (`num_gpu_blocks`, `block_size` from
            their metrics), so today only the simulator's profiles use these numbers.
        max_model_len: context limit enforced as vLLM does (tokens).
        dtype: KV-cache dtype (`auto` = the weights' dtype).
        default_output_tokens: expected output length when a request sets no max_tokens
            (tokens); the KV estimate uses it instead of the max_model_len worst case.
        output_estimate: the learned output length that caps `max_tokens` in the decode terms
            of scheduling (`OutputEstimateConfig`; the KV reservation keeps `max_tokens`); a
            switch alone (`output_estimate: off`) keeps the other settings' defaults.
        truncation: head + tail truncation of over-long prompts (off by default); a mode alone
            (`truncation: head-tail`) keeps the other settings' defaults.
        engine_check: what a mismatch between the router's counts and an engine's own does
            (`extproc.datastore.engine_check`: each engine's `/tokenize` counts of fixed texts and
            its `max_model_len`, checked when it joins and every 10 minutes): `warn` (an ERROR
            line, the metric and the admin page; the endpoint keeps its traffic), `drain` (that
            too, and the endpoint gets no new requests while it differs, where the profile has
            the `weight-override-filter`, as the default has) or `off` (no check).
        token_encoder: `auto` (tiktoken built from the tokenizer when it is a byte-level BPE
            with a regex split and agrees with `tokenizers` on a load-time cross-check, else
            `tokenizers`) or `tokenizers` (always the reference encoder; docs/decisions/0200).
        adapters: LoRA adapters the engines serve on this base model (`vllm serve --lora-modules
            NAME=PATH`, or loaded at run time): a request whose `model` names one is this model's
            in tokenizer, KV arithmetic, rate limits and endpoints, and reaches the engine with
            the adapter's name as `model` (never rewritten to the base). Their names are the
            per-adapter metric labels (any other adapter is labelled `other`).
        learn_adapters: also accept adapters the engines report for this model — `/v1/models`
            entries whose `parent` is this model, the adapter names of the LoRA metrics — without
            listing them (default on; at most 1,024 learned names).
    """

    name: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    adapters: list[str] = Field(default_factory=list)
    learn_adapters: bool = True
    path: str | None = Field(default=None, min_length=1)
    tokenizer: str = Field(min_length=1)
    architecture: str = Field(min_length=1)
    max_model_len: int = Field(default=40960, ge=16)
    dtype: str = "auto"
    default_output_tokens: int = Field(default=512, ge=1)
    output_estimate: OutputEstimateConfig = Field(default_factory=OutputEstimateConfig)
    truncation: TruncationConfig = Field(default_factory=TruncationConfig)
    token_encoder: Literal["auto", "tokenizers"] = "auto"
    engine_check: Literal["warn", "drain", "off"] = "warn"

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name.strip() or name != name.strip():
                raise ValueError(f"adapter name {name!r} is blank or has surrounding spaces")
        if len(set(v)) != len(v):
            raise ValueError("an adapter is listed twice")
        return v

    @field_validator("engine_check", mode="before")
    @classmethod
    def _check_off(cls, v: Any) -> Any:
        return yaml_off(v)  # a bare `off` reads as false

    @model_validator(mode="before")
    @classmethod
    def _sources(cls, data: Any) -> Any:
        # No silent default: a Llama served with Qwen3's tokenizer miscounts every request.
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            return data  # the field checks say what is wrong
        return {**data, **model_sources(data["name"], data.get("path"), data.get("tokenizer"), data.get("architecture"))}

    @field_validator("truncation", mode="before")
    @classmethod
    def _mode_alone(cls, v: Any) -> Any:
        return {"mode": v} if isinstance(v, str | bool) else v  # `truncation: head-tail`

    @field_validator("output_estimate", mode="before")
    @classmethod
    def _switch_alone(cls, v: Any) -> Any:
        # `output_estimate: off` (YAML reads false), like `truncation: off`: was refused as not a mapping
        return {"enabled": v} if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _architecture_loads(self) -> ModelConfig:
        # Read at load time, so that `check-config` and `serve` refuse a missing or malformed
        # config.json, an unknown built-in or an unknown KV dtype alike (both passed silently).
        try:
            self.kv_bytes_per_token()
        except (LookupError, OSError, ValueError) as exc:
            raise ValueError(f"architecture {self.architecture!r} (dtype {self.dtype!r}): {exc}") from None
        return self

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token of this model at its `dtype`, from its architecture
        (`extproc.pipeline.kv.Architecture.kv_bytes_per_token`; bytes).

        Raises:
            LookupError, OSError, ValueError: the architecture cannot be read (checked at load).
        """
        from extproc.models import builtin_architecture_path
        from extproc.pipeline.kv import load_architecture

        source = self.architecture
        # A path from the working directory, as `tokenizer`; absolute, so a refusal says where it looked.
        where = (
            builtin_architecture_path(source.removeprefix("builtin:")) if source.startswith("builtin:")
            else os.path.abspath(os.path.expanduser(source))
        )  # fmt: skip
        return load_architecture(where).kv_bytes_per_token(self.dtype)

    @model_validator(mode="after")
    def _output_room(self) -> ModelConfig:
        if self.truncation.mode != "off" and self.truncation.min_output_tokens >= self.max_model_len:
            raise ValueError(
                f"truncation.min_output_tokens ({self.truncation.min_output_tokens}) must be below "
                f"max_model_len ({self.max_model_len}): a cut prompt needs at least one token"
            )
        return self


ROLE_LABEL = "llm-d.ai/role"
"""The endpoint label naming its P/D role (llm-d's Pod label; `EndpointConfig.role`)."""
ENDPOINT_ROLES = ("prefill", "decode", "both")
"""The P/D roles an endpoint may have (`EndpointConfig.role`)."""


class EndpointConfig(Strict):
    """One inference endpoint (a vLLM server).

    Attributes:
        address: `ip:port` written into `x-gateway-destination-endpoint`. Envoy's
            ORIGINAL_DST cluster connects to it as is, so it must be an IP literal.
        models: canonical model names it serves.
        labels: free-form labels (gpu, zone, ...), used by label filters.
        agent: `host:port` of the node agent on this endpoint's node (`llm-extproc agent`,
            gRPC port 9100 by default), or None; `extproc.datastore.agent_client` watches it.
        kv_events: the engine's KV-cache event publisher, `tcp://host:port` (vLLM
            `--kv-events-config` `endpoint`, `tcp://*:5557` on the engine side); set, this
            endpoint's prefix index comes from its events (`extproc.prefix.precise`).
        kv_events_replay: the engine's replay socket (`replay_endpoint`), `tcp://host:port`, to
            recover missed batches; None: a gap drops the endpoint's index instead.
        role: what it does in prefill/decode disaggregation (`extproc.scheduling.pd`):
            `prefill` (takes only the prefill of disaggregated requests), `decode` (the
            destination; prefills only what is not disaggregated) or `both` (a unified engine,
            either pick). Left out: the `llm-d.ai/role` label's value when it has one (llm-d's
            label, also read from Kubernetes Pods), else `both`.
    """

    address: str
    models: list[str] = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)
    agent: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None
    role: Literal["prefill", "decode", "both"] = "both"

    @model_validator(mode="before")
    @classmethod
    def _role_from_label(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") is None and isinstance(data.get("labels"), dict):
            label = data["labels"].get(ROLE_LABEL)
            if label is not None:
                if label not in ENDPOINT_ROLES:
                    raise ValueError(f"label {ROLE_LABEL}={label!r} is not a role: one of {', '.join(ENDPOINT_ROLES)}")
                data = {**data, "role": label}
        return data

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_tcp(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith("tcp://"):
            raise ValueError(f"KV-event endpoints are ZMQ tcp://host:port addresses, got {v!r}")
        host, port = parse_host_port(v.removeprefix("tcp://"))
        if port == 0 or not host or host == "*":
            raise ValueError(f"KV-event endpoint needs a host we can connect to and a port, got {v!r}")
        return v

    @model_validator(mode="after")
    def _replay_needs_events(self) -> EndpointConfig:
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events")
        return self

    @field_validator("agent")
    @classmethod
    def _agent_addr(cls, v: str | None) -> str | None:
        if v is not None and parse_host_port(v)[1] == 0:
            raise ValueError(f"agent port must not be 0 in {v!r}")
        return v

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


class HealthCheckConfig(Strict):
    """Active health checks of endpoints (`GET path`).

    Attributes:
        enabled: probe endpoints; when off every configured endpoint counts as healthy.
        path: probe path.
        interval_s: probe period (seconds). timeout_s: per-probe timeout (seconds).
        unhealthy_threshold / healthy_threshold: consecutive failures (refused, non-2xx) /
            successes to flip.
        timeout_threshold: consecutive probes that only timed out before the endpoint counts
            as down (a slow engine is not a dead one; count; the larger of it and
            unhealthy_threshold applies).
        panic_threshold: when fewer than this share of a model's endpoints is healthy, route
            among every live one (healthy or only timing out), as Envoy's
            healthy_panic_threshold does (0..1; 0 turns panic off).
    """

    enabled: bool = True
    path: str = "/health"
    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=0.5, gt=0)
    unhealthy_threshold: int = Field(default=2, ge=1)
    healthy_threshold: int = Field(default=1, ge=1)
    timeout_threshold: int = Field(default=5, ge=1)
    panic_threshold: float = Field(default=0.5, ge=0, le=1)


class OutlierDetectionConfig(Strict):
    """Passive ejection of endpoints that answer with server errors (Envoy's outlier detection,
    which its `ORIGINAL_DST` cluster does not offer, in the picker instead).

    An endpoint whose last `consecutive_5xx` answers were 5xx is left out by `healthy-filter`
    for `ejection_s` × its ejections so far (at most `max_ejection_s`), then tried again (one
    more 5xx ejects it again at once), unless `max_ejected_share` of its model's endpoints are
    out already; only answers to requests routed after an ejection began count against or for it
    (`extproc.datastore.outliers`). Probes
    cannot see this failure: an engine may pass `/health` and still fail every generation,
    and one that fails fast never produces a first token, so it would look idle and fast.

    Attributes:
        enabled: eject at all.
        consecutive_5xx: 5xx answers in a row that eject (count).
        ejection_s: how long a first ejection lasts (seconds); the n-th lasts n times as long.
        max_ejection_s: the longest ejection (seconds; Envoy's max_ejection_time default).
        max_ejected_share: no new ejection while this share of the endpoints serving the same
            model(s) is ejected (0..1; Envoy's max_ejection_percent, here 50 %).
    """

    enabled: bool = True
    consecutive_5xx: int = Field(default=5, ge=1)
    ejection_s: float = Field(default=10.0, gt=0)
    max_ejection_s: float = Field(default=300.0, gt=0)
    max_ejected_share: float = Field(default=0.5, ge=0, le=1)

    @model_validator(mode="after")
    def _max_above_base(self) -> OutlierDetectionConfig:
        if self.max_ejection_s < self.ejection_s:
            raise ValueError(f"max_ejection_s ({self.max_ejection_s}) must be >= ejection_s ({self.ejection_s})")
        return self


class MetricsScrapeConfig(Strict):
    """Scraping each endpoint's engine `/metrics`.

    Attributes:
        enabled: scrape; when off, load-aware scorers see only our own accounting.
        path: metrics path. interval_s: period (seconds; ~0.05–0.1 s tracks vLLM's queue closely).
        timeout_s: per-scrape timeout (seconds). stale_after_s: metrics older than this are
            stale (seconds); the `stale-metrics-filter` drops such endpoints.
    """

    enabled: bool = True
    path: str = "/metrics"
    interval_s: float = Field(default=0.1, gt=0)
    timeout_s: float = Field(default=0.5, gt=0)
    stale_after_s: float = Field(default=2.0, gt=0)


class PluginSpec(Strict):
    """One plugin instance in a profile: its registered `type`, an optional instance `name`,
    a `weight` (scorers only) and `params` validated by the plugin's own schema."""

    type: str
    name: str | None = None
    weight: float = Field(default=1.0, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)


class ProfileConfig(Strict):
    """A scheduling profile: filters (in order), weighted scorers, one picker.

    `filters` left out means the safe set (`SAFE_FILTERS`: healthy, fresh metrics, KV fit) —
    `filters: []` means none. A configured profile named like a built-in overrides only the
    fields it sets (`SchedulingConfig.all_profiles`): new weights keep the built-in's filters.
    """

    filters: list[PluginSpec] = Field(default_factory=lambda: [PluginSpec(type=t) for t in SAFE_FILTERS])
    scorers: list[PluginSpec] = Field(default_factory=list)
    picker: PluginSpec = Field(default_factory=lambda: PluginSpec(type="max-score-picker"))

    @model_validator(mode="after")
    def _plugins_exist(self) -> ProfileConfig:
        # Through the registry's narrow check: a type name, its parameters, its role. The schema
        # builds no plugin (the scheduler does, once the whole configuration is valid).
        from extproc.scheduling.registry import plugin_problem

        problems: list[ConfigProblem] = []  # every plugin's, not only the first's
        for kind, specs in (("filters", self.filters), ("scorers", self.scorers), ("picker", [self.picker])):
            role = {"filters": "filter", "scorers": "scorer", "picker": "picker"}[kind]
            for i, spec in enumerate(specs):
                where = "picker" if kind == "picker" else f"{kind}[{i}]"
                found = plugin_problem(spec.type, spec.params, role)
                if found is not None:
                    key, message = found
                    problems.append(ConfigProblem(f"{where}{key}", message))
        raise_problems("ProfileConfig", problems)
        return self


def _lead_scorer_problems(name: str, profile: ProfileConfig) -> list[ConfigProblem]:
    """A configured picker's `lead_scorer` (max-score-picker's) names one of the profile's
    scorers (by instance name: its `name`, else its type); the problem when it does not, at
    `profiles.<name>.picker.params.lead_scorer`, naming the profile's scorers. A name matching
    none restricted nothing, silently: a typo, or the TTFT scorer renamed (`name: cost`). (A
    built-in's picker kept while its scorers are replaced is not checked: without its lead
    scorer it restricts nothing, which is what replacing the scorers asks for.)"""
    lead = profile.picker.params.get("lead_scorer") or ""
    scorers = [s.name or s.type for s in profile.scorers]
    if not lead or lead in scorers:
        return []
    message = f"{lead!r} is not a scorer of this profile{did_you_mean(lead, scorers)} (scorers: {', '.join(scorers) or 'none'}); \"\" for none"
    return [ConfigProblem(f"profiles{key_text(name)}.picker.params.lead_scorer", message)]


SAFE_FILTERS: tuple[str, ...] = ("healthy-filter", "stale-metrics-filter", "kv-fit-filter")
"""Filters of a configured profile that lists none: never a dead endpoint, one whose metrics
went stale, or one whose KV cache cannot hold the request."""


def _p(type_: str, weight: float = 1.0, **params: Any) -> PluginSpec:
    return PluginSpec(type=type_, weight=weight, params=params)


_LOAD_AWARE_BALANCERS: list[PluginSpec] = [
    _p("queue-depth-scorer", 1.0),
    _p("kv-utilization-scorer", 1.0),
    _p("flops-load-scorer", 1.0),
    _p("compute-aware-scorer", 1.0),
    _p("backpressure-scorer", 0.5),
    _p("inflight-scorer", 2.0),
    _p("session-affinity-scorer", 1.0),
    _p("weight-override-scorer"),
]
"""The default profile's scorers after the TTFT estimate: count balancers, session, override."""

BUILTIN_PROFILES: dict[str, ProfileConfig] = {
    # The default: KV admission, then the soonest predicted first token, short queues, free KV,
    # light FLOPs load, the design notes' compute-aware weight, steady token rhythm, and few
    # requests in flight by our own count (what least_request balances on). No in-flight cap
    # by token-rhythm pressure (`backpressure-cap-filter`, opt-in): an H100 whose 8k-token
    # prefill steps make its gaps uneven read as "heavy" and was held at 128 requests while
    # the A100s queued. The TTFT estimate outweighs the count balancers together (10 against
    # 6.5): they give a full point for one request fewer, which on a mixed fleet is the slower
    # GPU (decision 0005, second addendum; docs/benchmarks.md). The TTFT estimate counts only
    # the prompt's uncached tokens (the prefix index), so prefix affinity lives there, in
    # seconds (decision 0007); a session's last endpoint gets one point.
    "load-aware": ProfileConfig(
        # weight-override: an operator's drain/lower (admin webhook), decision 0170.
        filters=[*(_p(name) for name in SAFE_FILTERS), _p("weight-override-filter")],
        scorers=[_p("ttft-estimate-scorer", 10.0), *_LOAD_AWARE_BALANCERS],
        # On a request whose prefix an endpoint holds, the balancers choose only among the
        # endpoints the TTFT cost rates within a quarter of the best prefill cost (decision 0240);
        # on any other request, within one whole prefill cost (decision 0265).
        picker=_p("max-score-picker", lead_scorer="ttft-estimate-scorer", lead_min_score_unmatched=0.5),
    ),
    # GIE-style weighted prefix affinity (the inference extension's default shape: prefix 3,
    # queue 1, KV utilisation 1), for comparison and for users who want it; the default profile
    # trades the cached prefix against queueing inside the TTFT estimate instead.
    "prefix": ProfileConfig(
        filters=[_p(name) for name in SAFE_FILTERS],
        scorers=[
            _p("prefix-scorer", 3.0),
            _p("queue-depth-scorer", 1.0),
            _p("kv-utilization-scorer", 1.0),
            _p("inflight-scorer", 1.0),
        ],
    ),
    # Multi-LoRA fleets: the default profile plus the adapter's residency (GPU 1.0 > CPU 0.7 >
    # free slot 0.6 > evictable 0.3 > full 0) with the spread rule for hot adapters, weighed as
    # much as the TTFT estimate: a non-resident adapter costs a load (hundreds of milliseconds
    # to seconds) the estimate does not see (decision 0335).
    "lora": ProfileConfig(
        filters=[*(_p(name) for name in SAFE_FILTERS), _p("weight-override-filter")],
        scorers=[_p("ttft-estimate-scorer", 10.0), _p("lora-affinity-scorer", 10.0), *_LOAD_AWARE_BALANCERS],
        picker=_p("max-score-picker", lead_scorer="ttft-estimate-scorer", lead_min_score_unmatched=0.5),
    ),
    # Issue-1 baseline: fewest in-flight requests counted by this server, random tie-break.
    "least-inflight": ProfileConfig(filters=[_p("healthy-filter")], scorers=[_p("inflight-scorer")]),
    # The seed's compute-aware weight alone.
    "compute-aware": ProfileConfig(
        filters=[_p("healthy-filter"), _p("stale-metrics-filter"), _p("kv-fit-filter")],
        scorers=[_p("compute-aware-scorer")],
    ),
    "random": ProfileConfig(filters=[_p("healthy-filter")], picker=_p("random-picker")),
    # P/D disaggregation's two picks (`extproc.scheduling.pd`, decision 0330). The decode pick:
    # decode is bound by concurrency and KV, so few requests in flight, free KV and a short
    # queue; the prefix it already holds shrinks the transfer (and may keep the request local).
    "pd-decode": ProfileConfig(
        filters=[*(_p(name) for name in SAFE_FILTERS), _p("weight-override-filter")],
        scorers=[
            _p("inflight-scorer", 2.0),
            _p("kv-utilization-scorer", 2.0),
            _p("queue-depth-scorer", 1.0),
            _p("prefix-scorer", 1.0),
            _p("weight-override-scorer"),
        ],
    ),
    # The prefill pick: the soonest predicted first token (prefill backlog and the cached prefix
    # in seconds, as the default profile), then short queues.
    "pd-prefill": ProfileConfig(
        filters=[*(_p(name) for name in SAFE_FILTERS), _p("weight-override-filter")],
        scorers=[
            _p("ttft-estimate-scorer", 10.0),
            _p("queue-depth-scorer", 1.0),
            _p("inflight-scorer", 1.0),
            _p("weight-override-scorer"),
        ],
    ),
}


MAX_ATTENTION_RATIO = 1e-3
"""Largest `scheduling.prefill_model.attention_ratio` accepted (1/tokens): 50× the calibrated
`PREFILL_ATTENTION_RATIO` (2e-5 for an 8B model; the ratio scales with attention width × layers
over parameters, which no common model raises 50-fold)."""


class PrefillModelConfig(Strict):
    """The prior of each endpoint's learned TTFT fit, TTFT ≈ t0 + s · prefill tokens ahead
    (`extproc.datastore.prefill_fit`, whose module doc gives the formula and the defaults'
    sources).

    Attributes:
        prior_t0_s: fixed time to first token (seconds; finite).
        prior_s_per_token: prefill seconds per token (≈ an A100 prefilling an 8B model; finite).
        prior_weight: how many samples the prior counts as (samples; finite).
        forget: per-sample decay of older samples (0.95 ≈ the last 20 first tokens).
        prior_s_per_token_by_gpu: the prior prefill seconds per token by GPU name, matched
            case-insensitively as a word of the endpoint's `gpu_label` label (the longest
            name wins); an endpoint whose GPU is listed starts from its own GPU's speed and is
            predicted with it until observed (decision 0255). Default
            `PREFILL_S_PER_TOKEN_BY_GPU` (h100, h200 23.5 µs, a100 67.3 µs: an 8B model; scale
            for others). `{}` turns it off.
        gpu_label: the endpoint label naming its GPU (`Endpoint.gpu`; not empty): the one
            setting for every per-GPU table, this prior's and `ttft-estimate-scorer`'s decode model.
        attention_ratio: prefill attention's cost per pair of tokens relative to one token's
            linear cost (1/tokens; `extproc.datastore.prefill_fit.prefill_work`): the fit's x
            and every prefill backlog count `m + ratio · m · (2p + m)` for m new tokens after p
            cached. Default `PREFILL_ATTENTION_RATIO` (2e-5, an 8B model); 0 counts tokens only.
            At most `MAX_ATTENTION_RATIO` (1e-3, 50× the calibrated 2e-5, above any model's
            attention width × layers over its parameters): a typo such as 2e-1 counted a
            1,000-token prompt as 201,000 tokens of work and every prefill cost was absurd.
    """

    # Finite, like the GPU table's entries: a prior weight of inf made the fit NaN at its first
    # sample (t0 and s both), and an infinite t0 or s every unobserved endpoint's cost inf.
    prior_t0_s: float = Field(default=0.02, ge=0, allow_inf_nan=False)
    prior_s_per_token: float = Field(default=5e-5, gt=0, allow_inf_nan=False)
    prior_weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    forget: float = Field(default=0.95, gt=0, le=1)
    prior_s_per_token_by_gpu: dict[str, float] = Field(default_factory=lambda: dict(PREFILL_S_PER_TOKEN_BY_GPU))
    gpu_label: str = Field(default="gpu", min_length=1)  # "" named no label: every per-GPU table silently off
    attention_ratio: float = Field(default=PREFILL_ATTENTION_RATIO, ge=0, allow_inf_nan=False)

    @field_validator("attention_ratio")
    @classmethod
    def _plausible_ratio(cls, v: float) -> float:
        if v > MAX_ATTENTION_RATIO:
            work = prefill_work(1000, 0, v)
            raise ValueError(
                f"{v:g} is above {MAX_ATTENTION_RATIO:g} (1/tokens): a 1,000-token prompt would count as {work:,} "
                f"tokens of work; the calibrated ratio of an 8B model is {PREFILL_ATTENTION_RATIO:g}"
            )
        return v

    @field_validator("prior_s_per_token_by_gpu", mode="before")  # strict: no True, no "3e-5"
    @classmethod
    def _positive_speeds(cls, v: Any) -> dict[str, float]:
        return gpu_table(v, "prefill seconds per token")


class HotPrefixConfig(Strict):
    """Hot shared prefixes (design notes 3.3): counted over `window_s` seconds in `buckets`
    buckets; `min_count` requests in the window make one hot (metrics, `/api/v1/endpoints`)."""

    window_s: float = Field(default=60.0, gt=0)
    buckets: int = Field(default=12, ge=1, le=600)
    min_count: int = Field(default=8, ge=1)
    max_tracked: int = Field(default=4096, ge=1)


class WarmupConfig(Strict):
    """Warm-up of hot prefixes onto cold endpoints (`extproc.prefix.warmup`), off by default.

    Attributes:
        enabled: send warm-ups at all.
        replicas: warm a hot prefix until this many endpoints hold it (count).
        max_per_s: most warm-up requests per second, fleet-wide.
        kv_watermark: never warm an endpoint whose KV usage is at or above this (0..1).
        timeout_s: a warm-up's HTTP timeout (seconds).
    """

    enabled: bool = False
    replicas: int = Field(default=2, ge=1)
    max_per_s: float = Field(default=1.0, gt=0)
    kv_watermark: float = Field(default=0.8, gt=0, le=1)
    timeout_s: float = Field(default=30.0, gt=0)


class PrefixConfig(Strict):
    """Prefix-cache affinity and session affinity (`extproc.prefix`).

    Attributes:
        enabled: hash prompts into blocks and keep the prefix index; off, no endpoint is
            believed to hold anything (`ttft-estimate-scorer` counts whole prompts).
        max_index_bytes: memory budget of the whole index (bytes; `BYTES_PER_ENTRY` = 128
            bytes per (endpoint, block) entry, measured 104, so the 64 MiB default holds 524k
            blocks, 8.4M tokens at 16 per block: the prefix caches of ~10 H100s serving 8B models).
        default_capacity_blocks: an endpoint's bound until its engine reports `num_gpu_blocks`
            (blocks).
        min_match_tokens: a cached prefix shorter than this counts as none (tokens). Saving a
            few dozen tokens of prefill (~1 ms) is noise beside load, and a burst of identical
            short prompts must spread like any other; 128 tokens is ~3–6 ms of prefill on the
            simulator's profiles.
        session_header: request header naming a session (lower case); "" for none.
        session_from_user: use the OpenAI `user` field when the header is absent.
        session_ttl_s: a session unused this long is forgotten (seconds).
        max_sessions: most sessions remembered (count).
        hot: hot-prefix tracking.
        warmup: warm-up requests carrying hot prefixes to cold endpoints (opt-in).
        speculative_ttl_s: on endpoints with `kv_events`, how long a pick's blocks count before
            the engine's events confirm them (seconds); see `extproc.prefix.precise`.
    """

    enabled: bool = True
    max_index_bytes: int = Field(default=64 * 1024 * 1024, ge=1024 * 1024)
    default_capacity_blocks: int = Field(default=16384, ge=1)
    min_match_tokens: int = Field(default=128, ge=0)
    session_header: str = "x-session-id"
    session_from_user: bool = True
    session_ttl_s: float = Field(default=600.0, gt=0)
    max_sessions: int = Field(default=100_000, ge=1)
    hot: HotPrefixConfig = Field(default_factory=HotPrefixConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    speculative_ttl_s: float = Field(default=2.0, gt=0)

    @field_validator("session_header")
    @classmethod
    def _lower_header(cls, v: str) -> str:
        return v.lower()


class TierConfig(Strict):
    """Token-range tiers (design notes): < low_latency_below → `low-latency`,
    ≤ high_throughput_above → `balanced`, above → `high-throughput` (prompt tokens)."""

    low_latency_below: int = Field(default=512, ge=1)
    high_throughput_above: int = Field(default=2048, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> TierConfig:
        if self.high_throughput_above < self.low_latency_below:
            raise ValueError("high_throughput_above must be >= low_latency_below")
        return self


NIXL_LINK_GBYTES_PER_S = 25.0
"""Default KV transfer bandwidth between a prefill and a decode engine (GB/s, 1e9 bytes/s):
one 400 Gb/s RDMA NIC (ConnectX-7, 50 GB/s line rate) at the ~50 % NIXL's published
UCX/RDMA transfers reach for vLLM's block sizes (docs/decisions/0330)."""


class DisaggregationConfig(Strict):
    """Prefill/decode disaggregation (`extproc.scheduling.pd`, docs/decisions/0330). It acts on a
    model whose endpoints are not all `role: both`; a fleet of `both` is routed as without it.

    Attributes:
        enabled: off: a prefill-role endpoint takes no request and decode endpoints prefill
            locally.
        threshold_tokens: disaggregate only when the request's uncached prompt tokens on the
            chosen decode endpoint are above this (tokens; 0: every request). Default 256
            (vllm-project/router's; decision 0330's sweep).
        decode_profile / prefill_profile: the profiles of the two picks (built-ins
            `pd-decode`, `pd-prefill`, or any other).
        link_gbytes_per_s: KV transfer bandwidth between prefill and decode engines (GB/s):
            the transfer time prompt KV bytes ÷ this enters the pair's predicted TTFT.
            Default `NIXL_LINK_GBYTES_PER_S`.
    """

    enabled: bool = True
    threshold_tokens: int = Field(default=256, ge=0)
    decode_profile: str = "pd-decode"
    prefill_profile: str = "pd-prefill"
    link_gbytes_per_s: float = Field(default=NIXL_LINK_GBYTES_PER_S, gt=0, allow_inf_nan=False)


class SchedulingConfig(Strict):
    """Scheduling settings.

    Attributes:
        mode: `endpoint` — pick an endpoint and set `x-gateway-destination-endpoint`;
            `tier` — set `x-llm-tier` from the prompt length and let Envoy route to per-tier
            clusters (envoy/tier.yaml).
        profile: the profile used for every request (a built-in or one under `profiles`).
        profiles: user-defined profiles (added to the built-ins: load-aware, least-inflight,
            compute-aware, random; a user profile may replace a built-in by name).
        block_size: KV block size of the engines when they do not export theirs (tokens).
        health_check: active health checking. metrics: engine metrics scraping.
        outlier_detection: passive ejection of endpoints answering 5xx.
        tiers: tier boundaries (tier mode).
        prefix: prefix-cache and session affinity (the prefix index).
        prefill_model: the prior of each endpoint's learned TTFT fit.
        explain_header: add `x-llm-route-debug` (scores of the chosen endpoint and the
            runner-up) to the response; off by default since it reveals fleet internals.
        disaggregation: prefill/decode disaggregation over endpoints with P/D roles.
        lora_max_loras: GPU LoRA adapter slots per engine assumed where the engine exports
            neither `vllm:max_gpu_lora_adapters` nor `lora_requests_info`'s `max_lora` (vLLM's
            `--max-loras`, whose default is 1; count). Read by `lora-affinity-scorer` and the
            `llm_extproc_lora_requests_total` residency label.
    """

    mode: Literal["endpoint", "tier"] = "endpoint"
    profile: str = "load-aware"
    profiles: dict[str, ProfileConfig] = Field(default_factory=dict)
    block_size: int = Field(default=16, ge=1)
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    outlier_detection: OutlierDetectionConfig = Field(default_factory=OutlierDetectionConfig)
    metrics: MetricsScrapeConfig = Field(default_factory=MetricsScrapeConfig)
    tiers: TierConfig = Field(default_factory=TierConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    prefill_model: PrefillModelConfig = Field(default_factory=PrefillModelConfig)
    explain_header: bool = False
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    lora_max_loras: int = Field(default=1, ge=1, le=4096)

    @model_validator(mode="after")
    def _profile_known(self) -> SchedulingConfig:
        profiles = self.all_profiles()
        problems = [] if self.profile in profiles else [ConfigProblem("profile", undefined_profile(self.profile, profiles))]
        for key in ("decode_profile", "prefill_profile"):
            name = getattr(self.disaggregation, key)
            if name not in profiles:
                problems.append(ConfigProblem(f"disaggregation.{key}", undefined_profile(name, profiles)))
        for name, configured in self.profiles.items():
            if "picker" in configured.model_fields_set:
                problems += _lead_scorer_problems(name, profiles[name])
        raise_problems("SchedulingConfig", problems)
        return self

    def all_profiles(self) -> dict[str, ProfileConfig]:
        """Built-in profiles overlaid with the configured ones; a configured profile named like a
        built-in replaces only the fields it sets (filters, scorers, picker)."""
        out = dict(BUILTIN_PROFILES)
        for name, profile in self.profiles.items():
            base = BUILTIN_PROFILES.get(name)
            if base is None:
                out[name] = profile
            else:
                out[name] = base.model_copy(update={f: getattr(profile, f) for f in profile.model_fields_set})
        return out


class KVAdmissionConfig(Strict):
    """KV-cache admission control.

    Attributes:
        enabled: reserve KV blocks on pick (the `kv-fit-filter` reads them).
        reject_status: status when no endpoint can fit the request: 429 (with retry-after) or 503.
        retry_after_s: the `retry-after` value on that 429 (seconds).
        settle_after_s: without an observed first token, a reservation stops counting at the
            first scrape this long after the pick (seconds; at most 3600, the bound other replicas accept).
    """

    enabled: bool = True
    reject_status: Literal[429, 503] = 429
    retry_after_s: int = Field(default=1, ge=1)
    settle_after_s: float = Field(default=2.0, gt=0, le=3600)


class PriorityConfig(Strict):
    """Priority classes and shedding under saturation.

    The header value (`critical`, `standard`, `sheddable`; default `standard`) is read from
    `header`; any other value is a 400. Fleet saturation is max(mean effective KV usage,
    mean waiting requests / `queue_saturation_depth`) over the model's healthy endpoints (0..1+).
    Sheddable requests are refused at `shed_sheddable_at`, standard ones at
    `shed_standard_at`; critical ones only when no endpoint can fit them.

    A client claims a class by `header` only within `claimable` (default standard and sheddable:
    a client-sent `critical` must not jump the queue); a higher claim is downgraded to the
    highest claimable class below it (`on_unclaimable: downgrade`) or refused with a 400
    (`reject`), counted in `llm_extproc_priority_claims_bounded_total`. `trusted_header`, when
    set, names a header that may carry any class: set it only in a trusted layer before Envoy's
    ext_proc filter (an auth filter) and strip client copies there.
    """

    header: str = "x-llm-priority"
    default: Literal["critical", "standard", "sheddable"] = "standard"
    claimable: tuple[Literal["critical", "standard", "sheddable"], ...] = ("standard", "sheddable")
    on_unclaimable: Literal["downgrade", "reject"] = "downgrade"
    trusted_header: str | None = None
    shed_sheddable_at: float = Field(default=0.8, gt=0)
    shed_standard_at: float = Field(default=1.0, gt=0)
    queue_saturation_depth: int = Field(default=32, ge=1)
    retry_after_s: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _sheddable_first(self) -> PriorityConfig:
        if self.shed_sheddable_at > self.shed_standard_at:
            raise ValueError(
                f"shed_sheddable_at ({self.shed_sheddable_at}) must be <= shed_standard_at "
                f"({self.shed_standard_at}): sheddable requests are refused first"
            )
        return self

    @field_validator("header", "trusted_header")
    @classmethod
    def _lower(cls, v: str | None) -> str | None:
        return v.lower() if v is not None else None

    @model_validator(mode="after")
    def _trusted_differs(self) -> PriorityConfig:
        if self.trusted_header is not None and self.trusted_header == self.header:
            raise ValueError(f"trusted_header must differ from header ({self.header!r}): clients set that one")
        return self


class AdmissionConfig(Strict):
    """Admission control: KV fit and priority shedding."""

    kv: KVAdmissionConfig = Field(default_factory=KVAdmissionConfig)
    priority: PriorityConfig = Field(default_factory=PriorityConfig)


class TelemetryConfig(Strict):
    """Response-path telemetry (TTFT, inter-token latency, usage, backpressure).

    Attributes:
        enabled: stream generation responses through the server (one ext_proc message per body
            chunk): per-endpoint TTFT / ITL / jitter feed the scorers, usage is extracted, the
            first content token moves a request from prefill to decode. Off: only response
            headers are seen (first token ≈ response start) and bodies never cross the server.
        sample_rate: fraction of generation requests whose responses are observed (0..1]. Each
            observed body chunk costs the server one ext_proc message (~0.3 ms of CPU here,
            docs/benchmarks.md), and every chunk of an observed stream waits for the server's
            reply; per-endpoint statistics need only a sample. Default 0.1: one request in ten.
            Unobserved requests still end prefill at their response headers (engines send them
            with the first token). Telemetry metrics count the sample only.
        observer: markers (`: x-chunk-id=N x-sent-at-us=T` SSE comments, opt-in) and body bounds.
        stats: per-endpoint windows and backpressure thresholds (σ of inter-token gaps ≥ 15 ms
            light, ≥ 25 ms heavy; latency buckets 50 / 200 ms).
        response_headers: `always` (every generation response's headers cross the server: its
            status feeds outlier detection and the error-shape rewrite, they carry the
            rate-limit, truncation and explain headers, and they end prefill) or `when_needed`:
            unobserved requests skip that message (~0.15 ms of server CPU each) when nothing
            configured needs it — outlier detection off, no explain header, no rate limits, no
            truncation — and leave prefill at their endpoint's predicted TTFT instead; engines'
            errors then reach clients in the engines' own shape. docs/decisions/0201.
    """

    enabled: bool = True
    sample_rate: float = Field(default=0.1, gt=0, le=1)
    response_headers: Literal["always", "when_needed"] = "always"
    observer: ObserverOptions = Field(default_factory=ObserverOptions)
    stats: StreamStatsParams = Field(default_factory=StreamStatsParams)


class DecisionLogConfig(Strict):
    """The decision log (`extproc.telemetry.decision_log`): one JSON line per decided
    generation request — counts, model, endpoint, TTFT, outcome, truncation; never prompt text
    or credentials — for `llm-extproc analyze`.

    Attributes:
        path: the log file; None (default) writes no log.
        max_bytes: size at which the file rotates (bytes).
        backup_count: rotated files kept (`path.1` … `path.N`).
        queue_size: lines waiting for the writer thread; more are dropped and counted
            (`llm_extproc_decision_log_dropped_total`) rather than slow the event loop.
    """

    path: str | None = None
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=4096)
    backup_count: int = Field(default=5, ge=1)
    queue_size: int = Field(default=10_000, ge=1)


class DiscoveryConfig(Strict):
    """Where endpoints come from (`extproc.discovery`; docs/discovery.md).

    Attributes:
        sources: discovery sources, each `{type: <name>, ...its parameters}`; the types are
            registered in `extproc.discovery.registry.SOURCES` (static, dns, kubernetes). Default:
            the `static` source alone — the top-level `endpoints` list, reloaded when the file
            changes or on SIGHUP. Several sources add up; an address two sources report is
            taken from the first.
        drain_timeout_s: an endpoint that left its source stops getting new requests at once
            and is removed when its last request ends, or after this long at the latest
            (seconds; its remaining requests then finish against the detached endpoint).
        initial_wait_s: at start, wait at most this long for each source's first answer
            before serving (seconds).
    """

    sources: list[Any] = Field(default_factory=lambda: [{"type": "static"}], validate_default=True)
    drain_timeout_s: float = Field(default=300.0, gt=0)
    initial_wait_s: float = Field(default=5.0, ge=0)

    @field_validator("sources", mode="after")
    @classmethod
    def _sources(cls, v: list[Any]) -> list[Any]:
        from extproc.discovery.registry import parse_params

        out = []
        problems: list[ConfigProblem] = []  # every source's, not only the first's
        for i, spec in enumerate(v):
            try:
                out.append(parse_params(spec))
            except ValueError as exc:
                problems.append(ConfigProblem(f"[{i}]", str(exc)))
        raise_problems("DiscoveryConfig", problems)
        if sum(1 for p in out if p.type == "static") > 1:
            raise ValueError("the static source may be listed once")
        return out

    def has_static(self) -> bool:
        """Whether the top-level `endpoints` list is a source."""
        return any(p.type == "static" for p in self.sources)


class ProtocolConfig(Strict):
    """How the server speaks to its proxy.

    Attributes:
        mode: `buffered` — our own Envoy configs (envoy/*.yaml): the request body BUFFERED,
            per-request mode overrides; `epp` — the Gateway API Inference Extension's Endpoint
            Picker Protocol, as an InferencePool's picker behind a gateway that configures
            FULL_DUPLEX_STREAMED bodies with trailers SEND (`extproc.server.epp`, docs/epp.md).
        fallbacks: (epp) endpoints after the primary in the destination list, best first;
            only for a proxy that retries down the list (a bare Envoy's ORIGINAL_DST cluster
            reads one address: keep 0 there).
        destination_namespace: (epp) the dynamic-metadata namespace of the destination and
            of the served endpoint read back (the protocol's default `envoy.lb`).
        subset_namespace: (epp) the filter-metadata namespace of the endpoint subset hint
            (the protocol's default `envoy.lb.subset_hint`).
        chunk_bytes: (epp) largest body piece sent back in one streamed body response
            (bytes; the reference picker's 62,000, under the 64 KiB some proxies accept).
        extra_served_paths: (epp) literal paths passed to an engine besides the allow-list
            (`extproc.protocol.openai.SERVED_PATHS`); every other path is answered 404 by the
            server, as the shipped Envoy configs answer it in BUFFERED mode (there, the Envoy
            config's own `extra_served_paths` adds paths).
    """

    mode: Literal["buffered", "epp"] = "buffered"
    fallbacks: int = Field(default=0, ge=0, le=16)
    destination_namespace: str = Field(default="envoy.lb", min_length=1)
    subset_namespace: str = Field(default="envoy.lb.subset_hint", min_length=1)
    chunk_bytes: int = Field(default=62_000, ge=1024, le=4 * 1024 * 1024)
    extra_served_paths: list[str] = Field(default_factory=list)

    @field_validator("extra_served_paths")
    @classmethod
    def _literal_paths(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not p.startswith("/")]
        if bad:
            raise ValueError(f"extra_served_paths must be paths starting with '/', got {bad}")
        return v


class Config(Strict):
    """The whole configuration."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    models: list[ModelConfig] = Field(min_length=1)
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    ratelimit: RateLimitConfig = Field(default_factory=RateLimitConfig)
    decision_log: DecisionLogConfig = Field(default_factory=DecisionLogConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    protocol: ProtocolConfig = Field(default_factory=ProtocolConfig)
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        raise_problems("Config", self._cross_problems())
        return self

    def _cross_problems(self) -> Iterator[ConfigProblem]:
        """Every cross-section problem (`_cross_checks` raises them all at once)."""
        if self.protocol.mode == "epp" and self.scheduling.mode != "endpoint":
            yield ConfigProblem("protocol.mode", "epp picks endpoints; it needs scheduling.mode: endpoint (tier mode routes by cluster)")
        names: dict[str, str] = {}
        for i, m in enumerate(self.models):
            for n in [m.name, *m.aliases, *m.adapters]:
                if n in names:
                    yield ConfigProblem(f"models[{i}]", f"name or alias {n!r} already used by model {names[n]!r}")
                    continue
                names[n] = m.name
        canonical = {m.name for m in self.models}
        if self.discovery.has_static() and not self.endpoints:
            yield ConfigProblem("endpoints", "at least one endpoint is needed (or list only dns / kubernetes sources in discovery.sources)")
        if self.endpoints and not self.discovery.has_static():
            yield ConfigProblem("", "endpoints are the static source's list: add {type: static} to discovery.sources, or remove them")
        for i, src in enumerate(self.discovery.sources):
            for m in getattr(src, "models", ()):
                if m not in canonical:
                    yield ConfigProblem(f"discovery.sources[{i}].models", unknown_model(m, canonical))
        seen: set[str] = set()
        for i, e in enumerate(self.endpoints):
            if e.address in seen:
                yield ConfigProblem(f"endpoints[{i}].address", f"{e.address!r} is listed twice")
            seen.add(e.address)
            for m in e.models:
                if m not in canonical:
                    yield ConfigProblem(f"endpoints[{i}].models", unknown_model(m, canonical))
        for name, tenant in self.ratelimit.tenants.items():
            for m in tenant.models:
                if m not in canonical:
                    yield ConfigProblem(f"ratelimit.tenants{key_text(name)}.models", unknown_model(m, canonical))
        fc = self.flow_control
        if fc.enabled and self.ratelimit.enabled and fc.max_wait_s >= self.ratelimit.inflight_lease_s:
            # A queued request holds its tenant's concurrency slot: a lease shorter than the
            # wait frees the slot of a request still waiting (llm-d-router #2295's failure shape).
            yield ConfigProblem(
                "flow_control.bands",
                f"the longest queue wait ({fc.max_wait_s:g} s) must be below ratelimit.inflight_lease_s "
                f"({self.ratelimit.inflight_lease_s:g} s): a queued request holds its tenant's in-flight slot",
            )
        if fc.enabled and fc.weights and not fc.fairness_header.trusted:
            # Flows are the rate limiter's tenants unless a trusted fairness header names them:
            # a weight for a name no tenant carries never applies (every such request would be
            # `anonymous`, or its key's hash), silently.
            if not self.ratelimit.enabled:
                yield ConfigProblem(
                    "flow_control.weights",
                    "weights apply to tenants, and tenants are identified by the rate limiter (ratelimit.enabled is "
                    "false, so every request is one flow, `anonymous`): enable ratelimit with its tenants, or trust "
                    f"flow_control.fairness_header ({fc.fairness_header.name}) from a gateway that sets it",
                )
            else:
                for name in sorted(set(fc.weights) - set(self.ratelimit.tenants) - {"anonymous"}):
                    yield ConfigProblem(
                        f"flow_control.weights{key_text(name)}",
                        f"names no tenant in ratelimit.tenants (known: {', '.join(sorted(self.ratelimit.tenants)) or 'none'}); "
                        "its weight would never apply",
                    )
        if fc.enabled and fc.gate.mode == "utilization" and not self.scheduling.metrics.enabled:
            yield ConfigProblem(
                "flow_control.gate.mode",
                "the utilization gate reads the engines' scraped metrics, and scheduling.metrics.enabled is false: every "
                "endpoint would count as saturated and every request wait out its TTL for a 503; turn scraping on or "
                "use gate.mode: router",
            )
