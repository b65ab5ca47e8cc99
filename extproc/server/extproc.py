"""The ext_proc stream state machine: one gRPC stream per HTTP request.

Phases, each answered with exactly one `ProcessingResponse` of the same kind, in order:

1. request_headers — generation path (`POST /v1/chat/completions`, `/v1/completions`): strip
   owned headers, switch the stream to GENERATION_MODE (buffered body, then response headers)
   and wait for the body. Any other request: pick a healthy endpoint now, set the routing
   header, and (if a body follows) tell Envoy not to send it to us. A generation request
   without a body is a 400.
2. request_body (BUFFERED, so it arrives whole) — run the pipeline (with flow control on, the
   answer may wait in a queue until the fleet can take the request: `extproc.flowcontrol`); set
   `x-gateway-destination-endpoint` (or `x-llm-tier` in tier mode), `x-llm-prompt-tokens`, and
   `x-request-id` when absent, with `clear_route_cache`; or answer an `ImmediateResponse` with
   the JSON error. A truncated prompt (`extproc.pipeline.truncate`) replaces the body.
3. response_headers — telemetry on: the stream's observer sees status and content type (and
   asks for `content-length` to go when it will inject markers); telemetry off: a 2xx marks
   the request's first token (prefill → decode). The explain header is added when configured,
   `x-llm-truncated-tokens` when the prompt was cut.
4. response_body (STREAMED, telemetry on) — each chunk feeds the observer (TTFT, inter-token
   gaps, usage); the first content event moves the request from prefill to decode; the chunk
   goes back unchanged, or with marker comment lines when markers are on.
5. anything else — continue unchanged.

`extproc.server.epp.EppServicer` (`protocol.mode: epp`) reuses this class's decision, response
and end-of-stream steps with the Endpoint Picker Protocol's FULL_DUPLEX_STREAMED messages. Either
class answers a proxy in the other body mode with a 500 saying which mode to set.

The stream's end, however it comes (clean close after the response, CANCELLED, a client abort,
a server error), releases the request's reservation and settles its rate-limit charge with what
the response really cost: that is the `finally` below. Success is
never judged from the gRPC status (DESIGN section 3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.datastore.endpoints import Endpoint, Reservation
from extproc.datastore.outliers import OutlierDetector
from extproc.errors import BadRequestError, ExtProcError, MethodNotAllowedError, NoEndpointError
from extproc.flowcontrol.controller import FlowController, not_now
from extproc.metrics import Metrics
from extproc.pipeline.request import Counted, RequestPipeline, Routed
from extproc.pipeline.truncate import TRUNCATE_HEADER
from extproc.protocol.openai import generation_path, route_kind, with_model
from extproc.ratelimit.limiter import Admission, RateLimiter
from extproc.ratelimit.tenant import Tenant
from extproc.server import responses
from extproc.telemetry.decision_log import DecisionLog, DecisionRecord
from extproc.server.engine_errors import hold_error_bytes, is_client_error, openai_error_body
from extproc.server.models_list import is_models_list, with_aliases
from extproc.telemetry.metrics import TelemetryMetrics
from extproc.telemetry.observer import ObserverOptions, StreamObserver
from extproc.types import RequestKind

__all__ = ["Decision", "ExtProcServicer"]

log = logging.getLogger(__name__)


class Decision(NamedTuple):
    """A routed generation request, reserved: what the stream holds until its end, and what
    goes upstream (`headers` to set; `body` to send instead of the client's, or None)."""

    routed: Routed
    reservation: Reservation | None
    admission: Admission | None
    headers: dict[str, str]
    body: bytes | None


@dataclasses.dataclass(slots=True, eq=False)
class _Stream:
    """One ext_proc stream's state, from its request headers to its end (either body mode).

    Attributes:
        hdrs: the request headers read (`ExtProcServicer._headers`).
        kind: the generation request's kind; None for any other request, or once refused.
        start_ns: the request headers' arrival (monotonic ns; 0 before them).
        sampled, tenant, observe: `ExtProcServicer._watch_plan` of a generation request.
        record: its decision-log record, or None.
        routed, reservation, admission: its decision, what it holds, its rate-limit charge.
        observer: the response observer, or None.
        error_status, error_body: the engine's error status whose body is held to be
            rewritten (0: none), and the bytes held so far.
        first_token: the predicted end of prefill when response headers are skipped.
        done: answered with an `ImmediateResponse`: nothing more to say.
        mismatched: the proxy speaks the other body mode (refused; the stream ends).
        subset: the gateway's subset hint (Endpoint Picker Protocol), or None.
        body: the request body held for the decision (Endpoint Picker Protocol).
        buffering: a generation request's body is being held (Endpoint Picker Protocol).
        models_list: a `GET /v1/models` whose answer gets the aliases (`extproc.server.models_list`).
        skip_response_headers: a generation request's response headers skip the server.
        queue_ms: how long flow control held it (milliseconds; None: never queued).
        priority: its priority class once counted (None before).
        evict: flow control's displacement chose it: its next response chunk is answered with
            an ImmediateResponse (503 `displaced`), which makes Envoy reset it.
    """

    hdrs: dict[str, str] = dataclasses.field(default_factory=dict)
    kind: RequestKind | None = None
    start_ns: int = 0
    sampled: bool = False
    observe: bool = False
    tenant: Tenant | None = None
    record: DecisionRecord | None = None
    routed: Routed | None = None
    reservation: Reservation | None = None
    admission: Admission | None = None
    observer: StreamObserver | None = None
    error_status: int = 0
    error_body: bytearray = dataclasses.field(default_factory=bytearray)
    first_token: asyncio.TimerHandle | None = None
    done: bool = False
    mismatched: bool = False
    subset: Callable[[Endpoint], bool] | None = None
    body: bytearray = dataclasses.field(default_factory=bytearray)
    buffering: bool = False
    models_list: bool = False
    skip_response_headers: bool = False
    queue_ms: int | None = None
    priority: str | None = None
    evict: bool = False


PRIORITY_APPLIED_HEADER = "x-llm-priority-applied"
"""Response header naming the class a request ran under when its priority claim was downgraded
(`admission.priority.claimable` bounds what a client may claim)."""

QUEUE_HEADER = "x-llm-queue-ms"
"""Response header: milliseconds flow control held the request (only on requests that queued)."""

_RESPONSE_HEADERS = frozenset((":status", "content-type", "content-length", "content-encoding", responses.PREFILL_FAILED_HEADER))


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """`envoy.service.ext_proc.v3.ExternalProcessor` over the request pipeline.

    Args:
        pipeline: decides generation requests.
        metrics: metrics sink.
        priority_header: request header carrying the priority class (lower case).
        session_header: request header naming a session for session affinity (lower case), or None.
        trusted_priority_header: header a trusted layer sets with any class (lower case), or None.
        explain_header: add `x-llm-route-debug` to responses.
        telemetry: metrics for the response observers, or None to leave response bodies alone.
        observer_options: shared observer settings (markers, bounds).
        sample_rate: fraction of generation requests whose responses are observed (0..1].
        decision_log: where to write one line per decided generation request, or None.
        outlier_detection: ejects endpoints answering 5xx, or None for no ejection.
        ratelimit: tenants' rate limits, or None. A token-limited tenant's responses are always
            observed (for their usage) but only the sampled ones feed telemetry.
        skip_response_headers: unobserved generation requests skip the response-headers
            message and leave prefill at their endpoint's predicted TTFT (a timer) instead;
            only when nothing else needs those headers (`telemetry.response_headers`).
        flow_control: holds requests the fleet cannot take now (`extproc.flowcontrol`), or None.
    """

    full_duplex = False
    """Whether this servicer speaks FULL_DUPLEX_STREAMED bodies (the Endpoint Picker Protocol)."""
    _mode_logged = False
    """Whether a body-mode mismatch was logged (once per process)."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        metrics: Metrics,
        *,
        priority_header: str = "x-llm-priority",
        session_header: str | None = "x-session-id",
        trusted_priority_header: str | None = None,
        explain_header: bool = False,
        telemetry: TelemetryMetrics | None = None,
        observer_options: ObserverOptions | None = None,
        sample_rate: float = 1.0,
        outlier_detection: OutlierDetector | None = None,
        decision_log: DecisionLog | None = None,
        ratelimit: RateLimiter | None = None,
        skip_response_headers: bool = False,
        flow_control: FlowController | None = None,
    ) -> None:
        self._skip_response_headers = skip_response_headers
        self._flow = flow_control
        self._displaceable = flow_control is not None and flow_control.config.displacement
        self._ratelimit = ratelimit
        self._pipeline = pipeline
        self._log = decision_log
        self._outliers = outlier_detection
        self._telemetry = telemetry
        self._observer_options = observer_options or ObserverOptions()
        self._sample_rate = sample_rate if telemetry is not None else 0.0
        self._rng = random.Random()
        self._metrics = metrics
        self._priority_header = priority_header
        self._explain = explain_header
        self._session_header = session_header
        self._trusted_priority_header = trusted_priority_header
        wanted = {":method", ":path", "x-request-id", priority_header, TRUNCATE_HEADER}
        if session_header:
            wanted.add(session_header)
        if trusted_priority_header is not None:
            wanted.add(trusted_priority_header)
        if ratelimit is not None:
            wanted.update(ratelimit.headers)
        if flow_control is not None:
            wanted.update(flow_control.config.trusted_headers)
        self._wanted = frozenset(wanted)
        self.active_streams = 0

    def _headers(self, msg: pb.HttpHeaders) -> dict[str, str]:
        """The few request headers we read, decoded as Latin-1 (any byte sequence is valid, so a
        value with byte 0xFF cannot crash us). Only x-request-id is ever echoed back (on error
        replies), re-encoded as Latin-1 so it returns byte for byte."""
        out: dict[str, str] = {}
        wanted = self._wanted
        for h in msg.headers.headers:
            if h.key in wanted:
                out[h.key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
        return out

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        s = _Stream()
        self._begin_stream()
        try:
            async for msg in request_iterator:
                phase = msg.WhichOneof("request")
                if phase is None or (phase == "request_headers" and s.start_ns):
                    # Envoy sends one request_headers per stream and never an empty message:
                    # anything else is a broken or hostile client. End the stream (the finally
                    # below releases what it held) rather than guess.
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected ext_proc message: {phase or 'empty'}")
                if phase == "request_headers":
                    verdict = await self._open_stream(msg, s)
                    if isinstance(verdict, pb.ProcessingResponse):
                        yield verdict
                        if s.mismatched:
                            return  # the proxy's body mode is not ours: nothing more to say
                    elif verdict is not None:  # passthrough, reserved
                        headers = self._routing_headers(verdict.address, None, None, s.hdrs.get("x-request-id"))
                        # GET /v1/models: its answer gets the aliases (not in full duplex: no mode override there).
                        s.models_list = not self.full_duplex and is_models_list(s.hdrs.get(":method", ""), s.hdrs.get(":path", "")) and bool(self._pipeline.aliases)
                        mode = responses.MODELS_LIST_MODE if s.models_list else None
                        yield responses.route_in_headers(headers, skip_body=not msg.request_headers.end_of_stream, mode=mode)
                    else:
                        # A downgraded priority claim is told on the response: its headers then cross.
                        s.skip_response_headers = self._skip_response_headers and not self._priority_downgrade(s.hdrs)
                        yield responses.generation_headers_reply(observe=s.observe, skip_response_headers=s.skip_response_headers)
                elif phase == "request_body":
                    if s.done or s.kind is None or s.routed is not None or s.reservation is not None:
                        yield responses.continue_for(phase)
                        continue
                    s.record = self._new_record(s)
                    response = await self._decide(msg.request_body.body, s)
                    if s.routed is not None and s.observe:
                        s.observer = self._observer_for(s.routed, s.admission, s.start_ns, s.sampled)
                        if s.priority == "sheddable" and s.observer is not None and self._displaceable:
                            self._flow.track(s, s.routed.request.served_model)  # type: ignore[union-attr]
                    elif s.reservation is not None and not s.observe and s.skip_response_headers:
                        s.first_token = self._predict_first_token(s.reservation)
                    yield response
                elif phase == "response_headers" and s.models_list:
                    yield self._models_list_headers(s, msg.response_headers)
                elif phase == "response_body" and s.models_list:
                    yield responses.response_body(with_aliases(msg.response_body.body, self._pipeline.aliases))
                elif phase == "response_headers":
                    yield self._response_headers_reply(s, msg.response_headers)
                elif phase == "response_body" and s.evict:
                    # Displaced for a critical request: Envoy resets a stream whose response
                    # already started (the client sees it cut), and the upstream with it.
                    s.done = True
                    yield self._reject(NoEndpointError("evicted for a higher-priority request; retry", code="displaced"), s.hdrs)
                    return
                elif phase == "response_body" and s.error_status:
                    # BUFFERED: the whole body in one message. Were it ever to come in pieces,
                    # each is held back and the rewrite goes out with the last.
                    rewritten = self._hold_error_chunk(s, msg.response_body)
                    yield responses.response_body_cleared() if rewritten is None else responses.response_body(rewritten)
                elif phase == "response_body" and s.observer is not None:
                    yield responses.response_body(self._observe_chunk(msg.response_body, s.observer, s.reservation, s.routed))
                else:
                    yield responses.continue_for(phase)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("ext_proc stream failed")
            raise
        finally:
            self._end_stream(s)

    async def _open_stream(self, msg: pb.ProcessingRequest, s: _Stream) -> pb.ProcessingResponse | Endpoint | None:
        """A stream's request headers, the same in both body modes: read them into `s` (start,
        headers, the subset hint), refuse a proxy in the other body mode (`s.mismatched`, `done`),
        then `_classify_headers`. Returns what `_classify_headers` returns."""
        s.start_ns = time.monotonic_ns()
        s.hdrs = self._headers(msg.request_headers)
        if (wrong := self._proxy_mode_error(msg)) is not None:
            s.mismatched = s.done = True
            return self._reject(wrong, s.hdrs)
        s.subset = self._subset_for(msg)
        return await self._classify_headers(s, msg.request_headers.end_of_stream)

    def _subset_for(self, msg: pb.ProcessingRequest) -> Callable[[Endpoint], bool] | None:
        """The endpoints this request may go to, from its first message; None: any (BUFFERED
        mode has no subset hint; the Endpoint Picker Protocol's servicer reads one)."""
        return None

    async def _classify_headers(self, s: _Stream, end_of_stream: bool) -> pb.ProcessingResponse | Endpoint | None:
        """Classify a request by its headers (`s.hdrs` already read), the same in both body modes.

        Args:
            s: the stream; sets `kind`, and for a generation request `sampled`, `tenant`, `observe`.
                A passthrough request goes only to an endpoint `s.subset` admits (when set).
            end_of_stream: the headers end the request (no body follows).

        Returns:
            the refusal to answer (the stream is then `done`, its `kind` None): a generation
            request without a body (400), a generation path with another method (405), a
            tenant refused before its body crosses, no endpoint for a passthrough request; or
            the endpoint a passthrough request goes to, reserved in `s.reservation`; or None: a
            generation request whose body is awaited.
        """
        hdrs = s.hdrs
        s.kind = route_kind(hdrs.get(":method", ""), hdrs.get(":path", ""))
        err: ExtProcError
        if s.kind is not None and not end_of_stream:
            s.sampled, s.tenant, s.observe = self._watch_plan(hdrs)
            refused = await self._refused_at_headers(s.tenant)
            if refused is None:
                return None
            err = refused
            self._log_refusal_at_headers(s, err)
        elif s.kind is not None:
            err = BadRequestError("request body is required for this endpoint")
        elif generation_path(hdrs.get(":path", "")) is not None:
            err = MethodNotAllowedError(f"{hdrs.get(':method', '')} is not allowed here; use POST")
        elif (unserved := self._unserved(hdrs.get(":path", ""))) is not None:
            err = unserved
        else:
            try:
                endpoint = self._pipeline.pick_any(s.subset)
            except ExtProcError as exc:
                err = exc
            else:
                s.reservation = self._pipeline.reserve_endpoint(endpoint)
                self._metrics.child(self._metrics.requests, "passthrough", "ok").inc()
                return endpoint
        s.kind, s.done = None, True
        return self._reject(err, hdrs)

    def _unserved(self, path: str) -> ExtProcError | None:
        """The 404 for a path that must not reach an engine, or None. BUFFERED mode: None (the
        shipped Envoy configs answer those paths themselves and never ask; a custom config that
        forwards a path meant it); the EPP servicer checks its allow-list."""
        return None

    def _new_record(self, s: _Stream) -> DecisionRecord | None:
        """The decision-log record of a generation request about to be decided, or None when
        there is no log. The tenant's id is a configured name or a key's hash (hashed again
        when written)."""
        if self._log is None:
            return None
        tenant = s.tenant.id if s.tenant is not None else None
        return DecisionRecord(time=time.time(), kind=s.kind.value, tenant=tenant, request_id=s.hdrs.get("x-request-id") or None)  # type: ignore[union-attr]

    def _log_refusal_at_headers(self, s: _Stream, err: ExtProcError) -> None:
        """The decision-log line of a generation request refused at its headers (a tenant over
        its limit, before the body crosses): kind, tenant (hashed when written), our status and
        reason; no body was read, so model and counts stay null."""
        record = self._new_record(s)
        if record is None:
            return
        record.outcome, record.reason, record.status = "rejected", err.code, err.status
        record.decision_s = (time.monotonic_ns() - s.start_ns) / 1e9
        self._log.write(record)  # type: ignore[union-attr]

    @staticmethod
    def _models_list_headers(s: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """`GET /v1/models`'s response headers: a 2xx JSON answer with a body keeps
        `s.models_list` (its body gets the aliases, so `content-length` goes); anything else
        goes through as it is."""
        found = {h.key: (h.raw_value or h.value.encode()).decode("latin-1") for h in msg.headers.headers if h.key in _RESPONSE_HEADERS}
        s.models_list = (
            found.get(":status", "").startswith("2")
            and not msg.end_of_stream
            and found.get("content-encoding") in (None, "identity")
            and found.get("content-type", "").startswith("application/json")
        )
        return responses.response_headers({}, ("content-length",)) if s.models_list else responses.continue_for("response_headers")

    def _priority_downgrade(self, hdrs: dict[str, str]) -> bool:
        """Whether the request's priority claim will be downgraded (`RequestPipeline.priority_downgrade`)."""
        trusted = hdrs.get(self._trusted_priority_header) if self._trusted_priority_header else None
        return self._pipeline.priority_downgrade(hdrs.get(self._priority_header), trusted)

    def _response_headers_reply(self, s: _Stream, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        """`_on_response_headers` for the stream: sets `s.error_status` when the engine's
        error body is to be held and rewritten."""
        extra = s.admission.headers if s.admission is not None else None
        if s.queue_ms is not None:
            extra = {**(extra or {}), QUEUE_HEADER: str(s.queue_ms)}
        reply, s.error_status = self._on_response_headers(msg, s.routed, s.reservation, s.observer, s.record, extra)
        if self._flow is not None:
            self._flow.wake()  # a 2xx's headers mark its first token: its endpoint's prefill count fell
        return reply

    @staticmethod
    def _hold_error_chunk(s: _Stream, chunk: pb.HttpBody) -> bytes | None:
        """One chunk of an engine's error body (`s.error_status` set): fed to the observer and
        held. Returns the whole body in the gateway's error shape with the last chunk
        (`s.error_status` then cleared), None before it."""
        if s.observer is not None:
            s.observer.on_body_chunk(chunk.body, chunk.end_of_stream, time.monotonic_ns())
        hold_error_bytes(s.error_body, chunk.body)
        if not chunk.end_of_stream:
            return None
        return ExtProcServicer._flush_error_body(s)

    @staticmethod
    def _flush_error_body(s: _Stream) -> bytes:
        """The held error body in the gateway's error shape; `s.error_status` cleared."""
        out = openai_error_body(s.error_status, bytes(s.error_body))
        s.error_status = 0
        return out

    @staticmethod
    def _observe_chunk(
        chunk: pb.HttpBody, observer: StreamObserver, reservation: Reservation | None, routed: Routed | None
    ) -> bytes | None:
        """Feed one response body chunk to the observer; the first content event moves the
        request from prefill to decode. Returns the chunk's replacement (marker lines), or None
        to send it unchanged."""
        replacement = observer.on_body_chunk(chunk.body, chunk.end_of_stream, time.monotonic_ns())
        if reservation is not None and reservation.in_prefill and observer.first_content_ns is not None:
            reservation.mark_first_token(learn=routed is not None and routed.request.stream)
        return replacement

    async def _refused_at_headers(self, tenant: Tenant | None) -> ExtProcError | None:
        """The refusal of a tenant that cannot be admitted now, decided at the request headers
        before its body crosses (`RateLimiter.precheck_headers`); None: go on."""
        if tenant is None or self._ratelimit is None:
            return None
        try:
            await self._ratelimit.precheck_headers(tenant)
        except ExtProcError as err:
            return err
        return None

    def _watch_plan(self, hdrs: dict[str, str]) -> tuple[bool, Tenant | None, bool]:
        """For a generation request: (sampled for telemetry?, its rate-limit tenant or None,
        observe its response?). A token-limited tenant's usage settles its reservation, so
        its every response is observed."""
        sampled = self._sample_rate >= 1.0 or self._rng.random() < self._sample_rate
        tenant = self._ratelimit.tenant(hdrs) if self._ratelimit is not None else None
        observe = sampled or (tenant is not None and self._ratelimit.wants_usage(tenant))  # type: ignore[union-attr]
        if not observe and self._displaceable and self._claims_sheddable(hdrs):
            observe = True  # displacement evicts on a response chunk: its response must come here
        return sampled, tenant, observe

    def _claims_sheddable(self, hdrs: dict[str, str]) -> bool:
        """The request's headers claim `sheddable` (displacement's candidates are observed; one
        without a priority header is not a candidate unless it is observed anyway)."""
        trusted = hdrs.get(self._trusted_priority_header) if self._trusted_priority_header else None
        claim = trusted or hdrs.get(self._priority_header) or ""
        return claim.strip(" \t").lower() == "sheddable"

    def _observer_for(self, routed: Routed, admission: Admission | None, start_ns: int, sampled: bool) -> StreamObserver | None:
        """The response observer of an observed request (None when there is nothing to feed:
        a tier-mode request without a rate-limit charge). `start_ns`: the request's start
        (monotonic ns); `sampled`: whether it feeds telemetry, not only its usage."""
        if routed.endpoint is None and admission is None:
            return None
        return StreamObserver(
            endpoint=routed.endpoint.address if routed.endpoint is not None else str(routed.tier),
            model=routed.request.served_model,
            request_start_ns=start_ns,
            stats=routed.endpoint.stream_stats if sampled and routed.endpoint is not None else None,
            metrics=self._telemetry if sampled else None,
            options=self._observer_options,
            route_weight=routed.result.pick.primary.total if routed.result and routed.result.pick else None,
            prompt_tokens=routed.request.prompt_tokens,
        )

    def _proxy_mode_error(self, msg: pb.ProcessingRequest) -> ExtProcError | None:
        """A clear 500 when the proxy's body mode (the `protocol_config` Envoy sends with the
        first message) is not the one `protocol.mode` speaks: the two cannot work together, and
        without this the request would hang until a timeout. None when they agree or the proxy
        does not say. Logged once per process."""
        if not msg.HasField("protocol_config"):
            return None
        full = msg.protocol_config.request_body_mode == processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        if full == self.full_duplex:
            return None
        if full:
            message = "the proxy streams bodies FULL_DUPLEX_STREAMED (a Gateway API Inference Extension gateway?): set protocol.mode: epp"
        else:
            message = "the proxy does not stream bodies FULL_DUPLEX_STREAMED, which protocol.mode: epp needs: use protocol.mode: buffered with our envoy/*.yaml"
        if not ExtProcServicer._mode_logged:
            ExtProcServicer._mode_logged = True
            log.error("ext_proc body mode mismatch, every request gets a 500: %s (docs/epp.md)", message)
        return ExtProcError(f"gateway misconfigured: {message}", code="proxy_mode_mismatch")

    def _begin_stream(self) -> None:
        """Count an open stream (`_end_stream` uncounts it)."""
        self.active_streams += 1
        self._metrics.streams_active.inc()

    def _end_stream(self, s: _Stream) -> None:
        """A stream's end, however it came: close the observer (success judged from what it
        saw, never the gRPC status; a completed response's output length feeds its model's
        output-length estimate, `RequestPipeline.note_output`), write the decision-log line,
        settle the rate-limit charge and release the reservation. Never raises past the release."""
        if s.first_token is not None:
            s.first_token.cancel()
        if self._displaceable:
            self._flow.untrack(s)  # type: ignore[union-attr]
        observer, record, routed, admission, reservation = s.observer, s.record, s.routed, s.admission, s.reservation
        if observer is not None:
            try:
                result = observer.on_end("complete")
                if result.outcome == "complete" and result.output_tokens is not None and routed is not None:
                    # Only completed responses: a cut stream would bias the estimate low.
                    # per sequence: a batched completion's usage sums every prompt's choices
                    self._pipeline.note_output(routed.request.served_model, result.output_tokens, routed.request.sequences)
            except Exception:
                log.exception("stream observer failed at end of stream")
        if record is not None and routed is not None and self._log is not None:
            record.observed_ttft_s = observer.result.ttft_s if observer is not None and observer.result else None
            self._log.write(record)
        if admission is not None:
            self._settle(admission, observer, routed)
        if reservation is not None:
            reservation.release()
            if self._flow is not None:
                self._flow.wake()  # room on its endpoint: a queued request may go
        self.active_streams -= 1
        self._metrics.streams_active.dec()

    def _settle(self, admission: Admission, observer: StreamObserver | None, routed: Routed | None) -> None:
        """Settle a rate-limit charge with what the response really cost (never raises)."""
        limiter = self._ratelimit
        try:
            stats = routed.endpoint.stream_stats if routed is not None and routed.endpoint is not None else None
            tpe = stats.tokens_per_event if stats is not None else 1.0
            result = observer.result if observer is not None else None
            limiter.settle(admission, limiter.used_tokens(admission, result, tpe))  # type: ignore[union-attr]
        except Exception:
            log.exception("rate-limit settlement failed")

    def _reject(self, err: ExtProcError, hdrs: dict[str, str]) -> pb.ProcessingResponse:
        self._metrics.child(self._metrics.requests, "rejected", err.code or "error").inc()
        return responses.immediate_error(err, request_id=hdrs.get("x-request-id"))

    @staticmethod
    def _routing_headers(address: str | None, tier: str | None, prompt_tokens: int | None, request_id: str | None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if address is not None:
            headers[responses.DESTINATION_HEADER] = address
        if tier is not None:
            headers["x-llm-tier"] = tier
        if prompt_tokens is not None:
            headers["x-llm-prompt-tokens"] = str(prompt_tokens)
        if not request_id:
            headers["x-request-id"] = uuid.uuid4().hex
        return headers

    async def _decide(self, body: bytes, s: _Stream) -> pb.ProcessingResponse:
        """`_route`, answered in BUFFERED mode: the routing headers (and a rewritten body) on
        the body reply, or the error's `ImmediateResponse`. Sets the stream's decision, or on
        a refusal marks it `done` (its `kind` None), as `_classify_headers` does."""
        decided = await self._route(body, s)
        if isinstance(decided, pb.ProcessingResponse):
            s.kind, s.done = None, True  # answered: a stray body after this decides nothing
            return decided
        s.routed, s.reservation, s.admission = decided.routed, decided.reservation, decided.admission
        return responses.route_in_body(decided.headers, decided.body)

    async def _route(self, body: bytes, s: _Stream) -> Decision | pb.ProcessingResponse:
        """Run the pipeline on a body, charge the tenant's rate limit, reserve the decision.

        Reads the stream's `kind`, `hdrs`, `record` (filled in), `tenant` (charged) and `subset`
        (Endpoint Picker Protocol: only the endpoints it accepts; None admits every endpoint).
        Returns the decision, or the `ImmediateResponse` refusing the request.

        Only the rate-limit charge may await between the decision and the KV reservation: the
        memory backend never suspends, and a remote one gives a charge back when the stream is
        cancelled during the call (`RateLimiter._acquire`). Discovery may drain or remove the
        chosen endpoint during that call: the request is then routed once more (the charge is
        per tenant and model, so it stands; only the scheduling runs again, not the parsing and
        counting), and when that endpoint is gone too the charge is
        given back (tokens and in-flight slot) and the answer is a 503 `endpoint_gone`. Any
        refusal after the charge gives it back, and a failure after the choice (the decision
        log's prediction, the reservation, headers, an alias's body rewrite) releases the
        reservation and gives the charge back too, answering 500.

        No timer guards the whole decision: its only wait is token counting off the event loop,
        which the pipeline bounds (half of `limits.decision_timeout_ms`, then a character
        estimate); the rest runs without yielding.

        With flow control (`_flow_route`) the charge comes before scheduling, and nothing awaits
        between schedule and reserve; a request the fleet cannot take now waits in a queue
        (bounded by its band's TTL) after the charge, which is given back when it is refused
        there or its stream is cancelled while it waits."""
        start = time.perf_counter()
        admission: Admission | None = None
        held: Reservation | None = None  # made by flow control's dispatch cycle
        kind, hdrs, record, tenant = s.kind, s.hdrs, s.record, s.tenant

        try:
            counted = await self._pipeline.count(
                kind,  # type: ignore[arg-type]
                body,
                priority_header=hdrs.get(self._priority_header),
                session_header=hdrs.get(self._session_header) if self._session_header else None,
                truncate_header=hdrs.get(TRUNCATE_HEADER),
                record=record,
                trusted_priority=hdrs.get(self._trusted_priority_header) if self._trusted_priority_header else None,
                before_count=functools.partial(self._ratelimit.precheck, tenant) if tenant is not None else None,  # type: ignore[union-attr]
                subset=s.subset,
            )
            if self._flow is not None:
                s.priority = counted.priority
                # Flow control: the tenant's rate limit first (a request over it gets its 429
                # and never queues), then schedule and reserve with no await between — at once,
                # or from the queue when the fleet cannot take it now.
                if tenant is not None:
                    admission = await self._ratelimit.admit(tenant, counted.request)  # type: ignore[union-attr]
                try:
                    routed, held = await self._flow_route(counted, s, len(body))
                except asyncio.CancelledError:
                    if admission is not None:  # the client left while queued: nothing was sent
                        self._ratelimit.settle(admission, 0)  # type: ignore[union-attr]
                    raise
            else:
                routed = self._pipeline.schedule(counted)
            if tenant is not None and self._flow is None:
                admission = await self._ratelimit.admit(tenant, routed.request)  # type: ignore[union-attr]
                if not self._still_listed(routed):
                    # Discovery drained or removed the endpoint during the charge's round trip:
                    # schedule once more (same model, so the charge stands; the prompt is not
                    # counted again), else give it back.
                    log.info("endpoint %s left the pool during the rate-limit charge; routing again", routed.endpoint.address)  # type: ignore[union-attr]
                    routed = self._pipeline.schedule(counted)
                    if not self._still_listed(routed):
                        raise NoEndpointError(
                            f"the endpoints chosen for model `{routed.request.served_model}` left the pool during the decision; retry",
                            code="endpoint_gone",
                        )
        except ExtProcError as exc:
            err: ExtProcError = exc
        except Exception:
            log.exception("decision failed")
            err = ExtProcError("internal error while routing the request")
        else:
            # Nothing below may leave the charge or the reservation behind: they reach the
            # stream only with the returned Decision, so a failure here gives both back.
            reservation: Reservation | None = held
            queued_s = s.queue_ms / 1000.0 if s.queue_ms is not None else 0.0
            try:
                if queued_s:  # the decision's phases, not the wait (the queue has its own histogram)
                    routed.timings_s["total"] = max(0.0, routed.timings_s["total"] - queued_s)
                if record is not None:
                    record.decision_s, record.tier = time.perf_counter() - start - queued_s, routed.tier
                    record.queue_s = queued_s if s.queue_ms is not None else None
                    if routed.endpoint is not None:
                        record.endpoint = routed.endpoint.address
                        record.predict(routed)
                if reservation is None:
                    reservation = self._pipeline.reserve(routed)
                m = self._metrics
                m.observe_each(m.decision_seconds, routed.timings_s)
                m.prompt_tokens.observe(routed.request.prompt_tokens)
                m.child(m.requests, "routed", "ok").inc()
                address = routed.endpoint.address if routed.endpoint is not None else None
                if address is not None:
                    m.child(m.endpoint_routed, address).inc()
                if routed.result is not None and log.isEnabledFor(logging.DEBUG):
                    log.debug("request %s: %s", hdrs.get("x-request-id", "-"), routed.explain())
                headers = self._routing_headers(address, routed.tier, routed.request.prompt_tokens, hdrs.get("x-request-id"))
                if record is not None and record.request_id is None:
                    record.request_id = headers.get("x-request-id")  # the one we set
                if (prefiller := routed.prefill_endpoint) is not None:
                    headers[responses.PREFILLER_HEADER] = prefiller.address
                req = routed.request
                # A truncated prompt's body; an alias: the engines serve the model under its configured
                # name. A LoRA adapter's name is what selects the adapter in the engine: never rewritten.
                rewritten = routed.body
                if req.model != req.served_model and req.adapter is None:
                    rewritten = with_model(rewritten or body, req.served_model)
                return Decision(routed, reservation, admission, headers, rewritten)
            except Exception:
                log.exception("decision failed after the choice")
                if reservation is not None:
                    reservation.release()
                err = ExtProcError("internal error while routing the request")
        if admission is not None:  # refused after the charge: nothing was sent, nothing is owed
            self._ratelimit.settle(admission, 0)  # type: ignore[union-attr]
        self._metrics.child(self._metrics.decision_seconds, "total").observe(time.perf_counter() - start)
        if record is not None and self._log is not None:
            record.outcome, record.reason, record.status = "rejected", err.code, err.status
            record.decision_s = time.perf_counter() - start
            if s.queue_ms is not None:  # refused after waiting in a queue (expired, shutdown)
                record.queue_s = s.queue_ms / 1000.0
                record.decision_s = max(0.0, record.decision_s - record.queue_s)
            self._log.write(record)
        return self._reject(err, hdrs)

    async def _flow_route(self, counted: Counted, s: _Stream, nbytes: int) -> tuple[Routed, Reservation | None]:
        """Flow control's decision on a counted request (rate limit already charged).

        Fast path — nothing queued for its model pool: schedule (`FlowController.route`: among
        the endpoints the gate leaves open when it refuses the first choice), and when the gate
        admits return (routed, None) for the caller to reserve with no await between;
        no allocation, no await. Otherwise (something queued, the gate closed, or the scheduler
        answered "not now": no KV room, saturation shedding) the request queues in its (tenant,
        band) flow and this awaits its dispatch: (routed, its reservation), both made by the
        dispatch cycle in one step. `s.queue_ms` is set when it queued.

        Raises:
            ExtProcError: the scheduler's refusal (any but "not now"), a queue bound (429
                `queue_full`), expiry (503 `queue_timeout`), shutdown (503 `shutting_down`), a
                trusted flow header's bad value (400).
            asyncio.CancelledError: the stream ended while queued; its ticket is gone, and a
                reservation made for it in that instant is released.
        """
        fc = self._flow
        assert fc is not None
        pool = counted.request.served_model
        routed: Routed | None = None
        # Trusted flow headers are checked on the fast path too: a bad one is a 400 whether or
        # not the fleet is busy (no cost when none is trusted).
        ident = fc.identity.resolve(s.hdrs, s.tenant, counted.priority) if fc.identity.reads_headers else None
        if fc.idle(pool):
            try:
                routed, admitted = fc.route(counted)
            except ExtProcError as err:
                if not not_now(err):
                    raise
            else:
                if admitted:
                    fc.count_immediate(counted.priority)
                    return routed, None
        if ident is None:
            ident = fc.identity.resolve(s.hdrs, s.tenant, counted.priority)
        req = counted.request
        if routed is not None:  # charged as the scheduler sees it: uncached prompt + expected output
            cost = routed.prefill_counts.uncached + routed.decode_tokens * req.sequences
        else:
            output = counted.parsed.max_tokens or counted.model.default_output_tokens
            cost = int(req.prompt_tokens) + output * req.sequences
        began = time.monotonic()
        ticket = fc.enqueue(counted, pool, ident, nbytes, max(1, cost))
        try:
            done = await ticket.future  # type: ignore[misc]
        except asyncio.CancelledError:
            fc.cancel(ticket)
            raise
        finally:
            s.queue_ms = round((time.monotonic() - began) * 1000)
        return done.routed, done.reservation

    def _still_listed(self, routed: Routed) -> bool:
        """The routed endpoints (the prefill one too, when disaggregated) are still in the
        datastore, as the same objects, and take new requests (True also when nothing was picked)."""
        return all(
            ep is None or (self._pipeline.endpoint(ep.address) is ep and not ep.draining) for ep in (routed.endpoint, routed.prefill_endpoint)
        )

    def _record_outcome(self, endpoint: Endpoint, status: int, routed_at: float) -> None:
        """Feed one answer's status to outlier detection; count and log an ejection."""
        assert self._outliers is not None
        seconds = self._outliers.record(endpoint, status, routed_at, time.monotonic())
        if seconds is not None:
            self._metrics.child(self._metrics.endpoint_ejections, endpoint.address).inc()
            log.warning(
                "endpoint %s ejected for %.0f s (ejection %d): %d answers in a row with a 5xx status",
                endpoint.address, seconds, endpoint.ejections, self._outliers.threshold,
            )  # fmt: skip

    @staticmethod
    def _predict_first_token(reservation: Reservation) -> asyncio.TimerHandle:
        """Without its response headers, a request leaves prefill when its endpoint's fit says
        the first token comes (`PrefillFit.predict` of the prefill queued ahead of it, its own
        included); nothing is learned from that guess."""
        delay = max(0.0, reservation.endpoint.prefill_fit.predict(reservation.backlog_tokens))
        return asyncio.get_running_loop().call_later(delay, functools.partial(reservation.mark_first_token, learn=False))

    def _on_response_headers(
        self,
        msg: pb.HttpHeaders,
        routed: Routed | None,
        reservation: Reservation | None,
        observer: StreamObserver | None,
        record: DecisionRecord | None = None,
        ratelimit_headers: dict[str, str] | None = None,
    ) -> tuple[pb.ProcessingResponse, int]:
        """The reply to a generation response's headers, and the status when the body must be
        rewritten to the gateway's error shape (0 otherwise)."""
        found: dict[str, str] = {}
        for h in msg.headers.headers:
            if h.key in _RESPONSE_HEADERS:
                found[h.key] = (h.raw_value or h.value.encode()).decode("latin-1")
        try:
            status = int(found.get(":status", "0"))
        except ValueError:
            status = 0
        if record is not None and status:
            record.status = status
        extra: dict[str, str] = dict(ratelimit_headers) if ratelimit_headers else {}
        remove: tuple[str, ...] = ()
        if observer is not None:
            try:
                length: int | None = int(found["content-length"]) if "content-length" in found else None
            except ValueError:
                length = None
            observer.on_response_headers(
                status,
                found.get("content-type", ""),
                length,
                time.monotonic_ns(),
                content_encoding=found.get("content-encoding"),
            )
            extra.update(observer.response_headers_to_add())
            remove = observer.response_headers_to_remove()
        # A 4xx to the client's own request (a field the engine refused) says nothing about the
        # endpoint: it neither counts toward nor ends a streak of 5xx answers.
        if (
            self._outliers is not None
            and routed is not None
            and routed.endpoint is not None
            and reservation is not None
            and status
            and not is_client_error(status)
        ):
            # A disaggregated request whose prefill failed (the sidecar says so): the prefill
            # endpoint answered badly, the decode one did nothing wrong.
            failed_prefill = responses.PREFILL_FAILED_HEADER in found and routed.prefill_endpoint is not None
            self._record_outcome(routed.prefill_endpoint if failed_prefill else routed.endpoint, status, reservation.created_at)  # type: ignore[arg-type]
        streamed = routed is not None and routed.request.stream
        if reservation is not None and 200 <= status < 300 and (observer is None or not streamed):
            # Without body telemetry, a stream's headers are our best signal that prefill is
            # over (an engine answers them with its first chunk; observed streams wait for the
            # first content instead). A non-streamed answer starts with its last token: it
            # leaves prefill here but teaches nothing about prefill speed.
            reservation.mark_first_token(learn=streamed)
        if routed is not None and routed.truncation is not None:
            extra["x-llm-truncated-tokens"] = str(routed.truncation.tokens_dropped)
        if routed is not None and routed.priority_applied is not None:
            extra[PRIORITY_APPLIED_HEADER] = routed.priority_applied  # the claim was downgraded to it
        if self._explain and routed is not None:
            extra["x-llm-route-debug"] = routed.explain()
        if routed is not None and status >= 400 and msg.end_of_stream:
            # No body at all (a proxy's or a crashed handler's bare 5xx): give it one, so the
            # client reads the same JSON error shape as from any other refusal.
            extra["content-type"] = "application/json"
            return responses.response_headers_with_body(extra, openai_error_body(status, b"")), 0
        if routed is not None and status >= 400 and not msg.end_of_stream and found.get("content-encoding") in (None, "identity"):
            # The engine's own error shape (vLLM's {"object": "error", ...}, a text/plain 404):
            # take the body whole and answer it in the gateway's shape.
            extra["content-type"] = "application/json"
            remove = (*remove, "content-length")
            # FULL_DUPLEX_STREAMED takes no mode override: the body arrives in chunks anyway, held
            # and rewritten with the last (see the response_body branch of each servicer).
            mode = None if self.full_duplex else responses.ERROR_BODY_MODE
            return responses.response_headers(extra, remove, mode=mode), status
        return responses.response_headers(extra, remove), 0
