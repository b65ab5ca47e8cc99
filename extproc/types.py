"""Domain types shared across the request pipeline.

Scalars carry their unit in their name (`TokenCount` is tokens, `ByteCount` bytes); the
dataclasses are plain records handed between pipeline stages, free of I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

__all__ = [
    "ByteCount",
    "TokenCount",
    "BlockHash",
    "EndpointAddress",
    "RequestKind",
    "LLMRequest",
    "PROBE_TIMEOUT",
    "HEALTH_PANIC",
]

PROBE_TIMEOUT = "timeout"
"""`Endpoint.last_probe_error` of a health probe that got no answer in time: slow, not down."""
HEALTH_PANIC = "health_panic"
"""`SchedulingContext.data` key `healthy-filter` sets when it routed in panic."""

TokenCount = NewType("TokenCount", int)
ByteCount = NewType("ByteCount", int)
BlockHash = NewType("BlockHash", int)
EndpointAddress = NewType("EndpointAddress", str)
"""`host:port` of an inference endpoint, exactly as written into `x-gateway-destination-endpoint`."""


class RequestKind(enum.StrEnum):
    """Which OpenAI API a request targets."""

    CHAT = "chat"
    COMPLETION = "completion"
    RESPONSES = "responses"
    """`POST /v1/responses`: `instructions` + `input` become chat messages (vLLM does the same)."""


@dataclass(slots=True)
class LLMRequest:
    """One parsed OpenAI-style generation request, as the scheduler sees it.

    Attributes:
        kind: chat, completion or responses.
        model: the model name the client asked for (may be an alias).
        served_model: the canonical configured model name it resolved to.
        prompt_tokens: tokens the engine will prefill, chat template applied (tokens).
        max_tokens: the client's output cap (tokens), or None when unset.
        n: number of choices; decode KV blocks multiply by n, prompt blocks are shared.
        stream: whether the client asked for SSE.
        include_usage: `stream_options.include_usage`.
        user: the OpenAI `user` field (never logged verbatim).
        body_bytes: size of the request body (bytes).
        token_ids: the prompt's token ids when the counter kept them (for prefix hashing).
        prompt_lengths: each prompt's tokens of a batched completion (several prompts; `()`
            for one prompt): attention runs within each (`request_prefill_work`).
        adapter: the LoRA adapter `model` names (`ModelConfig.adapters`, or learned from the
            engines), None for the base model. Sent to the engine as `model` unchanged; the
            tokenizer, KV arithmetic and rate limits are `served_model`'s.
        cache_salt: the request's `cache_salt` (keys its prefix-cache blocks), or None.
    """

    kind: RequestKind
    model: str
    served_model: str = ""
    prompt_tokens: TokenCount = TokenCount(0)
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    body_bytes: ByteCount = ByteCount(0)
    token_ids: list[int] | None = field(default=None, repr=False)
    prompt_lengths: tuple[int, ...] = ()
    adapter: str | None = None
    cache_salt: str | None = None

    @property
    def largest_prompt(self) -> int:
        """The longest prompt's tokens (tokens): of a batched completion's prompts
        (`prompt_lengths`), else `prompt_tokens`. Each prompt is its own engine request, so
        this, not the batch's sum, bounds the output its context leaves."""
        return max(self.prompt_lengths) if self.prompt_lengths else int(self.prompt_tokens)

    @property
    def sequences(self) -> int:
        """Output sequences the engine decodes for it (count): `n` for each prompt, every
        prompt of a batched completion (`prompt_lengths`) its own."""
        return max(1, self.n) * max(1, len(self.prompt_lengths))
