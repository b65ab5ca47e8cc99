"""The configuration schema. Every model forbids unknown keys, so a typo is an error that names it.

Shape (see `deploy/config.example.yaml` for a commented example)::

    listen:    {grpc: "0.0.0.0:9002", admin: "0.0.0.0:9090"}
    limits:    {max_body_bytes: 4194304, decision_timeout_ms: 1500, ...}
    models:    [{name, aliases, tokenizer, architecture, max_model_len, dtype, ...}]
    endpoints: [{address: "10.0.0.1:8000", models: [...], labels: {...}}]
    scheduling: {mode: endpoint, profile: load-aware, profiles: {...}, metrics: {...}, health_check: {...}}
    admission: {kv: {...}, priority: {...}}
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from extproc.telemetry.observer import ObserverOptions
from extproc.telemetry.stats import StreamStatsParams

__all__ = [
    "AdminConfig",
    "Config",
    "EndpointConfig",
    "HealthCheckConfig",
    "LimitsConfig",
    "ListenConfig",
    "ModelConfig",
    "SchedulingConfig",
    "MetricsScrapeConfig",
    "PluginSpec",
    "ProfileConfig",
    "SAFE_FILTERS",
    "TierConfig",
    "PrefixConfig",
    "HotPrefixConfig",
    "PrefillModelConfig",
    "AdmissionConfig",
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
    """

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_json_values: int = Field(default=16384, ge=64)
    max_messages: int = Field(default=2048, ge=1)
    max_prompts: int = Field(default=1024, ge=1)
    max_chars_per_token: int = Field(default=16, ge=1)
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
        agent: `host:port` of the node agent on this endpoint's node (`llm-extproc agent`,
            gRPC port 9100 by default), or None; `extproc.datastore.agent_client` watches it.
        kv_events: the engine's KV-cache event publisher, `tcp://host:port` (vLLM
            `--kv-events-config` `endpoint`, `tcp://*:5557` on the engine side); set, this
            endpoint's prefix index comes from its events (`extproc.prefix.precise`).
        kv_events_replay: the engine's replay socket (`replay_endpoint`), `tcp://host:port`, to
            recover missed batches; None: a gap drops the endpoint's index instead.
    """

    address: str
    models: list[str] = Field(min_length=1)
    labels: dict[str, str] = Field(default_factory=dict)
    agent: str | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None

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


class OutlierDetectionConfig(_Strict):
    """Passive ejection of endpoints that answer with server errors (Envoy's outlier detection,
    which its `ORIGINAL_DST` cluster does not offer, in the picker instead).

    An endpoint whose last `consecutive_5xx` answers were 5xx is left out by `healthy-filter`
    for `ejection_s` seconds, then tried again (one more 5xx ejects it again at once). Probes
    cannot see this failure: an engine may pass `/health` and still fail every generation,
    and one that fails fast never produces a first token, so it would look idle and fast.

    Attributes:
        enabled: eject at all.
        consecutive_5xx: 5xx answers in a row that eject (count).
        ejection_s: how long an ejection lasts (seconds).
    """

    enabled: bool = True
    consecutive_5xx: int = Field(default=5, ge=1)
    ejection_s: float = Field(default=10.0, gt=0)


class MetricsScrapeConfig(_Strict):
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


class PluginSpec(_Strict):
    """One plugin instance in a profile: its registered `type`, an optional instance `name`,
    a `weight` (scorers only) and `params` validated by the plugin's own schema."""

    type: str
    name: str | None = None
    weight: float = Field(default=1.0, ge=0)
    params: dict[str, Any] = Field(default_factory=dict)


class ProfileConfig(_Strict):
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
        from extproc.scheduling.registry import PluginConfigError, build

        for kind, specs in (("filters", self.filters), ("scorers", self.scorers), ("picker", [self.picker])):
            for i, spec in enumerate(specs):
                try:
                    plugin = build(spec.type, spec.params, name=spec.name)
                except PluginConfigError as exc:
                    raise ValueError(f"{kind}[{i}]: {exc}") from None
                method, noun = {"filters": ("filter", "filter"), "scorers": ("score", "scorer"), "picker": ("pick", "picker")}[kind]
                if not callable(getattr(plugin, method, None)):
                    raise ValueError(f"{kind}[{i}]: {spec.type!r} is not a {noun}")
        return self


SAFE_FILTERS: tuple[str, ...] = ("healthy-filter", "stale-metrics-filter", "kv-fit-filter")
"""Filters of a configured profile that lists none: never a dead endpoint, one whose metrics
went stale, or one whose KV cache cannot hold the request."""


def _p(type_: str, weight: float = 1.0, **params: Any) -> PluginSpec:
    return PluginSpec(type=type_, weight=weight, params=params)


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
        filters=[_p(name) for name in SAFE_FILTERS],
        scorers=[
            _p("ttft-estimate-scorer", 10.0),
            _p("queue-depth-scorer", 1.0),
            _p("kv-utilization-scorer", 1.0),
            _p("flops-load-scorer", 1.0),
            _p("compute-aware-scorer", 1.0),
            _p("backpressure-scorer", 0.5),
            _p("inflight-scorer", 2.0),
            _p("session-affinity-scorer", 1.0),
        ],
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
    # Issue-1 baseline: fewest in-flight requests counted by this server, random tie-break.
    "least-inflight": ProfileConfig(filters=[_p("healthy-filter")], scorers=[_p("inflight-scorer")]),
    # The seed's compute-aware weight alone.
    "compute-aware": ProfileConfig(
        filters=[_p("healthy-filter"), _p("stale-metrics-filter"), _p("kv-fit-filter")],
        scorers=[_p("compute-aware-scorer")],
    ),
    "random": ProfileConfig(filters=[_p("healthy-filter")], picker=_p("random-picker")),
}


class PrefillModelConfig(_Strict):
    """The prior of each endpoint's learned TTFT fit, TTFT ≈ t0 + s · prefill tokens ahead
    (`extproc.datastore.prefill_fit`, whose module doc gives the formula and the defaults'
    sources).

    Attributes:
        prior_t0_s: fixed time to first token (seconds).
        prior_s_per_token: prefill seconds per token (≈ an A100 prefilling an 8B model).
        prior_weight: how many samples the prior counts as (samples).
        forget: per-sample decay of older samples (0.95 ≈ the last 20 first tokens).
    """

    prior_t0_s: float = Field(default=0.02, ge=0)
    prior_s_per_token: float = Field(default=5e-5, gt=0)
    prior_weight: float = Field(default=1.0, gt=0)
    forget: float = Field(default=0.95, gt=0, le=1)


class HotPrefixConfig(_Strict):
    """Hot shared prefixes (design notes 3.3): counted over `window_s` seconds in `buckets`
    buckets; `min_count` requests in the window make one hot (metrics, `/api/v1/endpoints`)."""

    window_s: float = Field(default=60.0, gt=0)
    buckets: int = Field(default=12, ge=1, le=600)
    min_count: int = Field(default=8, ge=1)
    max_tracked: int = Field(default=4096, ge=1)


class PrefixConfig(_Strict):
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
    speculative_ttl_s: float = Field(default=2.0, gt=0)

    @field_validator("session_header")
    @classmethod
    def _lower_header(cls, v: str) -> str:
        return v.lower()


class TierConfig(_Strict):
    """Token-range tiers (design notes): < low_latency_below → `low-latency`,
    ≤ high_throughput_above → `balanced`, above → `high-throughput` (prompt tokens)."""

    low_latency_below: int = Field(default=512, ge=1)
    high_throughput_above: int = Field(default=2048, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> TierConfig:
        if self.high_throughput_above < self.low_latency_below:
            raise ValueError("high_throughput_above must be >= low_latency_below")
        return self


class SchedulingConfig(_Strict):
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

    @model_validator(mode="after")
    def _profile_known(self) -> SchedulingConfig:
        if self.profile not in self.all_profiles():
            raise ValueError(f"profile {self.profile!r} is not defined; defined: {sorted(self.all_profiles())}")
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


class KVAdmissionConfig(_Strict):
    """KV-cache admission control.

    Attributes:
        enabled: reserve KV blocks on pick (the `kv-fit-filter` reads them).
        reject_status: status when no endpoint can fit the request: 429 (with retry-after) or 503.
        retry_after_s: the `retry-after` value on that 429 (seconds).
        settle_after_s: without an observed first token, a reservation stops counting at the
            first scrape this long after the pick (seconds).
    """

    enabled: bool = True
    reject_status: Literal[429, 503] = 429
    retry_after_s: int = Field(default=1, ge=1)
    settle_after_s: float = Field(default=2.0, gt=0)


class PriorityConfig(_Strict):
    """Priority classes and shedding under saturation.

    The header value (`critical`, `standard`, `sheddable`; default `standard`) is read from
    `header`; any other value is a 400. Fleet saturation is max(mean effective KV usage,
    mean waiting requests / `queue_saturation_depth`) over the model's healthy endpoints (0..1+).
    Sheddable requests are refused at `shed_sheddable_at`, standard ones at
    `shed_standard_at`; critical ones only when no endpoint can fit them.
    """

    header: str = "x-llm-priority"
    default: Literal["critical", "standard", "sheddable"] = "standard"
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

    @field_validator("header")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.lower()


class AdmissionConfig(_Strict):
    """Admission control: KV fit and priority shedding."""

    kv: KVAdmissionConfig = Field(default_factory=KVAdmissionConfig)
    priority: PriorityConfig = Field(default_factory=PriorityConfig)


class TelemetryConfig(_Strict):
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
    """

    enabled: bool = True
    sample_rate: float = Field(default=0.1, gt=0, le=1)
    observer: ObserverOptions = Field(default_factory=ObserverOptions)
    stats: StreamStatsParams = Field(default_factory=StreamStatsParams)


class Config(_Strict):
    """The whole configuration."""

    listen: ListenConfig = Field(default_factory=ListenConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    models: list[ModelConfig] = Field(min_length=1)
    endpoints: list[EndpointConfig] = Field(min_length=1)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

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
