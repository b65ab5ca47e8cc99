"""One exception tree for everything a client can be told.

    ExtProcError                      (500, internal_error)      never shown with a traceback
    ├── BadRequestError               (400, invalid_request_error)
    │   ├── InvalidJSONError          body is not JSON / not an object / not UTF-8
    │   ├── ValidationError           a field is missing or of the wrong type/range
    │   └── ContextLengthError        prompt + max_tokens exceed max_model_len
    ├── NotFoundError                 (404, model_not_found)     unknown model
    ├── PayloadTooLargeError          (413, request_too_large)
    ├── RateLimitedError              (429, rate_limit_exceeded) carries retry_after (seconds)
    └── NoEndpointError               (503, service_unavailable) no healthy endpoint

Each leaf knows its HTTP status and renders the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import orjson

__all__ = [
    "ExtProcError",
    "MethodNotAllowedError",
    "BadRequestError",
    "InvalidJSONError",
    "ValidationError",
    "ContextLengthError",
    "NotFoundError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "NoEndpointError",
    "error_body",
]


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> bytes:
    """Render the OpenAI error JSON (bytes, UTF-8)."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


class ExtProcError(Exception):
    """Base of every error answered to a client; `status` is the HTTP status."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def headers(self) -> dict[str, str]:
        """Extra response headers (besides content-type)."""
        return {}


class BadRequestError(ExtProcError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSONError(BadRequestError):
    code = "invalid_json"


class ValidationError(BadRequestError):
    code = "invalid_value"


class ContextLengthError(BadRequestError):
    code = "context_length_exceeded"


class NotFoundError(ExtProcError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class MethodNotAllowedError(ExtProcError):
    """A generation path with a method other than POST (the engine would answer plain text)."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"

    def headers(self) -> dict[str, str]:
        return {"allow": "POST"}


class PayloadTooLargeError(ExtProcError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimitedError(ExtProcError):
    status = 429
    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, int(round(self.retry_after_s))))}


class NoEndpointError(ExtProcError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_endpoint"
