"""The request pipeline for one generation request: parse → count → check → pick → reserve.

Runs inside the ext_proc stream's body phase. Every failure is an `ExtProcError` the server
turns into an OpenAI-style `ImmediateResponse`; nothing here touches gRPC.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

from extproc.config.schema import Config, ModelConfig
from extproc.datastore.endpoints import Datastore, Endpoint, Reservation
from extproc.errors import ContextLengthError, NoEndpointError, NotFoundError, PayloadTooLargeError
from extproc.metrics import Metrics
from extproc.pipeline.tokens import TokenCounter
from extproc.protocol.openai import ParsedRequest, parse_body
from extproc.scheduling.picker import PICKERS
from extproc.types import LLMRequest, RequestKind, TokenCount

__all__ = ["ModelRuntime", "RequestPipeline", "Routed", "INLINE_TOKENIZE_CHARS"]

INLINE_TOKENIZE_CHARS = 6000
"""Prompts up to this many characters (~1.5k tokens) are tokenized on the event loop: a
thread hop costs more than the work. Longer ones go to the executor, where the Rust
tokenizer's `encode_batch` releases the GIL (docs/benchmarks.md has the measurement)."""


@dataclass(slots=True)
class ModelRuntime:
    """A configured model with its loaded tokenizer."""

    config: ModelConfig
    counter: TokenCounter


@dataclass(slots=True)
class Routed:
    """A routing decision: the request and where it goes.

    The caller reserves the endpoint (`RequestPipeline.reserve`) with no await between the
    decision and the reservation, so a cancelled stream can never leave one behind.

    Attributes:
        timings_s: seconds spent per phase (parse, tokenize, pick, total).
    """

    request: LLMRequest
    endpoint: Endpoint
    timings_s: dict[str, float]


class RequestPipeline:
    """Decides where a generation request goes.

    Args:
        config: validated configuration.
        store: endpoint datastore (health, in-flight).
        models: canonical model name → runtime (tokenizer).
        metrics: metrics sink.
        executor: where long prompts are tokenized.
        rng: tie-break randomness (seeded in tests).
    """

    def __init__(
        self,
        config: Config,
        store: Datastore,
        models: Mapping[str, ModelRuntime],
        metrics: Metrics,
        executor: Executor | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._config = config
        self._store = store
        self._models = dict(models)
        self._aliases: dict[str, str] = {}
        for m in config.models:
            for name in (m.name, *m.aliases):
                self._aliases[name] = m.name
        self._metrics = metrics
        self._executor = executor
        self._rng = rng or random.Random()
        self._pick = PICKERS[config.scheduling.picker]
        self._max_body = config.limits.max_body_bytes

    @property
    def served_models(self) -> list[str]:
        """Every name a client may use (canonical names and aliases), sorted."""
        return sorted(self._aliases)

    def resolve_model(self, name: str) -> ModelRuntime:
        """The runtime for a requested model name or alias.

        Raises:
            NotFoundError: unknown model; the message lists the served models.
        """
        canonical = self._aliases.get(name)
        if canonical is None:
            raise NotFoundError(
                f"The model `{name}` does not exist. Served models: {', '.join(self.served_models)}",
                param="model",
            )
        return self._models[canonical]

    async def route(self, kind: RequestKind, body: bytes) -> Routed:
        """Parse, count, check and pick for one request body (reserves nothing).

        Raises:
            PayloadTooLargeError: body over `limits.max_body_bytes`.
            BadRequestError: malformed body, or prompt + max_tokens over `max_model_len`.
            NotFoundError: unknown model.
            NoEndpointError: no healthy endpoint serves the model.
        """
        t0 = time.perf_counter()
        if len(body) > self._max_body:
            raise PayloadTooLargeError(
                f"request body is {len(body)} bytes; the limit is {self._max_body} bytes"
            )
        parsed = parse_body(kind, body)
        runtime = self.resolve_model(parsed.model)
        t1 = time.perf_counter()
        prompt_tokens, token_ids = await self._count(parsed, runtime)
        t2 = time.perf_counter()
        self._check_context(parsed, runtime.config, prompt_tokens)
        req = LLMRequest(
            kind=kind,
            model=parsed.model,
            served_model=runtime.config.name,
            prompt_tokens=TokenCount(sum(prompt_tokens)),
            max_tokens=parsed.max_tokens,
            n=parsed.n,
            stream=parsed.stream,
            include_usage=parsed.include_usage,
            user=parsed.user,
            body_bytes=len(body),  # type: ignore[arg-type]
            token_ids=token_ids,
        )
        endpoint = self.pick(runtime.config.name)
        t3 = time.perf_counter()
        return Routed(req, endpoint, {"parse": t1 - t0, "tokenize": t2 - t1, "pick": t3 - t2, "total": t3 - t0})

    def reserve(self, endpoint: Endpoint) -> Reservation:
        """Count a request in flight on `endpoint` until the reservation is released."""
        return self._store.reserve(endpoint)

    def pick(self, model: str | None) -> Endpoint:
        """Choose a healthy endpoint for `model` (None: any endpoint, for non-generation paths).

        Raises:
            NoEndpointError: none is healthy.
        """
        pool = self._store.for_model(model) if model is not None else self._store.all()
        candidates = [ep for ep in pool if ep.healthy]
        if not candidates:
            what = f"model `{model}`" if model else "this request"
            raise NoEndpointError(f"no healthy endpoint for {what} ({len(pool)} configured, 0 healthy)")
        return self._pick(candidates, self._rng)

    async def _count(self, parsed: ParsedRequest, runtime: ModelRuntime) -> tuple[list[int], list[int] | None]:
        """Prompt tokens per prompt (a list: completions may batch several prompts) and the ids of
        the first prompt (kept for prefix hashing)."""
        counter = runtime.counter
        if parsed.kind is RequestKind.CHAT:
            size = sum(len(m.get("content") or "") for m in parsed.messages)

            def work() -> list[list[int]]:
                return [counter.count_chat(parsed.messages, tools=parsed.tools, chat_template_kwargs=parsed.chat_template_kwargs).token_ids]
        elif parsed.prompts:
            size = sum(len(p) for p in parsed.prompts)

            def work() -> list[list[int]]:
                return [counter.count_text(p).token_ids for p in parsed.prompts]
        else:
            ids = parsed.prompt_token_ids
            return [len(p) for p in ids], ids[0]
        before_h, before_m = counter.hits, counter.misses
        if size > INLINE_TOKENIZE_CHARS and self._executor is not None:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, work)
        else:
            result = work()
        name = runtime.config.name
        self._metrics.tokenizer_cache_hits.labels(name).inc(max(0, counter.hits - before_h))
        self._metrics.tokenizer_cache_misses.labels(name).inc(max(0, counter.misses - before_m))
        return [len(r) for r in result], result[0]

    @staticmethod
    def _check_context(parsed: ParsedRequest, model: ModelConfig, prompt_tokens: list[int]) -> None:
        """vLLM's checks and wording: the prompt must leave room for the requested output.

        Raises:
            ContextLengthError: with both numbers, as vLLM reports them.
        """
        limit = model.max_model_len
        for count in prompt_tokens:
            if parsed.max_tokens is None:
                if count >= limit:
                    raise ContextLengthError(
                        f"This model's maximum context length is {limit} tokens. However, your request has "
                        f"{count} input tokens. Please reduce the length of the input messages.",
                        param="messages" if parsed.kind is RequestKind.CHAT else "prompt",
                    )
            elif count + parsed.max_tokens > limit:
                raise ContextLengthError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{count + parsed.max_tokens} tokens ({count} in the messages, {parsed.max_tokens} in the "
                    "completion). Please reduce the length of the messages or completion.",
                    param="max_tokens",
                )
