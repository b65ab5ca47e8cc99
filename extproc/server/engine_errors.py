"""An engine's error answer, rewritten to the gateway's OpenAI error shape.

vLLM answers errors as `{"object": "error", "message", "type": "BadRequestError", "param",
"code": 400}` (newer releases: `{"error": {...}}` with the same fields), its HTTP stack answers
an unknown route as `{"detail": "Not Found"}`, and a crashed handler as text/plain. The gateway's
own refusals are `{"error": {"message", "type", "param", "code"}}` with OpenAI's string types
(`extproc.errors`); a client should see that one shape whichever layer refused.
`openai_error_body` turns any of those engine bodies into it, keeping the engine's message and
`param`.
"""

from __future__ import annotations

from typing import Any

import orjson

from extproc.errors import error_body

__all__ = ["MAX_ERROR_BODY_BYTES", "hold_error_bytes", "is_client_error", "openai_error_body"]

_MAX_MESSAGE_CHARS = 2000

MAX_ERROR_BODY_BYTES = 64 * 1024
"""How much of an engine's error body is kept for the rewrite (bytes): an error answer is a few
hundred bytes; past this a misbehaving engine's body is dropped, not held (a 50 MB error body was
held whole). The rewrite reads the message from what was kept."""


def hold_error_bytes(held: bytearray, chunk: bytes) -> None:
    """Append `chunk` to the error body being held, up to `MAX_ERROR_BODY_BYTES` in all."""
    room = MAX_ERROR_BODY_BYTES - len(held)
    if room > 0:
        held += chunk[:room]

_TYPES = {429: "rate_limit_exceeded", 503: "service_unavailable"}
_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    422: "invalid_value",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def is_client_error(status: int) -> bool:
    """A 4xx the engine answers to the client's own request (bad field, context too long,
    unknown model): the client's mistake, not the endpoint failing. 429 (the engine shedding
    load) and 408 (it timed the request out) are the endpoint's state, not the client's."""
    return 400 <= status < 500 and status not in (408, 429)


def _type_for(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "internal_error"


def _fields(body: bytes) -> tuple[str | None, Any]:
    """(message, param) from an engine's error body, any of the shapes above; message None when
    the body says nothing usable."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode("utf-8", "replace").strip()
        return (text or None), None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            obj = err
        elif isinstance(err, str):
            return err, None
        msg = obj.get("message", obj.get("detail"))
        param = obj.get("param")
        if msg is not None and not isinstance(msg, str):
            msg = orjson.dumps(msg).decode()
        return msg, param if isinstance(param, str) else None
    return None, None


def openai_error_body(status: int, body: bytes) -> bytes:
    """The gateway-shaped error body (bytes, JSON) for an engine's error answer.

    Args:
        status: the engine's HTTP status (≥ 400).
        body: its whole body (any shape; empty allowed).

    Returns:
        `{"error": {"message", "type", "param", "code"}}`: the engine's message (at most 2,000
        characters; `HTTP <status> from the engine` when it gave none) and `param`; `type` and
        `code` from the status, as the gateway's own errors name them (`extproc.errors`).
        A context-length message keeps the gateway's `context_length_exceeded` code.
    """
    message, param = _fields(body)
    if not message:
        message = f"HTTP {status} from the engine"
    message = message[:_MAX_MESSAGE_CHARS]
    code = _CODES.get(status, "engine_error")
    if status == 400 and "maximum context length" in message:
        code = "context_length_exceeded"
    return error_body(message, _type_for(status), code, param)
