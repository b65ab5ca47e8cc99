"""What the simulator reads and writes over HTTP, in vLLM's shapes.

* Requests: the OpenAI chat/completions fields the engine model needs, plus vLLM's extensions
  `min_tokens` and `ignore_eos`; unknown fields are tolerated, as vLLM does. Chat content may
  be a list of text parts (joined with "\\n" for string-format templates such as Qwen3's, as
  vLLM does); `n` choices are `n` engine requests sharing the prompt (vLLM V1 fans a parallel-
  sampling request out the same way; prefix caching shares the prompt's blocks).
* `POST /v1/responses` (the Responses API, as vLLM serves it): `instructions` + `input` (a string
  or message / function_call / function_call_output items) rendered as chat messages,
  `max_output_tokens`; a `response` object, or with `stream` the `response.created` …
  `response.completed` events (`event:` + `data:` lines, no `[DONE]`).
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

from extproc.errors import BadRequestError
from extproc.protocol.openai import content_text, responses_messages

__all__ = [
    "SimAPIError",
    "GenerationParams",
    "parse_generation",
    "parse_responses",
    "chat_messages",
    "responses_body",
    "responses_event",
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
        bare: answer the status with no body at all (a fault: what a proxy or a crashed
            handler in front of an engine may send).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, bare: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.bare = bare

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
        prompt: completions prompt: text, token ids, or a batch of either (each prompt its own
            engine requests; choice `i * n + j` is prompt i's j-th, as vLLM numbers them).
        max_tokens: output cap (tokens); `max_completion_tokens` is accepted as an alias.
        min_tokens: vLLM extension: do not stop before this many tokens.
        ignore_eos: vLLM extension: generate until max_tokens.
        stream, stream_options: SSE and the final usage chunk.
        n: choices (each one engine request).
        seed: makes the sampled output length reproducible.
        tools, chat_template_kwargs: passed to the chat template.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
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
    def _caps(self) -> GenerationParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({self.max_tokens})")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SimAPIError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise SimAPIError(400, "The request body must be a JSON object")
    return data


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ())) or None
        raise SimAPIError(400, f"{loc + ': ' if loc else ''}{first.get('msg', 'invalid value')}", param=loc) from None


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as a string-format chat template (Qwen3's) reads them: content parts
    flattened to one string, text parts joined with "\\n" (vLLM's rule for such templates).

    Raises:
        SimAPIError: 400 for a message that is not an object or a non-text part.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SimAPIError(400, f"messages.{i}: must be an object", param=f"messages.{i}")
        try:
            out.append({**m, "content": content_text(m.get("content"), i)})
        except BadRequestError as exc:
            raise SimAPIError(400, exc.message, param=exc.param) from None
    return out


class ResponsesParams(BaseModel):
    """The fields of a `/v1/responses` request the simulator acts on (others tolerated)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    seed: int | None = None


def parse_responses(raw: bytes) -> tuple[GenerationParams, ResponsesParams]:
    """Parse a `/v1/responses` body into the generation it asks for (its chat messages, as vLLM
    renders them: `instructions` as the system message, then the input) and the request itself
    (echoed in the `response` object).

    Raises:
        SimAPIError: 400 for invalid JSON, a missing or empty `input`, an unsupported input item.
    """
    req = _validate(ResponsesParams, _json_object(raw))
    if not req.input:
        raise SimAPIError(400, "input: field required and must not be empty", param="input")
    try:
        messages = responses_messages(req.instructions, req.input)
    except BadRequestError as exc:
        raise SimAPIError(400, exc.message, param=exc.param) from None
    tools = None
    if req.tools:
        tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} if "function" not in t else t
                 for t in req.tools]  # fmt: skip
    # The simulator's own output-length controls (`ignore_eos`, `min_tokens`) are honoured here
    # too, so tests and benchmarks can pin an answer's length.
    extra = {k: v for k, v in (req.model_extra or {}).items() if k in ("ignore_eos", "min_tokens")}
    params = _validate(GenerationParams, {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens, "stream": req.stream,
        "seed": req.seed, "tools": tools, **extra,
    })  # fmt: skip
    return params, req


def parse_generation(raw: bytes, kind: Literal["chat", "completion"]) -> GenerationParams:
    """Parse and check a request body.

    Raises:
        SimAPIError: 400 for invalid JSON, a non-object body, a missing prompt/messages or a
            field of the wrong type or range (the message names the field).
    """
    params = _validate(GenerationParams, _json_object(raw))
    if kind == "chat" and not params.messages:
        raise SimAPIError(400, "messages: field required and must not be empty", param="messages")
    if kind == "chat":
        params.messages = chat_messages(params.messages)
    if kind == "completion":
        if params.prompt is None or params.prompt == [] or params.prompt == "":
            raise SimAPIError(400, "prompt: field required and must not be empty", param="prompt")
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
    choices: list[tuple[str, str]],
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int | None = None,
) -> bytes:
    """A non-streaming response body, as vLLM writes it: one choice per (text, finish_reason),
    `completion_tokens` summed over the choices, the prompt counted once."""
    out = []
    for index, (text, finish_reason) in enumerate(choices):
        if kind == "chat":
            out.append({
                "index": index,
                "message": {"role": "assistant", "content": text, "tool_calls": [], "reasoning_content": None},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            })  # fmt: skip
        else:
            out.append({
                "index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": None, "prompt_logprobs": None,
            })  # fmt: skip
    return orjson.dumps(
        {
            "id": request_id,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
            "choices": out,
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
    index: int = 0,
) -> bytes:
    """One SSE event (`data: {...}\\n\\n`) for choice `index`. For chat, `role=True` writes
    vLLM's first chunk (`delta: {role: assistant, content: ""}`)."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
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


def responses_body(
    request: ResponsesParams,
    response_id: str,
    created: int,
    model: str,
    *,
    status: Literal["in_progress", "completed", "incomplete"],
    text: str | None = None,
    message_id: str = "",
    finish_reason: str = "stop",
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """A Responses API `response` object as vLLM writes it: one assistant message with one
    `output_text` part (none while in progress), `incomplete` with reason `max_output_tokens`
    when the cap ended it, `usage` in the Responses API's names (None while in progress)."""
    output: list[dict[str, Any]] = []
    if text is not None:
        output.append({
            "id": message_id, "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}],
        })  # fmt: skip
    incomplete = status == "incomplete"
    usage = None
    if status != "in_progress":
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model, "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": request.tools or [],
        "previous_response_id": None, "reasoning": None, "store": False, "text": {"format": {"type": "text"}},
        "truncation": "disabled", "usage": usage, "user": None, "metadata": None, "error": None,
    }  # fmt: skip


def responses_event(event: str, sequence_number: int, **fields: Any) -> bytes:
    """One Responses API stream event: `event: <type>` and `data: {"type", "sequence_number", ...}`."""
    payload = {"type": event, "sequence_number": sequence_number, **fields}
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
