"""The request pipeline for one generation request:

    parse → resolve model → priority → count tokens → truncate (opt-in) → check context → estimate KV
          → shed (priority under saturation) → filter → score → pick      (endpoint mode)
          → tier from the prompt length                                  (tier mode)

Runs inside the ext_proc stream's body phase. Every refusal is an `ExtProcError` the server
turns into an OpenAI-style `ImmediateResponse`; nothing here touches gRPC, and nothing here
reserves: the caller reserves the decision (`reserve`) with no await in between, so a
cancelled stream can never leave a reservation behind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from extproc.admission.priority import check_shedding, claim_priority, fleet_saturation, parse_priority
from extproc.config.schema import Config, ModelConfig, ProfileConfig
from extproc.datastore.endpoints import Datastore, Endpoint, Reservation
from extproc.datastore.lora import AdapterNames, SentAdapters, residency_tier
from extproc.datastore.prefill_fit import PREFILL_ATTENTION_RATIO, PrefillCounts
from extproc.errors import (
    ContextLengthError,
    NoEndpointError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitedError,
    ValidationError,
)
from extproc.metrics import Metrics
from extproc.pipeline.offload import OffloadGate
from extproc.pipeline.output_estimate import OutputEstimates
from extproc.pipeline.tokens import EncodePlan, TokenCounter
from extproc.prefix.match import PrefixMatch
from extproc.prefix.tracker import PrefixTracker
from extproc.pipeline.truncate import TRUNCATE_HEADER, Truncated, Truncation, prompt_budget, truncate, wanted
from extproc.protocol.jsonlimits import MAX_JSON_DEPTH, check_json_shape, opening_brackets, values_bound
from extproc.protocol.openai import ParsedRequest, parse_body
from extproc.scheduling.framework import Profile, ProfileResult, SchedulingContext, WeightedScorer
from extproc.scheduling.pd import NO_DECODE_ROLE, PDDecision, PDHandler
from extproc.scheduling.plugins.filters.kv_fit import blocks_to_reserve, blocks_to_start
from extproc.scheduling.registry import build
from extproc.telemetry.decision_log import DecisionRecord
from extproc.types import HEALTH_PANIC, LLMRequest, RequestKind, TokenCount

log = logging.getLogger(__name__)

__all__ = [
    "Counted",
    "ModelRuntime",
    "RequestPipeline",
    "Routed",
    "INLINE_COUNT_BYTES",
    "INLINE_TOKENIZE_CHARS",
    "build_profile",
    "tier_for",
]

COUNT_BUDGET_FRACTION = 0.5
"""Share of `limits.decision_timeout_ms` token counting may take before the estimate is used."""

ESTIMATE_CHARS_PER_TOKEN = 3.5
"""Characters per token for the fallback estimate (English prose with BPE tokenizers: 3.5–4.5;
the low end makes KV reservations err on the safe side)."""

INLINE_MESSAGES = 256
"""Conversations with more messages (or batches with more prompts) are rendered off the event loop."""

INLINE_COUNT_BYTES = 256 * 1024
"""A body whose JSON values must be counted exactly (`values_bound` over `limits.max_json_values`)
is counted off the event loop when larger than this (bytes): the count costs ~5–12 ns per byte,
1–3 ms here, 20–50 ms for 4 MiB of prose full of commas or of backslash escapes."""

INLINE_TOKENIZE_CHARS = 6000
"""Up to this many uncached characters (~1.5k tokens) are tokenized on the event loop: a
thread hop costs more than the work. More go to the executor, where the Rust tokenizer's
`encode_batch` releases the GIL."""

TIKTOKEN_CHARS_PER_S = 5e6
TOKENIZERS_CHARS_PER_S = 1e6
"""The tokenizer threads' starting rate (characters per second, learned from finished counts
afterwards) with tiktoken and with `tokenizers`: Qwen3 on 90k characters of English prose,
15.6 vs 108 ms on this machine (docs/decisions/0200)."""

BIG_CHARS = 32 * INLINE_TOKENIZE_CHARS
"""A chat with more characters than this renders its template off the event loop too."""


@dataclass(slots=True)
class ModelRuntime:
    """A configured model with its loaded tokenizer."""

    config: ModelConfig
    counter: TokenCounter


@dataclass(slots=True)
class Counted:
    """A request parsed, counted (and truncated when asked), ready to schedule
    (`RequestPipeline.count`): `RequestPipeline.schedule` may run on it more than once (a
    request routed again when its endpoint left the pool) without counting its tokens again.

    Attributes:
        request: the parsed, counted request.
        parsed: the body as parsed.
        model: the served model's configuration.
        prompt_tokens: tokens per prompt (completions may batch several).
        priority: the request's priority class.
        session_header: the session header's value, or None.
        subset: the hard filter on endpoints (Endpoint Picker Protocol), or None.
        cut: what truncation did, or None.
        started_s, counting_s, counted_s: `time.perf_counter()` at the start of the decision,
            of counting, and at its end (seconds).
        truncate_s: seconds truncation took (0 when it did not run).
        schedules: how many times `schedule` ran on it (count).
        priority_downgraded: the client claimed a class above what it may claim and got
            `priority` instead (`admission.priority.on_unclaimable: downgrade`).
    """

    request: LLMRequest
    parsed: ParsedRequest
    model: ModelConfig
    prompt_tokens: list[int]
    priority: str
    session_header: str | None
    subset: Callable[[Endpoint], bool] | None
    cut: Truncated | None
    started_s: float
    counting_s: float
    counted_s: float
    truncate_s: float
    schedules: int = 0
    priority_downgraded: bool = False


@dataclass(slots=True)
class Routed:
    """A routing decision.

    Attributes:
        request: the parsed, counted request.
        endpoint: the chosen endpoint (endpoint mode), else None.
        tier: the chosen tier (tier mode), else None.
        blocks: KV blocks to reserve on the endpoint (blocks; 0 when KV admission is off).
        result: the scheduling cycle (scores, for explanations), or None in tier mode.
        timings_s: seconds per phase (parse, tokenize, truncate when it ran, schedule, total).
        expected_output_tokens: max_tokens, or the model's expectation without it (tokens).
        decode_output_tokens: the output length decode estimates use (tokens): max_tokens
            capped by the model's learned output length (`OutputEstimates.decode_tokens`); None
            (a route not scheduled by the profile): `expected_output_tokens`.
        prefix: the prefix index's view of the request (None without one).
        session: the request's session key (None without one).
        predicted_ttft_s: predicted seconds to first token per endpoint address (when the
            profile has a TTFT estimate).
        body: the body to send instead of the client's (a truncated prompt), or None.
        truncation: what truncation did, or None when the prompt was not cut.
        attention_ratio: `scheduling.prefill_model.attention_ratio` (1/tokens), for
            `prefill_tokens`; defaults to `PREFILL_ATTENTION_RATIO`, as the config does.
        priority_applied: the class the request runs under when its claim was downgraded
            (the client is told, `x-llm-priority-applied`), else None.
    """

    request: LLMRequest
    endpoint: Endpoint | None
    tier: str | None
    blocks: int
    result: ProfileResult | None
    timings_s: dict[str, float]
    expected_output_tokens: int = 0
    decode_output_tokens: int | None = None
    prefix: PrefixMatch | None = None
    session: bytes | None = None
    predicted_ttft_s: dict[str, float] | None = None
    body: bytes | None = None
    truncation: Truncation | None = None
    attention_ratio: float = PREFILL_ATTENTION_RATIO
    priority_applied: str | None = None
    pd: PDDecision | None = None
    prefill_blocks: int = 0

    @property
    def prefill_endpoint(self) -> Endpoint | None:
        """The endpoint prefilling the request for `endpoint` (P/D disaggregation), else None."""
        return self.pd.prefill_endpoint if self.pd is not None else None

    @property
    def decode_tokens(self) -> int:
        """Output tokens the request is expected to decode (tokens): `decode_output_tokens`, or
        `expected_output_tokens` without it. For decode estimates, never for KV."""
        return self.expected_output_tokens if self.decode_output_tokens is None else self.decode_output_tokens

    @property
    def prefill_counts(self) -> PrefillCounts:
        """The token counts of the request's prefill on its endpoint: its prompt, the part not
        believed cached there, each prompt's length if batched."""
        return self.counts_on(self.endpoint)

    def counts_on(self, ep: Endpoint | None) -> PrefillCounts:
        """The request's prefill token counts on `ep` (`prefill_counts`; the whole prompt
        uncached without a prefix index or an endpoint). A disaggregated request's decode
        endpoint prefills nothing (its uncached count is 0): the prefill endpoint does."""
        r = self.request
        if ep is not None and ep is self.endpoint and self.prefill_endpoint is not None:
            return PrefillCounts(r.prompt_tokens, 0, r.prompt_lengths)
        uncached = r.prompt_tokens if self.prefix is None or ep is None else self.prefix.uncached_tokens(ep.address)
        return PrefillCounts(r.prompt_tokens, uncached, r.prompt_lengths)

    @property
    def prefill_tokens(self) -> int:
        """The request's prefill work on its endpoint (tokens, linear-token equivalents): its
        prompt less the prefix believed cached there, with the attention of those tokens
        (`extproc.datastore.prefill_fit.request_prefill_work` at `attention_ratio`)."""
        return self.prefill_counts.work(self.attention_ratio)

    def explain(self) -> str:
        """The route-debug line: the profile's scores for the chosen endpoint and the runner-up,
        then per candidate its matched prefix blocks and predicted TTFT."""
        if self.result is None:
            return f"tier={self.tier}"
        out = self.result.explain() if self.pd is None else self.pd.explain()
        if self.result.pick is None:
            return out
        rows = []
        for s in [self.result.pick.primary, *self.result.pick.fallbacks]:
            addr = s.endpoint.address
            part = addr
            if self.prefix is not None:
                part += f" matched={self.prefix.matched.get(addr, 0)}blk/{self.prefix.cached_tokens(addr)}tok"
            if self.predicted_ttft_s and addr in self.predicted_ttft_s:
                part += f" ttft={self.predicted_ttft_s[addr] * 1000:.1f}ms"
            rows.append(part)
        return out + "; candidates " + ", ".join(rows)


def _consume(task: asyncio.Future) -> None:
    """Retrieve an abandoned counting task's outcome so its exception is not reported as unhandled."""
    if not task.cancelled():
        task.exception()


def _text_chars(*roots: Any) -> int:
    """Characters of every string (values and keys) under `roots` — JSON-like lists and dicts,
    walked without recursion (a client can nest a thousand levels deep). For a chat that is
    everything its template can render: contents, but also `tool_calls` arguments,
    `reasoning_content`, tool schemas and any other field a message carries."""
    total = 0
    stack = list(roots)
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str):
                    total += len(key)
                stack.append(value)
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def _message_chars(parsed: ParsedRequest) -> int:
    """Characters a chat request's template can render: messages (every field) and tools."""
    return _text_chars(parsed.messages, parsed.tools)


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """`fn(*args)` and the seconds it took (run in a worker thread: its service time)."""
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def _estimate_tokens(parsed: ParsedRequest) -> list[int]:
    """Prompt tokens from characters (ESTIMATE_CHARS_PER_TOKEN), when exact counting ran out of time."""
    if parsed.kind is not RequestKind.COMPLETION:
        chars = _message_chars(parsed) + 16 * len(parsed.messages)
        return [max(1, int(chars / ESTIMATE_CHARS_PER_TOKEN))]
    return [max(1, int(len(p) / ESTIMATE_CHARS_PER_TOKEN)) for p in parsed.prompts]


def _none_in_subset(model: str | None) -> NoEndpointError:
    """The 503 for a request none of whose model's endpoints (any endpoint's, when `model` is
    None) is in the gateway's subset hint."""
    whose = f"of model `{model}` " if model is not None else ""
    return NoEndpointError(f"no endpoint {whose}is in the subset the gateway allowed", code="no_endpoint_in_subset")


def _prompt_param(kind: RequestKind) -> str:
    """The request field that holds the prompt, for an error's `param`."""
    return {RequestKind.CHAT: "messages", RequestKind.COMPLETION: "prompt", RequestKind.RESPONSES: "input"}[kind]


def build_profile(name: str, cfg: ProfileConfig) -> Profile:
    """Instantiate a profile's plugins (already validated at config load)."""
    filters = [build(s.type, s.params, name=s.name) for s in cfg.filters]
    scorers = [WeightedScorer(build(s.type, s.params, name=s.name), s.weight) for s in cfg.scorers]
    picker = build(cfg.picker.type, cfg.picker.params, name=cfg.picker.name)
    return Profile(name, filters, scorers, picker)


def tier_for(prompt_tokens: int, low_latency_below: int, high_throughput_above: int) -> str:
    """The design notes' token-range tier: < low → low-latency, ≤ high → balanced, else high-throughput."""
    if prompt_tokens < low_latency_below:
        return "low-latency"
    if prompt_tokens <= high_throughput_above:
        return "balanced"
    return "high-throughput"


class RequestPipeline:
    """Decides where a generation request goes.

    Args:
        config: validated configuration.
        store: endpoint datastore (health, metrics, accounting).
        models: canonical model name → runtime (tokenizer).
        metrics: metrics sink.
        tokenize_threads: threads that tokenize long prompts (and check huge JSON bodies) off
            the event loop, in a pool this pipeline owns (`close` stops it); 0: everything
            inline. The counting jobs admitted to them are bounded by the time they would take
            on that many threads (`extproc.pipeline.offload.OffloadGate`).
        rng: tie-break randomness (seeded in tests).
        prefix: the prefix tracker (prefix index, sessions), or None for none.
    """

    def __init__(
        self,
        config: Config,
        store: Datastore,
        models: Mapping[str, ModelRuntime],
        metrics: Metrics,
        rng: random.Random | None = None,
        prefix: PrefixTracker | None = None,
        tokenize_threads: int = 0,
    ) -> None:
        self._config = config
        self.prefix = prefix
        self._store = store
        self._models = dict(models)
        self._aliases: dict[str, str] = {}
        for m in config.models:
            for name in (m.name, *m.aliases):
                self._aliases[name] = m.name
        self.adapters = AdapterNames(
            {a: m.name for m in config.models for a in m.adapters},
            reserved=set(self._aliases),
            learning={m.name for m in config.models if m.learn_adapters},
        )
        """LoRA adapter names → base model: configured, and learned from the engines."""
        self._metrics = metrics
        self.output_estimates = OutputEstimates((m.name, m.output_estimate) for m in config.models)
        """Per model, the learned output length that caps max_tokens in decode estimates."""
        self._executor = ThreadPoolExecutor(max_workers=tokenize_threads, thread_name_prefix="tokenize") if tokenize_threads else None
        self._rng = rng or random.Random()
        self._max_body = config.limits.max_body_bytes
        # A completions prompt may be token ids, one JSON value each: one full-context prompt
        # (the longest model's max_model_len) is allowed on top of limits.max_json_values. Such
        # a body costs orjson + pydantic ~0.25 µs per value (10 ms for 40,960 ids, measured) and
        # no character walk (only chats are walked).
        self._max_values = {
            RequestKind.CHAT: config.limits.max_json_values,
            RequestKind.RESPONSES: config.limits.max_json_values,
            RequestKind.COMPLETION: config.limits.max_json_values + max((m.max_model_len for m in config.models), default=0),
        }
        # Past this, a burst of long new prompts waiting for a tokenizer thread is routed on a
        # character estimate instead of refused: the rest of the decision needs the remainder.
        self._count_budget_s = config.limits.decision_timeout_ms / 1000 * COUNT_BUDGET_FRACTION
        # ... and one that would wait more than ~50 ms for a thread, or not finish within that
        # budget behind the counts already queued, is routed on the estimate at once, never
        # queued (a flood of huge prompts would make every decision wait the whole budget).
        fast = all(rt.counter.encoder == "tiktoken" for rt in self._models.values())
        self.offload = OffloadGate(max(1, tokenize_threads), self._count_budget_s, chars_per_s=TIKTOKEN_CHARS_PER_S if fast else TOKENIZERS_CHARS_PER_S)
        sched = config.scheduling
        self.profiles = {name: build_profile(name, pc) for name, pc in sched.all_profiles().items()}
        self.profile = self.profiles[sched.profile]
        self.attention_ratio = config.scheduling.prefill_model.attention_ratio
        """`scheduling.prefill_model.attention_ratio` (1/tokens): every scheduling context's."""
        self._passthrough = self.profiles["least-inflight"]
        pd = sched.disaggregation
        self.pd = PDHandler(
            self.profiles[pd.decode_profile], self.profiles[pd.prefill_profile], pd.threshold_tokens, pd.link_gbytes_per_s * 1e9, pd.enabled
        )
        """The P/D profile handler: schedules a model whose endpoints are not all `role: both`."""
        self._kv_bytes_per_token = {m.name: m.kv_bytes_per_token() for m in config.models}
        self._in_panic: set[str] = set()
        """Pools in health panic: model names, "" for `pick_any`'s whole fleet."""

    def close(self) -> None:
        """Stop the tokenizer threads: jobs not started are cancelled, running ones finish on
        their own (their decisions are over: the server is stopping)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    @property
    def served_models(self) -> list[str]:
        """Every name a client may use (canonical names, aliases, LoRA adapters configured or
        learned so far), sorted."""
        return sorted({*self._aliases, *self.adapters.configured, *self.adapters.learned})

    @property
    def aliases(self) -> dict[str, list[str]]:
        """Canonical model name → its aliases (the configured `models[].aliases`, in order)."""
        return {name: list(rt.config.aliases) for name, rt in self._models.items() if rt.config.aliases}

    def note_output(self, model: str, tokens: int, n: int = 1) -> None:
        """A completed response of `model` (canonical name) produced `tokens` output tokens over
        `n` sequences: feed the model's output-length estimate (`output_estimates`) and its
        gauge. Call only for completed responses: an aborted or failed one stopped early and
        would bias the estimate low. An unknown model is ignored."""
        estimate = self.output_estimates.observe(model, tokens, n)
        if estimate is not None:
            self._metrics.child(self._metrics.output_tokens_estimate, model).set(estimate)

    def encoders(self) -> dict[str, dict[str, str]]:
        """Per served model (canonical name): the token encoder in use ("tiktoken" or
        "tokenizers") and, for `tokenizers`, why (`TokenCounter.encoder_note`); how its chat
        template is rendered ("direct" or "apply_chat_template") and, for the latter, why."""
        return {
            name: {
                "encoder": rt.counter.encoder,
                "note": rt.counter.encoder_note,
                "renderer": rt.counter.renderer,
                "renderer_note": rt.counter.renderer_note,
            }
            for name, rt in sorted(self._models.items())
        }

    def resolve_model(self, name: str) -> ModelRuntime:
        """The runtime for a requested model name, alias or LoRA adapter (its base model's).

        Raises:
            NotFoundError: unknown model; the message lists the served models.
        """
        return self.resolve(name)[0]

    def resolve(self, name: str) -> tuple[ModelRuntime, str | None]:
        """The runtime for a requested model name, alias or LoRA adapter, and the adapter's name
        (None for a model name or alias). An adapter neither configured nor learned yet is
        looked for in what the engines last reported (`learn_from_engines`).

        Raises:
            NotFoundError: unknown model; the message lists the served models.
        """
        canonical = self._aliases.get(name)
        if canonical is not None:
            return self._models[canonical], None
        base = self.adapters.base_of(name)
        if base is None and self.learn_from_engines():
            base = self.adapters.base_of(name)
        if base is not None:
            return self._models[base], name
        raise NotFoundError(f"The model `{name}` does not exist. Served models: {', '.join(self.served_models)}", param="model")

    def learn_from_engines(self) -> int:
        """Learn the adapters the engines report for the models that learn them
        (`ModelConfig.learn_adapters`): `/v1/models` entries with a `parent`
        (`Endpoint.listed_adapters`) and the names in their LoRA metrics (for an endpoint
        serving one model). Returns how many names were new. O(endpoints); runs only for a
        name that is no known model or adapter, and not at all once nothing more can be learned
        (no model learns, or the bound is reached)."""
        new = 0
        if not self.adapters.can_learn:
            return 0
        for ep in self._store.all():
            for adapter, parent in ep.listed_adapters.items():
                new += self.adapters.learn(adapter, self._aliases.get(parent, parent))
            lora = ep.engine.lora if ep.engine is not None else None
            if lora is not None and len(ep.models) == 1:
                (base,) = ep.models
                for adapter in lora.adapters:
                    new += self.adapters.learn(adapter, base)
        return new

    async def route(self, kind: RequestKind, body: bytes, **kwargs: Any) -> Routed:
        """Decide for one request body (reserves nothing): `count` then `schedule`.

        Args and Raises: those of `count` and `schedule`.
        """
        return self.schedule(await self.count(kind, body, **kwargs))

    async def count(
        self,
        kind: RequestKind,
        body: bytes,
        *,
        priority_header: str | None = None,
        trusted_priority: str | None = None,
        session_header: str | None = None,
        truncate_header: str | None = None,
        record: DecisionRecord | None = None,
        before_count: Callable[[str, int | None, int, int], Awaitable[None]] | None = None,
        subset: Callable[[Endpoint], bool] | None = None,
    ) -> Counted:
        """Parse, check and count one request body, truncating it when asked: everything of
        a decision before scheduling.

        Args:
            kind: chat or completion (from the path).
            body: the raw request body (bytes).
            priority_header: the value of the priority header, if sent (bounded by
                `admission.priority.claimable`).
            trusted_priority: the value of `admission.priority.trusted_header`, if configured and sent.
            session_header: the value of the session header (`scheduling.prefix.session_header`), if sent.
            truncate_header: the value of `x-llm-truncate`, if sent (read only where the model's
                truncation mode is not `off`).
            record: a decision-log record to fill with what is learnt (model, prompt tokens,
                output budget, truncation), even when the request is refused later; or None.
            before_count: awaited with (served model, max_tokens, sequences: n for each prompt
                of a batched completion, body bytes) once the body is
                parsed and before its tokens are counted; may raise an `ExtProcError` to refuse
                cheaply (the rate limiter's precheck).
            subset: a hard filter on the model's endpoints (the Endpoint Picker Protocol's subset
                hint), checked before the prompt is counted and applied again when scheduling;
                None admits all.

        Raises:
            PayloadTooLargeError: body over `limits.max_body_bytes`.
            BadRequestError: malformed body, more than `limits.max_json_values` JSON values, bad
                priority or truncate header, or prompt + max_tokens over `max_model_len` (after
                truncation, where the model allows it).
            NotFoundError: unknown model.
            RateLimitedError: shed under saturation, or no endpoint can fit the KV (429).
            NoEndpointError: no healthy endpoint (503), no endpoint of the model in `subset`
                (503). `schedule` raises the rest.
        """
        t0 = time.perf_counter()
        cfg = self._config
        if len(body) > self._max_body:
            raise PayloadTooLargeError(f"request body is {len(body)} bytes; the limit is {self._max_body} bytes")
        max_values: int | None = self._max_values[kind]
        max_depth: int | None = MAX_JSON_DEPTH
        if self._executor is not None and len(body) > INLINE_COUNT_BYTES:
            if values_bound(body) > max_values or opening_brackets(body) > MAX_JSON_DEPTH:
                # The exact counts in a thread: they step through C-speed windows and hand the
                # GIL back to the event loop between them.
                await asyncio.get_running_loop().run_in_executor(self._executor, check_json_shape, body, max_values)
            max_values = max_depth = None  # checked
        parsed = parse_body(
            kind, body, max_values=max_values, max_messages=cfg.limits.max_messages, max_prompts=cfg.limits.max_prompts,
            max_depth=max_depth,
        )  # fmt: skip
        runtime, adapter = self.resolve(parsed.model)
        if subset is not None and not any(map(subset, self._store.for_model(runtime.config.name))):
            raise _none_in_subset(runtime.config.name)  # fail fast: before counting its tokens
        priority, downgraded = self._priority(priority_header, trusted_priority)
        may_truncate = wanted(runtime.config.truncation, truncate_header)
        if record is not None:
            record.model = runtime.config.name
        if before_count is not None:
            batch = len(parsed.prompts) or len(parsed.prompt_token_ids)  # 0: a chat or responses request
            await before_count(runtime.config.name, parsed.max_tokens, parsed.n * max(1, batch), len(body))
        t1 = time.perf_counter()
        model = runtime.config
        counted = self._count(parsed, runtime, len(body))
        if isinstance(counted, tuple):  # counted on the event loop: nothing to wait for
            (prompt_tokens, token_ids), exact = counted, True
        elif counted is None:  # the tokenizer threads are full for longer than the budget
            self._metrics.token_estimates.labels(model.name).inc()
            prompt_tokens, token_ids, exact = _estimate_tokens(parsed), None, False
        else:
            # The budget runs from the start of counting: the inline part (rendering, cutting)
            # already spent some of it.
            budget_s = self._count_budget_s - (time.perf_counter() - t1)
            prompt_tokens, token_ids, exact = await self._await_count(counted, parsed, model.name, budget_s)
        t2 = time.perf_counter()
        cut: Truncated | None = None
        if record is not None:
            record.counted(prompt_tokens, parsed.max_tokens, model)
        if exact:
            if may_truncate:
                cut = await self._truncate(parsed, runtime, body, prompt_tokens)
                if cut is not None:
                    body, prompt_tokens, token_ids = cut.body, cut.prompt_tokens, cut.token_ids
                    if record is not None:
                        record.counted(prompt_tokens, parsed.max_tokens, model)
                        record.truncation = cut.truncation
            try:
                self._check_context(parsed, model, prompt_tokens)
            except ContextLengthError as exc:
                if (
                    model.truncation.mode == "on-request"
                    and truncate_header is None
                    and parsed.kind is not RequestKind.RESPONSES  # not cut: `input` is not rewritten
                ):
                    # The model would cut this prompt if asked: say how, or the client never learns.
                    raise ContextLengthError(
                        f"{exc.message} This gateway can shorten it for you (keeping the start and the newest "
                        f"turns): send the header '{TRUNCATE_HEADER}: head-tail'.",
                        param=exc.param,
                    ) from exc
                raise
        t_cut = time.perf_counter() - t2
        total_prompt = sum(prompt_tokens)
        req = LLMRequest(
            kind=kind,
            model=parsed.model,
            served_model=model.name,
            prompt_tokens=TokenCount(total_prompt),
            prompt_lengths=tuple(prompt_tokens) if len(prompt_tokens) > 1 else (),
            max_tokens=parsed.max_tokens,
            n=parsed.n,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            user=parsed.user,
            body_bytes=len(body),  # type: ignore[arg-type]
            token_ids=token_ids,
            adapter=adapter,
            cache_salt=parsed.cache_salt,
        )
        return Counted(req, parsed, model, prompt_tokens, priority, session_header, subset, cut, t0, t1, t2, t_cut, priority_downgraded=downgraded)

    def schedule(self, counted: Counted) -> Routed:
        """Pick an endpoint (or a tier) for a counted request, among the endpoints listed now.
        Runs without yielding; may run again on the same `counted` (reserves nothing).

        Timings: parse and tokenize from `count`; schedule from this call's start (the first
        call starts where counting ended, truncation excluded); total from the decision's start.

        Raises:
            RateLimitedError: shed under saturation, or no endpoint can fit the KV (429).
            NoEndpointError: no healthy endpoint (503), no endpoint of the model in the subset
                (503), or no KV fit with `reject_status: 503`.
            ValidationError: the request can never fit any endpoint's KV cache.
        """
        cfg = self._config
        req, parsed, model, prompt_tokens = counted.request, counted.parsed, counted.model, counted.prompt_tokens
        priority, session_header, subset, cut = counted.priority, counted.session_header, counted.subset, counted.cut
        t0, t1, t2, t_cut = counted.started_s, counted.counting_s, counted.counted_s, counted.truncate_s
        # A second run's schedule phase is its own, not the wait since counting ended.
        again_from = time.perf_counter() if counted.schedules else None
        counted.schedules += 1
        applied = priority if counted.priority_downgraded else None
        if cfg.scheduling.mode == "tier":
            tiers = cfg.scheduling.tiers
            tier = tier_for(int(req.prompt_tokens), tiers.low_latency_below, tiers.high_throughput_above)
            timings = {"parse": t1 - t0, "tokenize": t2 - t1, "schedule": 0.0, "total": time.perf_counter() - t0}
            tiered = Routed(req, None, tier, 0, None, timings, attention_ratio=self.attention_ratio, priority_applied=applied)
            return self._routed(tiered, cut, t_cut)
        expected = parsed.max_tokens or min(model.default_output_tokens, max(1, model.max_model_len - max(prompt_tokens)))
        decode = self.output_estimates.decode_tokens(model.name, parsed.max_tokens, expected)
        # Taken again after counting: endpoints may have left meanwhile.
        pool = self._store.for_model(model.name) if subset is None else self._in_subset(model.name, subset)
        healthy = [ep for ep in pool if ep.healthy]
        if healthy:
            check_shedding(priority, fleet_saturation(healthy, cfg.admission.priority.queue_saturation_depth), cfg.admission.priority)
        ctx = SchedulingContext(
            request=req,
            expected_output_tokens=expected,
            default_block_size=cfg.scheduling.block_size,
            now=time.monotonic(),
            rng=self._rng,
            priority=priority,
            stale_after_s=cfg.scheduling.metrics.stale_after_s,
            panic_threshold=cfg.scheduling.health_check.panic_threshold,
            attention_ratio=self.attention_ratio,
            decode_output_tokens=decode,
            lora_max_loras=cfg.scheduling.lora_max_loras,
        )
        session = None
        if self.prefix is not None:
            session = self.prefix.session_of(session_header, parsed.user)
            ctx.session_endpoint = self.prefix.session_endpoint(session)
            ctx.prefix = self.prefix.lookup(req, healthy or pool, ctx.block_size)
        pd: PDDecision | None = None
        if PDHandler.applies(pool):
            pd = self.pd.run(ctx, pool, self._kv_bytes_per_token.get(model.name, 0))
            result = pd.decode
            self._note_pd(pd, model.name)
        else:
            result = self.profile.run(ctx, pool)
        self._note_panic(ctx, model.name)
        self._metrics.observe_each(self._metrics.plugin_seconds, result.timings_s)
        if result.pick is None:
            raise self._rejection(result, ctx, pool)
        endpoint = result.pick.primary.endpoint
        blocks = blocks_to_reserve(ctx, endpoint) if cfg.admission.kv.enabled else 0
        prefill_blocks = 0
        if pd is not None and pd.prefill_endpoint is not None and pd.prefill_ctx is not None and cfg.admission.kv.enabled:
            prefill_blocks = blocks_to_reserve(pd.prefill_ctx, pd.prefill_endpoint)
        t3 = time.perf_counter()
        predicted = ctx.data.get("predicted_ttft_s")
        scheduled_s = t3 - t2 - t_cut if again_from is None else t3 - again_from
        timings = {"parse": t1 - t0, "tokenize": t2 - t1, "schedule": scheduled_s, "total": t3 - t0}
        routed = Routed(
            req,
            endpoint,
            None,
            blocks,
            result,
            timings,
            expected_output_tokens=expected,
            decode_output_tokens=decode,
            prefix=ctx.prefix,
            session=session,
            predicted_ttft_s=predicted if isinstance(predicted, dict) else None,
            attention_ratio=ctx.attention_ratio,
            priority_applied=applied,
            pd=pd,
            prefill_blocks=prefill_blocks,
        )
        if pd is not None and pd.predicted_ttft_s is not None:
            # The first token comes from the pair: the prefill side's TTFT plus the transfer.
            routed.predicted_ttft_s = {**(routed.predicted_ttft_s or {}), endpoint.address: pd.predicted_ttft_s}
        return self._routed(routed, cut, t_cut)

    def _note_pd(self, pd: PDDecision, model: str) -> None:
        """Count a P/D decision (`llm_extproc_disagg_decision_total{decision,reason}`) and its
        predicted KV transfer time."""
        m = self._metrics
        m.child(m.disagg_decisions, pd.decision, pd.reason).inc()
        if pd.prefill_endpoint is not None:
            m.child(m.disagg_transfer_seconds, model).observe(pd.transfer_s)

    @staticmethod
    def _routed(routed: Routed, cut: Truncated | None, seconds: float) -> Routed:
        """`routed` carrying the truncated body, what was cut and how long cutting took."""
        if cut is not None:
            routed.body, routed.truncation = cut.body, cut.truncation
            routed.timings_s["truncate"] = seconds
        return routed

    async def _truncate(
        self, parsed: ParsedRequest, runtime: ModelRuntime, body: bytes, prompt_tokens: list[int]
    ) -> Truncated | None:
        """Head + tail truncation (`extproc.pipeline.truncate`) of a prompt over its budget, in
        the executor (it re-renders templates and may re-tokenize a cut text); counted in the
        truncation metrics. None when the prompt fits.

        Raises:
            ContextLengthError: the prompt cannot be made to fit.
        """
        model = runtime.config
        if max(prompt_tokens) <= prompt_budget(model.max_model_len, parsed.max_tokens, model.truncation):
            return None
        work = functools.partial(
            truncate, parsed, body, runtime.counter, prompt_tokens, max_model_len=model.max_model_len, policy=model.truncation
        )
        if self._executor is not None:
            cut = await asyncio.get_running_loop().run_in_executor(self._executor, work)
        else:
            cut = work()
        if cut is not None:
            m = self._metrics
            m.child(m.truncations, model.name).inc()
            m.child(m.truncated_tokens, model.name).inc(cut.truncation.tokens_dropped)
        return cut

    def _note_panic(self, ctx: SchedulingContext, pool: str) -> None:
        """Track health panic (`healthy-filter` routed among live but unhealthy endpoints) per
        pool (`pool`: the model, "" for the whole fleet): the `llm_extproc_health_panic` gauge
        (1 while any pool is in panic), a counter and one log line per change of a pool — one
        model's panic is not ended by another model's healthy requests."""
        panic = HEALTH_PANIC in ctx.data
        if panic == (pool in self._in_panic):
            return
        shown = f"model `{pool}`" if pool else "any model"
        if panic:
            self._in_panic.add(pool)
            self._metrics.health_panic_entered.inc()
            log.warning(
                "health panic: fewer than %.0f %% of the endpoints of %s pass their probes; routing among every "
                "live endpoint (probes timing out) until they recover",
                100 * self._config.scheduling.health_check.panic_threshold, shown,
            )  # fmt: skip
        else:
            self._in_panic.discard(pool)
            log.info("health panic over for the endpoints of %s: routing only to those that pass their probes", shown)
        self._metrics.health_panic.set(1 if self._in_panic else 0)

    def _rejection(self, result: ProfileResult, ctx: SchedulingContext, pool: list[Endpoint]) -> Exception:
        """The client-facing error for a cycle whose filters left no endpoint."""
        by = result.rejected_by or "?"
        r = ctx.request
        if by.startswith("kv-fit"):
            # A batch's prompts start one by one: its largest is what must fit, so name it.
            prompt = (
                f"its largest prompt ({r.largest_prompt} of the batch's {r.prompt_tokens} prompt tokens)"
                if r.prompt_lengths else f"{r.prompt_tokens} prompt"
            )  # fmt: skip
            # Never fits: on no endpoint of known size could it start with the pool empty, by the
            # rejecting filter's own measure (its headroom kept free); else a 429 asked the
            # client to retry what no wait would ever admit.
            kv_filter = next((f for f in self.profile.filters if f.name == by), None)
            usable = getattr(kv_filter, "usable_blocks", None)
            sized = [(ep, usable(ep) if usable is not None else ep.engine.num_gpu_blocks) for ep in pool if ep.engine is not None and ep.engine.num_gpu_blocks]
            if sized and all(blocks_to_start(ctx, ep) > cap for ep, cap in sized):
                return ValidationError(
                    f"this request can never fit: {prompt} + {ctx.expected_output_tokens} output tokens "
                    f"with n={r.n} need more KV cache than any endpoint has in total (less the headroom kv-fit keeps free); "
                    "reduce n, max_tokens or the prompt",
                    param="n" if r.n > 1 else "max_tokens",
                    code="kv_cache_too_small",
                )
            kv = self._config.admission.kv
            msg = (
                f"no endpoint has enough free KV cache for this request ({prompt} + "
                f"{ctx.expected_output_tokens} output tokens, n={r.n}); retry later"
            )
            if kv.reject_status == 429:
                return RateLimitedError(msg, retry_after_s=kv.retry_after_s, code="kv_cache_full")
            return NoEndpointError(msg, code="kv_cache_full")
        if by == NO_DECODE_ROLE:
            return NoEndpointError(f"no endpoint for model `{r.served_model}` may decode: all {len(pool)} have role prefill", code="no_decode_endpoint")
        if by.startswith("healthy"):
            return NoEndpointError(f"no healthy endpoint for model `{r.served_model}` ({len(pool)} configured, 0 healthy)")
        if by.startswith("stale"):
            return NoEndpointError(f"no endpoint for model `{r.served_model}` has fresh metrics", code="stale_metrics")
        return NoEndpointError(f"no endpoint for model `{r.served_model}` passed {by}", code="no_eligible_endpoint")

    def reserve(self, routed: Routed) -> Reservation | None:
        """Hold the decision: an in-flight slot, the prefill work and the KV blocks on the chosen
        endpoint, and the request's blocks in the prefix index (so the next identical prompt
        follows it before this one is answered). Call with no await after `route`."""
        ep = routed.endpoint
        if ep is None:
            return None
        adapter = routed.request.adapter
        if adapter is not None:
            now = time.monotonic()
            lora = ep.engine.lora if ep.engine is not None else None
            tier = residency_tier(adapter, lora, ep.lora_sent, now, self._config.scheduling.lora_max_loras)
            self._metrics.child(self._metrics.lora_routed, routed.request.served_model, self.adapters.label(adapter), tier).inc()
            if ep.lora_sent is None:
                ep.lora_sent = SentAdapters()
            ep.lora_sent.note(adapter, now)
        prefill_ep = routed.prefill_endpoint
        if self.prefix is not None:
            req = routed.request
            # Both ends of a disaggregated request hold its prompt's blocks afterwards: the
            # prefill engine computed them, the decode engine pulled them into its cache.
            for holder in (ep,) if prefill_ep is None else (ep, prefill_ep):
                bs = holder.engine.block_size if holder.engine is not None and holder.engine.block_size else self._config.scheduling.block_size
                self.prefix.on_pick(
                    holder,
                    bs,
                    routed.prefix,
                    routed.session if holder is ep else None,
                    candidates=self._store.for_model(req.served_model),
                    token_ids=req.token_ids,
                    model=req.adapter or req.served_model,  # a warm-up must fill the adapter's blocks
                )
        settle = self._config.admission.kv.settle_after_s
        prefill_side = None
        if prefill_ep is not None:
            # The prefill side's part: its prefill work and the prompt's blocks, held until the
            # decode side starts streaming (the blocks have moved) or the request ends any way.
            counts = routed.counts_on(prefill_ep)
            prefill_side = self._store.reserve(
                prefill_ep, routed.prefill_blocks, prompt_tokens=counts.work(routed.attention_ratio), prefill_counts=counts, settle_after_s=settle
            )
        try:
            r = self._store.reserve(
                ep,
                routed.blocks,
                prompt_tokens=routed.prefill_tokens,
                prefill_counts=routed.prefill_counts,
                settle_after_s=settle,
                # In-flight decode context: half the expected output, capped like the decode terms
                # (the KV reservation above keeps max_tokens).
                context_tokens=routed.request.prompt_tokens + routed.decode_tokens * routed.request.sequences // 2,
            )
        except BaseException:
            if prefill_side is not None:
                prefill_side.release()
            raise
        if prefill_side is not None:
            r.attach_prefill_side(prefill_side)
        return r

    def _priority(self, value: str | None, trusted: str | None) -> tuple[str, bool]:
        """The request's class after the claim bounds (`claim_priority`), a bounded claim
        counted, and whether its claim was downgraded to it.

        Raises:
            ValidationError: not a class, or a claim above the bound with `on_unclaimable: reject`.
        """
        cfg = self._config.admission.priority
        try:
            claim = claim_priority(value, cfg, trusted_value=trusted)
        except ValidationError as err:
            if err.code == "priority_not_allowed":
                self._metrics.child(self._metrics.priority_claims_bounded, parse_priority(value, cfg), "rejected").inc()
            raise
        if claim.downgraded and claim.claimed is not None:
            self._metrics.child(self._metrics.priority_claims_bounded, claim.claimed, "downgraded").inc()
        return claim.priority, claim.downgraded

    def priority_downgrade(self, value: str | None, trusted: str | None) -> bool:
        """Whether the priority header `value` (with the trusted header's `trusted`) will be
        downgraded: known from the request headers, before the body (nothing counted; a value
        that is not a class is False, refused later)."""
        try:
            return claim_priority(value, self._config.admission.priority, trusted_value=trusted).downgraded
        except ValidationError:
            return False

    def endpoint(self, address: str) -> Endpoint | None:
        """The configured endpoint at `address` ("host:port"; an IPv6 host in any spelling:
        `Datastore.get`), or None."""
        return self._store.get(address)

    def reserve_endpoint(self, endpoint: Endpoint) -> Reservation:
        """Hold an in-flight slot for a request that is not a generation (no KV)."""
        return self._store.reserve(endpoint)

    def pick_any(self, subset: Callable[[Endpoint], bool] | None = None) -> Endpoint:
        """A healthy endpoint for a non-generation request (GET /v1/models, /health, ...):
        fewest in-flight, random tie-break, any model; only among those `subset` accepts when given.

        Raises:
            NoEndpointError: none is healthy (or none is in `subset`).
        """
        pool = self._store.routable() if subset is None else self._in_subset(None, subset)
        ctx = SchedulingContext(
            request=LLMRequest(kind=RequestKind.CHAT, model=""),
            expected_output_tokens=0,
            default_block_size=self._config.scheduling.block_size,
            now=time.monotonic(),
            rng=self._rng,
            panic_threshold=self._config.scheduling.health_check.panic_threshold,
        )
        result = self._passthrough.run(ctx, pool)
        self._note_panic(ctx, "")
        if result.pick is None:
            raise NoEndpointError(f"no healthy endpoint for this request ({len(pool)} configured, 0 healthy)")
        return result.pick.primary.endpoint

    def _count(
        self, parsed: ParsedRequest, runtime: ModelRuntime, body_bytes: int
    ) -> tuple[list[int], list[int] | None] | Awaitable[tuple[list[int], list[int] | None]] | None:
        """Prompt tokens per prompt (a list: completions may batch several prompts) and the ids of
        the first prompt (kept for prefix hashing) — directly, or an awaitable when the work goes
        to the executor, or None when the executor's admitted work would not leave this count
        time to finish within the budget (`self.offload`: the caller uses the estimate).

        The chat template is rendered and the text cut and looked up in the segment cache on the
        event loop (sub-millisecond); only when more than INLINE_TOKENIZE_CHARS characters miss
        the cache does the tokenization itself go to the executor, and a huge conversation
        renders there too. The common case creates no task and no timer.

        `body_bytes` is the body's length (bytes), an upper bound on its characters.

        Raises:
            ContextLengthError: more characters than the context can hold at
                `limits.max_chars_per_token`.
        """
        counter = runtime.counter
        limits = self._config.limits
        model = runtime.config
        max_chars = limits.max_chars_per_token * model.max_model_len
        if parsed.kind is not RequestKind.COMPLETION:
            # The body's length bounds its characters (each takes a byte or more, with the quotes,
            # colons and braces around it): a body within both thresholds below (the refusal, the
            # off-loop rule) needs no walk of its messages.
            chars = _message_chars(parsed) if body_bytes > min(max_chars, BIG_CHARS) else body_bytes
        elif parsed.prompts:
            chars = max(len(p) for p in parsed.prompts)
        else:
            ids = parsed.prompt_token_ids
            return [len(p) for p in ids], ids[0]
        if chars > max_chars:
            raise ContextLengthError(
                f"This model's maximum context length is {model.max_model_len} tokens. However, your prompt has "
                f"{chars} characters: too long to fit, refused before counting its tokens (this gateway "
                f"accepts at most {max_chars} characters, {limits.max_chars_per_token} per token of context). "
                "Please reduce the length of the input.",
                param=_prompt_param(parsed.kind),
            )

        def plan() -> list[EncodePlan]:
            if parsed.kind is not RequestKind.COMPLETION:
                text = counter.render_chat(parsed.messages, tools=parsed.tools, chat_template_kwargs=parsed.chat_template_kwargs)
                return [counter.plan(text)]
            return [counter.plan(p, add_special_tokens=True) for p in parsed.prompts]

        big = len(parsed.messages) > INLINE_MESSAGES or len(parsed.prompts) > INLINE_MESSAGES or chars > BIG_CHARS
        if self._executor is not None and big:
            # Rendering a template is pure Python: a huge conversation renders in a thread so
            # the event loop keeps serving other streams in between (the GIL switches every 5 ms).
            return self._offload_count(plan, None, runtime, chars)
        plans = plan()
        missing = sum(p.missing_chars for p in plans)
        if missing > INLINE_TOKENIZE_CHARS and self._executor is not None:
            task = self._offload_count(None, plans, runtime, missing)
            if task is None:  # routed on the estimate: the plans' cache lookups still count
                self._count_cache_use(runtime, plans)
            return task
        results = [counter.complete(p) for p in plans]
        self._count_cache_use(runtime, plans)
        return [r.count for r in results], results[0].token_ids

    def _offload_count(
        self, plan: Callable[[], list[EncodePlan]] | None, plans: list[EncodePlan] | None, runtime: ModelRuntime, chars: int
    ) -> asyncio.Task[tuple[list[int], list[int] | None]] | None:
        """The off-loop count of a job of `chars` characters as a task, or None when
        `self.offload` refuses it. The gate hears of the task's end however it ends (a task
        cancelled before it starts never runs its body, hence the done-callback)."""
        if not self.offload.admit(chars):
            return None
        service: list[float] = []
        task = asyncio.ensure_future(self._count_off_loop(plan, plans, runtime, service))
        task.add_done_callback(lambda t: self.offload.done(chars, service[0] if service and not t.cancelled() else None))
        return task

    async def _count_off_loop(
        self, plan: Callable[[], list[EncodePlan]] | None, plans: list[EncodePlan] | None, runtime: ModelRuntime, service: list[float]
    ) -> tuple[list[int], list[int] | None]:
        """`_count`'s slow path: render (when `plans` is None) and tokenize in the executor;
        the seconds that took in the threads go into `service`."""
        loop = asyncio.get_running_loop()
        counter = runtime.counter
        spent = 0.0
        if plans is None:
            plans, s = await loop.run_in_executor(self._executor, _timed, plan)
            spent += s
        if sum(p.missing_chars for p in plans) > INLINE_TOKENIZE_CHARS:
            results = []
            for p in plans:
                result, s = await loop.run_in_executor(self._executor, _timed, counter.complete, p)
                results.append(result)
                spent += s
        else:
            results = [counter.complete(p) for p in plans]
        service.append(spent)
        self._count_cache_use(runtime, plans)
        return [r.count for r in results], results[0].token_ids

    async def _await_count(
        self, counting: Awaitable[tuple[list[int], list[int] | None]], parsed: ParsedRequest, model_name: str, budget_s: float
    ) -> tuple[list[int], list[int] | None, bool]:
        """Wait for an off-loop count at most `budget_s` (seconds; what is left of the count
        budget); past it, fall back to the character estimate (the count goes on in its thread
        and fills the token cache).

        Returns:
            (prompt tokens per prompt, token ids of the first prompt or None, exact?)
        """
        task = asyncio.ensure_future(counting)
        try:
            # shield: on timeout the tokenization goes on in its thread and fills the cache.
            prompt_tokens, token_ids = await asyncio.wait_for(asyncio.shield(task), max(0.0, budget_s))
        except TimeoutError:
            task.add_done_callback(_consume)
            self._metrics.token_estimates.labels(model_name).inc()
            return _estimate_tokens(parsed), None, False
        except BaseException:
            task.cancel()
            raise
        return prompt_tokens, token_ids, True

    def _count_cache_use(self, runtime: ModelRuntime, plans: list[EncodePlan]) -> None:
        """This request's segment-cache hits and misses (from its own plans: the counter's
        shared totals move with every concurrent request)."""
        misses = sum(len(p.missing) for p in plans)
        hits = sum(len(p.segments) for p in plans) - misses
        name = runtime.config.name
        if hits > 0:
            self._metrics.child(self._metrics.tokenizer_cache_hits, name).inc(hits)
        if misses > 0:
            self._metrics.child(self._metrics.tokenizer_cache_misses, name).inc(misses)

    def _in_subset(self, model: str | None, subset: Callable[[Endpoint], bool]) -> list[Endpoint]:
        """The model's endpoints (every routable endpoint when `model` is None) that `subset` admits.

        Raises:
            NoEndpointError: none (503 `no_endpoint_in_subset`).
        """
        pool = [ep for ep in (self._store.routable() if model is None else self._store.for_model(model)) if subset(ep)]
        if not pool:
            raise _none_in_subset(model)
        return pool

    @staticmethod
    def _check_context(parsed: ParsedRequest, model: ModelConfig, prompt_tokens: list[int]) -> None:
        """vLLM's checks and wording: the prompt must leave room for the requested output.

        Raises:
            ContextLengthError: with both numbers, as vLLM reports them.
        """
        limit = model.max_model_len
        for count in prompt_tokens:
            # The prompt alone first, whatever max_tokens says (vLLM's order): the prompt is what
            # the client must change, so `param` names it.
            if count >= limit:
                raise ContextLengthError(
                    f"This model's maximum context length is {limit} tokens. However, your request has "
                    f"{count} input tokens. Please reduce the length of the input messages.",
                    param=_prompt_param(parsed.kind),
                )
            if parsed.max_tokens is not None and count + parsed.max_tokens > limit:
                raise ContextLengthError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{count + parsed.max_tokens} tokens ({count} in the messages, {parsed.max_tokens} in the "
                    "completion). Please reduce the length of the messages or completion.",
                    param="max_output_tokens" if parsed.kind is RequestKind.RESPONSES else "max_tokens",
                )
