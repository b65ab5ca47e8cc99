"""OpenAI-style request models and parsing (`/v1/chat/completions`, `/v1/completions`,
`/v1/responses`).

Models tolerate unknown fields (engines accept many extensions: `min_tokens`, `ignore_eos`,
`chat_template_kwargs`, ...) and validate what routing depends on strictly: `max_tokens` must
be an integer ≥ 1 (not a float, not a string, not a bool), `n` an integer in 1..128, `stream`
a boolean. Errors name the offending parameter in OpenAI's `param` form (`messages[0].content`).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import unquote

import orjson
import pydantic
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from extproc.errors import InvalidJSONError, ValidationError
from extproc.protocol.jsonlimits import MAX_JSON_DEPTH, check_json_depth, check_json_values
from extproc.protocol.jsonspans import object_members
from extproc.types import RequestKind

__all__ = [
    "with_model",
    "content_text",
    "generation_path",
    "normalized_path",
    "SERVED_PATHS",
    "served_path",
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "RESPONSES_PATH",
    "content_text",
    "responses_messages",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ParsedRequest",
    "parse_body",
    "route_kind",
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
_KINDS = {CHAT_PATH: RequestKind.CHAT, COMPLETIONS_PATH: RequestKind.COMPLETION, RESPONSES_PATH: RequestKind.RESPONSES}

SERVED_PATHS: tuple[str, ...] = (CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, "/v1/models", "/health")
"""The paths that reach an engine (the allow-list; every other path gets the gateway's JSON 404):
the OpenAI generation APIs, the model list, the engines' health. BUFFERED mode: the shipped
Envoy configs' routes (`extproc.stack.envoy`); EPP mode, where the gateway is not ours: the
server itself (`protocol.extra_served_paths` adds paths), so vLLM's `/v1/load_lora_adapter`,
`/v1/tokenize` and the like never reach an engine in either mode."""


def route_kind(method: str, path: str) -> RequestKind | None:
    """The generation API a request targets, or None for any other method/path.

    The path is compared the way the engine's HTTP stack will see it: query string and fragment
    dropped, percent-escapes decoded, `.`/`..` segments and repeated slashes resolved, a trailing
    slash tolerated — so `/v1/chat/%63ompletions` cannot slip past admission as "another path"
    (the Envoy configs normalise paths too).
    """
    if method != "POST":  # methods are case-sensitive: `post` is not POST to the engine either
        return None
    return generation_path(path)


def generation_path(path: str) -> RequestKind | None:
    """The generation API `path` names (normalised as in `route_kind`), whatever the method."""
    return _KINDS.get(normalized_path(path))


def served_path(path: str, extra: Sequence[str] = ()) -> bool:
    """`path` (normalised as in `route_kind`) is one of `SERVED_PATHS` or of `extra` (literal paths)."""
    p = normalized_path(path)
    return p in SERVED_PATHS or p in extra


def normalized_path(path: str) -> str:
    """`path` as the engine's HTTP stack sees it (`route_kind`): no query or fragment, escapes
    decoded, dot segments and repeated slashes resolved, no trailing slash."""
    p = path.split("?", 1)[0].split("#", 1)[0]
    if "%" in p:
        p = unquote(p)
    if "//" in p or "/." in p:
        p = posixpath.normpath(p)
        if p.startswith("//"):
            p = "/" + p.lstrip("/")
    if len(p) > 1 and p.endswith("/"):
        p = p[:-1]
    return p


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=False)


class TextPart(_Open):
    type: Literal["text", "input_text"]
    text: StrictStr


class ChatMessage(_Open):
    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[dict[str, Any]] | None = None


class StreamOptions(_Open):
    include_usage: StrictBool = False


class _Common(_Open):
    model: StrictStr = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=128)
    user: StrictStr | None = None
    cache_salt: StrictStr | None = Field(default=None, min_length=1)


class ChatCompletionRequest(_Common):
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over `max_tokens` when both are set."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common):
    """`POST /v1/completions`: `prompt` is a string, a list of strings, a token-id list, or a list of those."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class ResponsesRequest(_Open):
    """`POST /v1/responses`: `input` is a string or a list of items (messages, function calls and
    their outputs); `instructions` becomes the system message; `max_output_tokens` caps the output."""

    model: StrictStr = Field(min_length=1)
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool = False
    user: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    cache_salt: StrictStr | None = Field(default=None, min_length=1)


class ParsedRequest:
    """What the pipeline needs from a request body, with the template inputs normalised.

    Attributes:
        kind: chat, completion or responses (a responses request carries its `instructions`
            and `input` as chat `messages`, the way vLLM renders them).
        model: the requested model name.
        max_tokens: the effective output cap (tokens) or None.
        n, stream, include_usage, user: as sent.
        cache_salt: vLLM's `cache_salt` (a tenant's key mixed into its prefix-cache hashes:
            requests with another salt never share its blocks), or None.
        messages: chat messages as plain dicts, text content parts joined with "\\n" the way
            vLLM does for string-format chat templates.
        tools, chat_template_kwargs: passed to the chat template.
        prompts: completion prompts (strings) and `prompt_token_ids` (lists of ids).
    """

    __slots__ = (
        "kind",
        "model",
        "max_tokens",
        "n",
        "stream",
        "include_usage",
        "user",
        "cache_salt",
        "messages",
        "tools",
        "chat_template_kwargs",
        "prompts",
        "prompt_token_ids",
    )

    def __init__(self, kind: RequestKind, model: str) -> None:
        self.kind = kind
        self.model = model
        self.max_tokens: int | None = None
        self.n = 1
        self.stream = False
        self.include_usage = False
        self.user: str | None = None
        self.cache_salt: str | None = None
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] | None = None
        self.chat_template_kwargs: dict[str, Any] | None = None
        self.prompts: list[str] = []
        self.prompt_token_ids: list[list[int]] = []


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "list[dict[str,any]]", "function-after"):
            continue  # union branch names pydantic inserts into locations
        else:
            out += ("." if out else "") + str(part)
    return out


def _validation_error(exc: pydantic.ValidationError) -> ValidationError:
    errors = exc.errors(include_url=False)
    # Prefer the most specific error: a missing field over a union-branch mismatch.
    first = next((e for e in errors if e["type"] == "missing"), errors[0])
    param = _param(first["loc"])
    if first["type"] == "missing":
        return ValidationError(f"'{param}' is a required property", param=param)
    value = first.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ValidationError(f"Invalid value for '{param}': {first['msg']} (got {shown})", param=param)


def content_text(content: Any, index: int, *, field: str = "messages") -> str:
    """A message's `content` as the string a string-format chat template (Qwen3's, Llama's)
    renders: text parts joined with "\\n", as vLLM's `_parse_chat_message_content_parts` joins
    them for such templates; None is "".

    Args:
        content: a string, None, or a list of content parts (dicts).
        index: the message's position (for the error's `param`).
        field: the request field holding the messages (`messages`, or `input` for /v1/responses).

    Raises:
        ValidationError: a part that is not text (`text`/`input_text`/`output_text` with a
            string `text`): this gateway serves text models.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(f"{field}[{index}].content must be a string or a list of parts", param=f"{field}[{index}].content")
    texts = []
    for j, part in enumerate(content):
        ptype = part.get("type") if isinstance(part, dict) else None
        if ptype in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif ptype in _TEXT_PARTS:
            raise ValidationError(
                f"{field}[{index}].content[{j}].text must be a string", param=f"{field}[{index}].content[{j}].text"
            )
        else:
            raise ValidationError(
                f"{field}[{index}].content[{j}]: unsupported content part type {ptype!r}; "
                "this endpoint serves text models and accepts 'text' parts",
                param=f"{field}[{index}].content[{j}].type",
            )
    return "\n".join(texts)


_TEXT_PARTS = frozenset(("text", "input_text", "output_text"))


def responses_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders for a /v1/responses request (its `_construct_input_messages`):
    `instructions` as a system message, a string `input` as one user message, and each input
    item as a message — a `function_call` as an assistant tool call, a `function_call_output`
    as a tool message, a message item (with or without `type: message`) as itself, its content
    parts flattened as in `content_text`.

    Raises:
        ValidationError: an item that is not an object, of an unsupported type (reasoning items,
            images, files: this gateway serves text models), or a message without a role.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for i, item in enumerate(items):
        itype = item.get("type", "message")
        if itype == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif itype == "function_call_output":
            messages.append({"role": "tool", "content": _output_text(item.get("output"), i), "tool_call_id": item.get("call_id")})
        elif itype == "message" and isinstance(item.get("role"), str) and item["role"]:
            msg = {k: v for k, v in item.items() if k not in ("type", "id", "status") and v is not None}
            msg["content"] = content_text(item.get("content"), i, field="input")
            messages.append(msg)
        else:
            raise ValidationError(
                f"input[{i}]: unsupported input item (type {itype!r}); this endpoint accepts messages, "
                "function_call and function_call_output items",
                param=f"input[{i}]",
            )
    return messages


def _output_text(output: Any, index: int) -> str:
    return output if isinstance(output, str) else content_text(output, index, field="input")


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses-API function tools (`{"type": "function", "name", "parameters"}`) in the chat
    shape the chat template reads (`{"type": "function", "function": {...}}`), as vLLM converts them."""
    if not tools:
        return None
    out = []
    for t in tools:
        if t.get("type") == "function" and "function" not in t:
            out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
        else:
            out.append(t)
    return out


def parse_body(
    kind: RequestKind,
    body: bytes,
    *,
    max_values: int | None = None,
    max_messages: int | None = None,
    max_prompts: int | None = None,
    max_depth: int | None = MAX_JSON_DEPTH,
) -> ParsedRequest:
    """Parse and validate a generation request body.

    Args:
        kind: from `route_kind` (decides the schema).
        body: the raw request body (bytes).
        max_values: most JSON values the body may hold (`limits.max_json_values`), checked on
            the bytes before they are decoded; None when the caller has checked already.
        max_messages: most chat messages (`limits.max_messages`), checked before the messages
            are validated (validating one costs ~5 µs); None for no limit.
        max_prompts: most prompts of a batched completions request (`limits.max_prompts`),
            checked with the prompt list's item types before pydantic; None for no limit.
        max_depth: deepest nesting of arrays and objects (levels, `MAX_JSON_DEPTH`), checked on
            the bytes once here, for every path that re-reads the accepted body with a recursive
            scanner; None when the caller has checked already.

    Raises:
        InvalidJSONError: not UTF-8 (the message gives the byte offset), not JSON, or not an object.
        ValidationError: more than `max_values` JSON values, `max_messages` messages or
            `max_prompts` prompts; nested deeper than `max_depth`; a field is missing, of the
            wrong type, or out of range.
    """
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSONError(f"request body is not valid UTF-8 (invalid byte at offset {exc.start})") from None
    if max_values is not None:
        check_json_values(body, max_values)
    if max_depth is not None:
        check_json_depth(body, max_depth)
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSONError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidJSONError(f"request body must be a JSON object, got {type(raw).__name__}")
    return parse_mapping(kind, raw, max_messages=max_messages, max_prompts=max_prompts)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(x) is int for x in value)


MAX_TOKEN_ID = 2**32 - 1
"""Largest token id accepted: ids are packed as uint32 by the prefix hasher
(`extproc.prefix.hashing`); real vocabularies are far smaller (the engine refuses the rest)."""


def _check_token_range(ids: list[int], where: str) -> None:
    """Raises ValidationError when an id of `ids` is outside 0..MAX_TOKEN_ID."""
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(x for x in ids if not 0 <= x <= MAX_TOKEN_ID)
        raise ValidationError(
            f"Invalid value for 'prompt': token id {bad}{where} is outside 0..{MAX_TOKEN_ID}", param="prompt"
        )


def _check_prompt_list(prompt: list[Any], max_prompts: int | None) -> None:
    """A list `prompt` must be token ids, strings, or lists of token ids (the schema's union),
    checked before pydantic: a completions body may carry a full context's worth of values
    (the token-id allowance of `limits.max_json_values`), and pydantic reporting every
    mismatching item of every union branch cost ~1 s for 57k floats (measured).

    Raises:
        ValidationError: more than `max_prompts` prompts, an item of the wrong type, or a token
            id outside 0..MAX_TOKEN_ID (2³²−1).
    """
    if _is_token_ids(prompt):
        _check_token_range(prompt, "")
        return
    if max_prompts is not None and len(prompt) > max_prompts:
        raise ValidationError(
            f"'prompt' is a list of {len(prompt)} items that are not all token ids; a batch holds at most "
            f"{max_prompts} prompts",
            param="prompt",
        )
    first = prompt[0]
    kind, ok = (
        ("a string", lambda x: isinstance(x, str)) if isinstance(first, str)
        else ("a token id", lambda x: type(x) is int) if type(first) is int
        else ("a list of token ids", _is_token_ids)
    )  # fmt: skip
    for i, item in enumerate(prompt):
        if not ok(item):
            raise ValidationError(
                f"Invalid value for 'prompt': item {i} is not {kind} "
                "(a prompt list holds strings, token ids, or lists of token ids)",
                param="prompt",
            )
        if type(first) is not int and not isinstance(first, str):
            _check_token_range(item, f" (prompt {i})")


def with_model(body: bytes, model: str) -> bytes:
    """`body` (a JSON object already accepted by `parse_body`) with its top-level `model` value
    replaced by `model`: a client used an alias, and the engines know the model by its served
    name. Only that value's bytes change (the last `model` key, the one a JSON parser keeps):
    numbers, escapes and spacing reach the engine exactly as the client wrote them.

    Raises:
        ValueError: `body` is not a JSON object with a `model` member (parse_body rejects those).
    """
    text = body.decode("utf-8")
    members, _ = object_members(text)
    spans = [(start, end) for key, start, end in members if key == "model"]
    if not spans:
        raise ValueError("no model member")
    start, end = spans[-1]
    return (text[:start] + json.dumps(model, ensure_ascii=False) + text[end:]).encode("utf-8")


def parse_mapping(
    kind: RequestKind, raw: Mapping[str, Any], *, max_messages: int | None = None, max_prompts: int | None = None
) -> ParsedRequest:
    """Validate an already-decoded JSON object; see `parse_body`."""
    sent = raw.get("messages") if kind is RequestKind.CHAT else raw.get("input") if kind is RequestKind.RESPONSES else None
    if max_messages is not None and isinstance(sent, list) and len(sent) > max_messages:
        raise ValidationError(f"{len(sent)} messages; at most {max_messages} are accepted", param="messages")
    if kind is RequestKind.COMPLETION and isinstance(raw.get("prompt"), list):
        _check_prompt_list(raw["prompt"], max_prompts)
    try:
        if kind is RequestKind.CHAT:
            req: _Common | ResponsesRequest = ChatCompletionRequest.model_validate(raw)
        elif kind is RequestKind.RESPONSES:
            req = ResponsesRequest.model_validate(raw)
        else:
            req = CompletionRequest.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise _validation_error(exc) from None
    if isinstance(req, ResponsesRequest):
        out = ParsedRequest(kind, req.model)
        out.max_tokens = req.max_output_tokens
        out.stream = req.stream
        out.include_usage = req.stream  # the `response.completed` event always carries usage
        out.user = req.user
        out.cache_salt = req.cache_salt
        if req.input == [] or req.input == "":
            raise ValidationError("'input' must not be empty", param="input")
        out.messages = responses_messages(req.instructions, req.input)
        out.tools = _chat_tools(req.tools)
        return out
    out = ParsedRequest(kind, req.model)
    out.n = req.n
    out.stream = req.stream
    out.include_usage = bool(req.stream_options and req.stream_options.include_usage)
    out.user = req.user
    out.cache_salt = req.cache_salt
    if isinstance(req, ChatCompletionRequest):
        out.max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        messages = []
        for i, m in enumerate(req.messages):
            # What `model_dump(exclude_none=True)` gives, without deep-copying the extra fields
            # (pydantic keeps them as sent; copying a big one cost more than validating it).
            msg: dict[str, Any] = {"role": m.role, "content": content_text(m.content, i)}
            msg.update((k, v) for k, v in (m.model_extra or {}).items() if v is not None)
            messages.append(msg)
        out.messages = messages
        out.tools = req.tools
        out.chat_template_kwargs = req.chat_template_kwargs
    else:
        assert isinstance(req, CompletionRequest)
        out.max_tokens = req.max_tokens
        prompt = req.prompt
        if isinstance(prompt, str):
            out.prompts = [prompt]
        elif not prompt:
            raise ValidationError("'prompt' must not be empty", param="prompt")
        elif isinstance(prompt[0], str):
            out.prompts = list(prompt)  # type: ignore[arg-type]
        elif isinstance(prompt[0], int):
            out.prompt_token_ids = [list(prompt)]  # type: ignore[arg-type]
        else:
            out.prompt_token_ids = [list(p) for p in prompt]  # type: ignore[union-attr]
    return out
