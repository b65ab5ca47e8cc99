"""Builders for ext_proc `ProcessingResponse` messages.

Envoy reads header values from `raw_value` (bytes): a mutation carrying only `value` is
silently dropped and one carrying both is rejected (DESIGN section 3), so every header we
set uses `raw_value` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from extproc.errors import ExtProcError

__all__ = [
    "DESTINATION_HEADER",
    "OWNED_HEADERS",
    "continue_request_headers",
    "generation_headers_reply",
    "response_headers",
    "response_body",
    "response_body_cleared",
    "GENERATION_MODE_STREAMED",
    "GENERATION_MODE",
    "GENERATION_MODE_NO_RESPONSE",
    "ERROR_BODY_MODE",
    "PASSTHROUGH_MODE",
    "route_in_headers",
    "route_in_body",
    "immediate_error",
    "continue_for",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""The header naming the chosen endpoint ("ip:port") that Envoy's original-destination cluster
routes on; in the Endpoint Picker Protocol also the destination's key in the dynamic metadata."""

OWNED_HEADERS: tuple[str, ...] = (
    DESTINATION_HEADER,
    "x-llm-tier",
    "x-llm-prompt-tokens",
    "x-llm-route-debug",
    "x-llm-tenant",
)
"""Routing headers this project owns (and `x-llm-tenant`, which `ratelimit.tenant_header` may
name: only a trusted layer between Envoy's header_mutation and ext_proc filters sets it). A client never sets them: Envoy's header_mutation filter
strips them before ext_proc (envoy/*.yaml keeps the same list) and the server removes or
overwrites them on every request."""

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _raw(value: str) -> bytes:
    """Header bytes: Latin-1 first, so a value we read as Latin-1 (a client's x-request-id)
    goes back byte for byte; UTF-8 for anything outside it."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode()


def header_options(headers: Mapping[str, str]) -> list[base_pb2.HeaderValueOption]:
    """`headers` as Envoy header mutations that overwrite (values as raw bytes: latin-1 where
    they fit, else UTF-8)."""
    return [
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=_raw(v)), append_action=_OVERWRITE)
        for k, v in headers.items()
    ]


_PM = processing_mode_pb2.ProcessingMode

GENERATION_MODE = _PM(
    request_header_mode=_PM.SEND,
    request_body_mode=_PM.BUFFERED,
    request_trailer_mode=_PM.SKIP,
    response_header_mode=_PM.SEND,
    response_body_mode=_PM.NONE,
    response_trailer_mode=_PM.SKIP,
)
"""Processing for a generation request: the whole request body, then the response headers
(first-token phase tracking, the explain header). Envoy replaces its whole mode with an
override, so every field is set (DEFAULT would mean SEND)."""

GENERATION_MODE_STREAMED = _PM(
    request_header_mode=_PM.SEND,
    request_body_mode=_PM.BUFFERED,
    request_trailer_mode=_PM.SKIP,
    response_header_mode=_PM.SEND,
    response_body_mode=_PM.STREAMED,
    response_trailer_mode=_PM.SKIP,
)
"""GENERATION_MODE with the response body streamed through the server (telemetry on): each
body chunk is one message, answered in order, unchanged unless markers are injected."""

GENERATION_MODE_NO_RESPONSE = _PM()
GENERATION_MODE_NO_RESPONSE.CopyFrom(GENERATION_MODE)
GENERATION_MODE_NO_RESPONSE.response_header_mode = _PM.SKIP
"""GENERATION_MODE without the response headers (`telemetry.response_headers: when_needed`,
unobserved requests): two messages per request."""

ERROR_BODY_MODE = _PM()
ERROR_BODY_MODE.CopyFrom(GENERATION_MODE)
ERROR_BODY_MODE.response_body_mode = _PM.BUFFERED
"""Switched to from response headers with an error status: the engine's error body arrives
whole, to be rewritten to the gateway's error shape (`extproc.server.engine_errors`)."""

PASSTHROUGH_MODE = _PM(
    request_header_mode=_PM.SEND,
    request_body_mode=_PM.NONE,
    request_trailer_mode=_PM.SKIP,
    response_header_mode=_PM.SKIP,
    response_body_mode=_PM.NONE,
    response_trailer_mode=_PM.SKIP,
)
"""Processing for any other request: nothing after the request headers."""

MODELS_LIST_MODE = _PM()
MODELS_LIST_MODE.CopyFrom(PASSTHROUGH_MODE)
MODELS_LIST_MODE.response_header_mode = _PM.SEND
MODELS_LIST_MODE.response_body_mode = _PM.BUFFERED
"""`GET /v1/models` with aliases configured: its response headers (the status; `content-length`
goes) and its body, whole, to add the aliases (`extproc.server.models_list`)."""


def continue_request_headers(
    remove: Iterable[str] = OWNED_HEADERS, mode: processing_mode_pb2.ProcessingMode | None = None
) -> pb.ProcessingResponse:
    """Headers-phase reply for a request whose body we still need: strip owned headers, go on,
    optionally overriding the processing mode for the rest of the stream. A new message each call
    (`generation_headers_reply` is the shared one a generation request gets)."""
    resp = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=pb.HeaderMutation(remove_headers=list(remove)))
        )
    )
    if mode is not None:
        resp.mode_override.CopyFrom(mode)
    return resp


_GENERATION_HEADERS = continue_request_headers(mode=GENERATION_MODE)
_GENERATION_HEADERS_STREAMED = continue_request_headers(mode=GENERATION_MODE_STREAMED)
_GENERATION_HEADERS_NO_RESPONSE = continue_request_headers(mode=GENERATION_MODE_NO_RESPONSE)


def generation_headers_reply(*, observe: bool, skip_response_headers: bool) -> pb.ProcessingResponse:
    """The headers-phase reply of a generation request: owned headers stripped, the stream
    switched to GENERATION_MODE_STREAMED when its response is observed, else to
    GENERATION_MODE_NO_RESPONSE when response headers are skipped, else to GENERATION_MODE.
    The three replies are built once, at import (every generation request gets one of them, and
    gRPC only serializes it): never modify the message returned."""
    if observe:
        return _GENERATION_HEADERS_STREAMED
    return _GENERATION_HEADERS_NO_RESPONSE if skip_response_headers else _GENERATION_HEADERS


def response_headers(
    set_headers: Mapping[str, str], remove: Iterable[str] = (), mode: processing_mode_pb2.ProcessingMode | None = None
) -> pb.ProcessingResponse:
    """Response-headers reply adding `set_headers` and removing `remove` (both may be empty:
    continue unchanged), optionally overriding the processing mode for the response body."""
    if not set_headers and not remove and mode is None:
        return _EMPTY["response_headers"]
    resp = pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(set_headers=header_options(set_headers), remove_headers=list(remove))
            )
        )
    )
    if mode is not None:
        resp.mode_override.CopyFrom(mode)
    return resp


def response_headers_with_body(set_headers: Mapping[str, str], body: bytes) -> pb.ProcessingResponse:
    """Response-headers reply that also supplies the body (`CONTINUE_AND_REPLACE`): for an
    answer that came with none (headers with end_of_stream), e.g. a bare 5xx from a proxy.
    Envoy drops `content-length` and sends `body` (bytes) as the whole response body."""
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                status=pb.CommonResponse.CONTINUE_AND_REPLACE,
                header_mutation=pb.HeaderMutation(set_headers=header_options(set_headers), remove_headers=["content-length"]),
                body_mutation=pb.BodyMutation(body=body),
            )
        )
    )


def response_body(replacement: bytes | None) -> pb.ProcessingResponse:
    """Response-body reply (STREAMED mode): the chunk unchanged, or replaced by `replacement`."""
    if replacement is None:
        return _EMPTY["response_body"]
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=replacement)))
    )


def response_body_cleared() -> pb.ProcessingResponse:
    """Response-body reply that sends nothing of this chunk (held back for a later rewrite)."""
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(clear_body=True)))
    )


def route_in_headers(
    headers: Mapping[str, str], *, skip_body: bool, mode: processing_mode_pb2.ProcessingMode | None = None
) -> pb.ProcessingResponse:
    """Headers-phase routing (requests we do not parse): set headers, recompute the route, and
    with `skip_body` tell Envoy not to send us the body (needs `allow_mode_override`); `mode`
    overrides the processing of the rest of the stream instead."""
    resp = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(set_headers=header_options(headers)),
                clear_route_cache=True,
            )
        )
    )
    if mode is not None:
        resp.mode_override.CopyFrom(mode)
    elif skip_body:
        resp.mode_override.CopyFrom(PASSTHROUGH_MODE)
    return resp


def route_in_body(headers: Mapping[str, str], body: bytes | None = None) -> pb.ProcessingResponse:
    """Body-phase routing: set the routing headers on the upstream request and recompute the
    route; with `body`, also replace the request body (and its `content-length`, which Envoy
    keeps from the original headers in this mode)."""
    if body is not None:
        headers = {**headers, "content-length": str(len(body))}
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=header_options(headers)), clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))


def immediate_error(err: ExtProcError, *, request_id: str | None = None) -> pb.ProcessingResponse:
    """Answer the client directly with the OpenAI-style JSON error body and its status."""
    headers = {"content-type": "application/json", **err.headers()}
    if request_id:
        headers["x-request-id"] = request_id
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=err.status),
            headers=pb.HeaderMutation(set_headers=header_options(headers)),
            body=err.body(),
            details=f"llm_extproc_{err.code or 'error'}",
        )
    )


_EMPTY = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def continue_for(phase: str) -> pb.ProcessingResponse:
    """The no-op reply for a phase: Envoy needs exactly one reply per message, of the same kind."""
    return _EMPTY[phase]
