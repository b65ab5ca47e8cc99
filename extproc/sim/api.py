"""What the simulator reads and writes over HTTP, in vLLM's shapes.

* Requests: the OpenAI chat/completions fields the engine model needs, plus vLLM's extensions
  `min_tokens` and `ignore_eos`; unknown fields are tolerated, as vLLM does.
* Responses: `chat.completion` / `text_completion` bodies and their SSE chunks as vLLM's
  OpenAI server writes them (`data: {json}\\n\\n` … `data: [DONE]\\n\\n`), usage included.
* Errors: vLLM's `ErrorResponse` `{"object":"error","message","type","param","code"}`, with
  vLLM's wording for context-length errors.
* Output text: deterministic filler words, one per token.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "SimAPIError",
    "GenerationParams",
    "parse_generation",
    "context_length_error",
    "model_not_found",
    "output_text",
    "completion_body",
    "stream_chunk",
    "usage_chunk",
    "DONE",
]

DONE = b"data: [DONE]\n\n"

_STATUS_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "TooManyRequestsError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class SimAPIError(Exception):
    """An error answered as vLLM's `ErrorResponse` JSON.

    Args:
        status: HTTP status (also the body's `code`, as vLLM sets it).
        message: human-readable text.
        param: the offending field, if any.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "object": "error",
                "message": self.message,
                "type": _STATUS_TYPES.get(self.status, "InternalServerError"),
                "param": self.param,
                "code": self.status,
            }
        )


def model_not_found(model: str) -> SimAPIError:
    """vLLM's 404 for a model it does not serve."""
    return SimAPIError(404, f"The model `{model}` does not exist.", param="model")


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> SimAPIError:
    """vLLM's 400 when the prompt, or prompt + max_tokens, exceed `max_model_len` (tokens)."""
    if max_tokens is None or prompt_tokens >= max_model_len:
        return SimAPIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            param="messages",
        )
    return SimAPIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
        f"completion). Please reduce the length of the messages or completion.",
        param="max_tokens",
    )


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class GenerationParams(BaseModel):
    """The fields of a chat or completions request that the simulator acts on.

    Attributes:
        model: requested model name (None: the served model, as vLLM allows).
        messages: chat messages (chat only).
        prompt: completions prompt: text, or token ids.
        max_tokens: output cap (tokens); `max_completion_tokens` is accepted as an alias.
        min_tokens: vLLM extension: do not stop before this many tokens.
        ignore_eos: vLLM extension: generate until max_tokens.
        stream, stream_options: SSE and the final usage chunk.
        n: choices; only 1 is simulated.
        seed: makes the sampled output length reproducible.
        tools, chat_template_kwargs: passed to the chat template.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_choice(self) -> GenerationParams:
        if self.n != 1:
            raise ValueError("n > 1 is not supported by the simulator")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({self.max_tokens})")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def parse_generation(raw: bytes, kind: Literal["chat", "completion"]) -> GenerationParams:
    """Parse and check a request body.

    Raises:
        SimAPIError: 400 for invalid JSON, a non-object body, a missing prompt/messages or a
            field of the wrong type or range (the message names the field).
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SimAPIError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise SimAPIError(400, "The request body must be a JSON object")
    try:
        params = GenerationParams.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ())) or None
        raise SimAPIError(400, f"{loc + ': ' if loc else ''}{first.get('msg', 'invalid value')}", param=loc) from None
    if kind == "chat" and not params.messages:
        raise SimAPIError(400, "messages: field required and must not be empty", param="messages")
    if kind == "completion":
        if params.prompt is None or params.prompt == [] or params.prompt == "":
            raise SimAPIError(400, "prompt: field required and must not be empty", param="prompt")
        if isinstance(params.prompt, list) and params.prompt and isinstance(params.prompt[0], str):
            if len(params.prompt) != 1:
                raise SimAPIError(400, "batched prompts are not supported by the simulator", param="prompt")
            params.prompt = params.prompt[0]
    return params


# Filler vocabulary: one entry per output token (deterministic, cheap to slice).
_WORDS = tuple(
    f" {w}"
    for w in (
        "the of and to in is was for on that with as by at from it be this which or an are not "
        "model token cache block batch queue prefill decode latency memory request stream engine "
        "router endpoint prefix throughput scheduler load balance signal metric window budget"
    ).split()
)


def output_text(seed: int, start: int, end: int) -> str:
    """The text of output tokens [start, end) of a request (one filler word per token)."""
    n = len(_WORDS)
    return "".join(_WORDS[(seed + i) % n] for i in range(start, end))


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }


def completion_body(
    kind: Literal["chat", "completion"],
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> bytes:
    """A non-streaming response body, as vLLM writes it."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": None, "prompt_logprobs": None,
        }
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
            "prompt_logprobs": None,
        }
    )


def stream_chunk(
    kind: Literal["chat", "completion"],
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    *,
    role: bool = False,
) -> bytes:
    """One SSE event (`data: {...}\\n\\n`). For chat, `role=True` writes vLLM's first chunk
    (`delta: {role: assistant, content: ""}`)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        obj = "text_completion"
    payload = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage_chunk(
    kind: Literal["chat", "completion"],
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> bytes:
    """The final `stream_options.include_usage` event: no choices, only usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    payload = {
        "id": request_id, "object": obj, "created": created, "model": model, "choices": [],
        "usage": _usage(prompt_tokens, completion_tokens, None),
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"
