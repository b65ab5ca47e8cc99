"""The ext_proc stream state machine: one gRPC stream per HTTP request.

Phases, each answered with exactly one `ProcessingResponse` of the same kind, in order:

1. request_headers — generation path (`POST /v1/chat/completions`, `/v1/completions`): strip
   owned headers and wait for the body. Any other request: pick a healthy endpoint now, set the
   routing header, and (if a body follows) tell Envoy not to send it to us. A generation request
   without a body is a 400.
2. request_body (BUFFERED, so it arrives whole) — run the pipeline; set
   `x-gateway-destination-endpoint`, `x-llm-prompt-tokens`, and `x-request-id` when absent, with
   `clear_route_cache`; or answer an `ImmediateResponse` with the JSON error.
3. anything else — continue unchanged.

The stream's end, however it comes (clean close after the response, CANCELLED, a client abort,
a server error), releases the request's reservation: that is the `finally` below. Success is
never judged from the gRPC status (DESIGN section 3).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.datastore.endpoints import Reservation
from extproc.errors import BadRequestError, ExtProcError, NoEndpointError
from extproc.metrics import Metrics
from extproc.pipeline.request import RequestPipeline
from extproc.protocol.openai import route_kind
from extproc.server import responses
from extproc.types import RequestKind

__all__ = ["ExtProcServicer"]

log = logging.getLogger(__name__)

_WANTED = frozenset((":method", ":path", "x-request-id"))


class DecisionTimeout(ExtProcError):
    status = 503
    type = "service_unavailable"
    code = "decision_timeout"


def _headers(msg: pb.HttpHeaders) -> dict[str, str]:
    """The few request headers we read, decoded as Latin-1 (any byte sequence is valid, so a
    value with byte 0xFF cannot crash us; we never echo these values back)."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        key = h.key
        if key in _WANTED:
            out[key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """`envoy.service.ext_proc.v3.ExternalProcessor` over the request pipeline.

    Args:
        pipeline: decides generation requests.
        metrics: metrics sink.
        decision_timeout_s: budget for one decision (seconds); past it the client gets a 503.
    """

    def __init__(self, pipeline: RequestPipeline, metrics: Metrics, *, decision_timeout_s: float) -> None:
        self._pipeline = pipeline
        self._metrics = metrics
        self._timeout = decision_timeout_s
        self.active_streams = 0

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        reservation: Reservation | None = None
        kind = None
        request_id: str | None = None
        self.active_streams += 1
        self._metrics.streams_active.inc()
        try:
            async for msg in request_iterator:
                phase = msg.WhichOneof("request")
                if phase == "request_headers":
                    hdrs = _headers(msg.request_headers)
                    request_id = hdrs.get("x-request-id")
                    kind = route_kind(hdrs.get(":method", ""), hdrs.get(":path", ""))
                    end = msg.request_headers.end_of_stream
                    if kind is not None and not end:
                        yield responses.continue_request_headers()
                        continue
                    if kind is not None:
                        err = BadRequestError("request body is required for this endpoint")
                        self._metrics.requests.labels("rejected", err.code).inc()
                        yield responses.immediate_error(err, request_id=request_id)
                        continue
                    try:
                        endpoint = self._pipeline.pick(None)
                    except NoEndpointError as err:
                        self._metrics.requests.labels("rejected", err.code).inc()
                        yield responses.immediate_error(err, request_id=request_id)
                        continue
                    reservation = self._pipeline.reserve(endpoint)
                    self._metrics.requests.labels("passthrough", "ok").inc()
                    yield responses.route_in_headers(self._routing_headers(endpoint.address, None, request_id), skip_body=not end)
                elif phase == "request_body":
                    if kind is None or reservation is not None:
                        yield responses.continue_for(phase)
                        continue
                    response, reservation = await self._decide(msg.request_body.body, kind, request_id)
                    yield response
                else:
                    yield responses.continue_for(phase)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("ext_proc stream failed")
            raise
        finally:
            if reservation is not None:
                reservation.release()
            self.active_streams -= 1
            self._metrics.streams_active.dec()

    @staticmethod
    def _routing_headers(address: str, prompt_tokens: int | None, request_id: str | None) -> dict[str, str]:
        headers = {"x-gateway-destination-endpoint": address}
        if prompt_tokens is not None:
            headers["x-llm-prompt-tokens"] = str(prompt_tokens)
        if not request_id:
            headers["x-request-id"] = uuid.uuid4().hex
        return headers

    async def _decide(
        self, body: bytes, kind: RequestKind, request_id: str | None
    ) -> tuple[pb.ProcessingResponse, Reservation | None]:
        """Run the pipeline on a body; reserve the chosen endpoint (no await in between)."""
        start = time.perf_counter()
        try:
            routed = await asyncio.wait_for(self._pipeline.route(kind, body), self._timeout)
        except asyncio.TimeoutError:
            err: ExtProcError = DecisionTimeout(f"routing decision took longer than {self._timeout:.3f} s")
        except ExtProcError as exc:
            err = exc
        except Exception:
            log.exception("decision failed")
            err = ExtProcError("internal error while routing the request")
        else:
            reservation = self._pipeline.reserve(routed.endpoint)
            m = self._metrics
            for phase, seconds in routed.timings_s.items():
                m.decision_seconds.labels(phase).observe(seconds)
            m.prompt_tokens.observe(routed.request.prompt_tokens)
            m.requests.labels("routed", "ok").inc()
            m.endpoint_routed.labels(routed.endpoint.address).inc()
            headers = self._routing_headers(routed.endpoint.address, routed.request.prompt_tokens, request_id)
            return responses.route_in_body(headers), reservation
        self._metrics.decision_seconds.labels("total").observe(time.perf_counter() - start)
        self._metrics.requests.labels("rejected", err.code or "error").inc()
        return responses.immediate_error(err, request_id=request_id), None
