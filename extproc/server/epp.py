"""The Gateway API Inference Extension's Endpoint Picker Protocol (`protocol.mode: epp`).

llm-extproc as an InferencePool's picker, behind a gateway that configures the ext_proc filter
the way the protocol's gateways do (Envoy Gateway, Istio, kgateway, GKE; the protocol's
proposal 004 and its reference picker): request and response bodies FULL_DUPLEX_STREAMED,
trailers SEND, headers SEND, no mode overrides. The decision is the same pipeline as in
BUFFERED mode (`ExtProcServicer._route`: parse, count, admit, schedule, reserve; the same
response telemetry and the same release on every end); only the messages differ:

1. request_headers — kept, not answered yet: the headers' answer carries the destination,
   which needs the body. A request without a body (GET /v1/models) is routed here and answered
   at once; so is a request for a path we do not parse (its body is echoed back as it comes).
2. request_body chunks — buffered, no answer (FULL_DUPLEX_STREAMED lets the server hold them;
   over `limits.max_body_bytes` → 413 at once). On the chunk with `end_of_stream`, or on the
   request trailers, the decision runs; then, in order: the headers' answer
   (`x-gateway-destination-endpoint`, `clear_route_cache`, and the same destination in the
   `envoy.lb` dynamic metadata), the body in `StreamedBodyResponse` pieces of at most
   `protocol.chunk_bytes` (the last one marked `end_of_stream` unless trailers came), then the
   trailers' answer when there were trailers. A refusal is an `ImmediateResponse` (the spec's
   503 for no endpoint, 429 for shedding and full KV; our 400/404/413 for bad requests).
3. response_headers — the endpoint that served the request is read back from the
   `envoy.lb` filter metadata (`x-gateway-destination-endpoint-served`); when the gateway
   retried onto a fallback, the reservation and the telemetry move to it. Then the same reply
   as in BUFFERED mode, without the mode override it would carry for an error body.
4. response_body chunks — every chunk comes through (no mode override can turn them off): fed
   to the observer when the request is observed, answered as a `StreamedBodyResponse` with the
   same bytes (or with marker lines). An engine's error body is held and answered whole, in
   the gateway's error shape, with the last chunk.

The subset hint (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the
request's filter metadata, a list of "ip:port" or "ip" strings, or one comma-separated string)
is a hard filter: only those endpoints are candidates; an empty list or none known → 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Iterable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from extproc.config.schema import ProtocolConfig
from extproc.datastore.endpoints import Endpoint, Reservation, canonical_host
from extproc.errors import ExtProcError, NoEndpointError, NotFoundError, PayloadTooLargeError
from extproc.pipeline.request import Routed
from extproc.protocol.openai import served_path
from extproc.server import responses
from extproc.server.extproc import ExtProcServicer, _Stream

__all__ = [
    "EppServicer",
    "SERVED_KEY",
    "SUBSET_KEY",
    "Subset",
    "parse_subset",
    "served_endpoint",
]

log = logging.getLogger(__name__)

SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""The subset hint's key in the subset namespace's filter metadata."""
SERVED_KEY = "x-gateway-destination-endpoint-served"
"""The served endpoint's key in the destination namespace's filter metadata (responses)."""



def _split_host_port(address: str) -> tuple[str, str | None]:
    """("10.0.0.1", "8000") from "10.0.0.1:8000", ("::1", "8000") from "[::1]:8000", and a
    bare host with None for its port ("10.0.0.1", "::1", "[::1]"). An IP address comes back
    in its canonical text (`ipaddress`: IPv6 lower-case and compressed), so "[2001:DB8::1]"
    and "[2001:db8:0::1]" name the same host; a name comes back as it is."""
    address = address.strip()
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return canonical_host(host), rest[1:] if rest.startswith(":") and rest[1:] else None
    if address.count(":") == 1:
        host, _, port = address.partition(":")
        return canonical_host(host), port or None
    return canonical_host(address), None  # a bare IPv4 or IPv6 address, or a name


_endpoint_host_port = functools.lru_cache(maxsize=4096)(_split_host_port)
"""`_split_host_port` of an endpoint's address, split once per address, not once per request
and candidate (the addresses a process sees are few; 4096 bounds what discovery churn keeps)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Subset:
    """The endpoints a gateway allows for one request (the protocol's subset hint).

    Attributes:
        exact: allowed (host, port) pairs. hosts: hosts allowed on any port (entries sent
            without a port, as the reference picker accepts them).
    """

    exact: frozenset[tuple[str, str]]
    hosts: frozenset[str]

    def __call__(self, endpoint: Endpoint) -> bool:
        host, port = _endpoint_host_port(endpoint.address)
        return host in self.hosts or (host, port or "") in self.exact


def parse_subset(value: struct_pb2.Value) -> Subset:
    """The subset hint from its metadata value: a list of strings, or one string; each string
    one or more comma-separated "ip:port" / "ip" entries. Anything else (a number, a nested
    struct) allows nothing: a hint we cannot read must not widen the choice.

    Returns:
        the subset (possibly empty: then no endpoint qualifies, and the request gets a 503).
    """
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        raw: Iterable[str] = [value.string_value]
    elif kind == "list_value":
        raw = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    else:
        raw = []
    exact: set[tuple[str, str]] = set()
    hosts: set[str] = set()
    for item in raw:
        for entry in item.split(","):
            if not entry.strip():
                continue
            host, port = _split_host_port(entry)
            if port is None:
                hosts.add(host)
            else:
                exact.add((host, port))
    return Subset(frozenset(exact), frozenset(hosts))


def _subset_of(msg: pb.ProcessingRequest, namespace: str) -> Subset | None:
    """The request's subset hint, or None when the gateway sent none (every endpoint allowed)."""
    md = msg.metadata_context.filter_metadata
    if namespace not in md:
        return None
    fields = md[namespace].fields
    if SUBSET_KEY not in fields:
        return None
    return parse_subset(fields[SUBSET_KEY])


def served_endpoint(msg: pb.ProcessingRequest, namespace: str) -> str | None:
    """The endpoint that served the response, as the gateway reports it in the filter
    metadata of the response messages; the first entry when it sends a list; None when absent."""
    md = msg.metadata_context.filter_metadata
    if namespace not in md:
        return None
    value = md[namespace].fields.get(SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    first = value.string_value.split(",", 1)[0].strip()
    return first or None


def _destination_reply(headers: dict[str, str], destination: str, namespace: str) -> pb.ProcessingResponse:
    """The (deferred) answer to the request headers: routing headers set, owned headers the
    client sent removed, the route recomputed, and the destination in dynamic metadata too
    (the same value as the header: the protocol forbids two different ones)."""
    headers = {**headers, responses.DESTINATION_HEADER: destination}
    remove = [h for h in responses.OWNED_HEADERS if h not in headers]
    metadata = struct_pb2.Struct()
    metadata.fields[namespace].struct_value.fields[responses.DESTINATION_HEADER].string_value = destination
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(set_headers=responses.header_options(headers), remove_headers=remove),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=metadata,
    )


def _streamed(phase: str, body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """One body piece sent on (FULL_DUPLEX_STREAMED: a `StreamedBodyResponse`)."""
    common = pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream))
    )
    if phase == "request_body":
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def _pieces(phase: str, body: bytes, end_of_stream: bool, chunk_bytes: int) -> list[pb.ProcessingResponse]:
    """A whole body sent on in pieces of at most `chunk_bytes` (bytes); only the last may carry
    `end_of_stream`. An empty body is one empty piece (Envoy needs the end marked)."""
    if not body:
        return [_streamed(phase, b"", end_of_stream)]
    out = []
    for start in range(0, len(body), chunk_bytes):
        piece = body[start : start + chunk_bytes]
        out.append(_streamed(phase, piece, end_of_stream and start + chunk_bytes >= len(body)))
    return out


class EppServicer(ExtProcServicer):
    """`ExtProcServicer` speaking the Endpoint Picker Protocol (module docstring).

    Args:
        pipeline, metrics, **kwargs: as `ExtProcServicer`.
        protocol: the `protocol` config (namespaces, fallbacks, piece size).
        max_body_bytes: request bodies over this (bytes) get a 413 as soon as they pass it.
    """

    full_duplex = True

    def __init__(self, *args, protocol: ProtocolConfig, max_body_bytes: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._protocol = protocol
        self._max_body = max_body_bytes
        self._served = self._metrics.epp_served
        for label in ("primary", "other", "unreported"):
            self._served.labels(label)

    def _unserved(self, path: str) -> ExtProcError | None:
        """The gateway's 404 for a path off the allow-list (`SERVED_PATHS` + `protocol.extra_served_paths`):
        the gateway sends every path of the pool here, and vLLM's `/v1/load_lora_adapter`,
        `/v1/tokenize` and the like must not reach an engine (BUFFERED mode's Envoy answers the same)."""
        if served_path(path, self._protocol.extra_served_paths):
            return None
        return NotFoundError("this path is not served by the gateway", code="not_found")

    def _subset_for(self, msg: pb.ProcessingRequest) -> Subset | None:
        """The request's subset hint (`_subset_of` in `protocol.subset_namespace`)."""
        return _subset_of(msg, self._protocol.subset_namespace)

    def _destination(self, routed: Routed) -> str:
        """The primary endpoint, then up to `protocol.fallbacks` runners-up, comma-separated."""
        assert routed.endpoint is not None
        out = [routed.endpoint.address]
        pick = routed.result.pick if routed.result is not None else None
        if pick is not None and self._protocol.fallbacks:
            out += [s.endpoint.address for s in pick.fallbacks[: self._protocol.fallbacks]]
        return ",".join(out)

    def _moved(self, routed: Routed, reservation: Reservation | None, served: str) -> tuple[Routed, Reservation | None]:
        """The request was served by `served`, not by the primary: hold it there instead
        (in-flight slot, KV blocks, prefix blocks) so the next decisions see the real load."""
        endpoint = self._pipeline.endpoint(served)
        if endpoint is None or routed.endpoint is None or endpoint is routed.endpoint:
            self._served.labels("primary" if endpoint is routed.endpoint else "other").inc()
            return routed, reservation
        self._served.labels("other").inc()
        if reservation is not None:
            reservation.release()
        moved = dataclasses.replace(routed, endpoint=endpoint)
        held = self._pipeline.reserve(moved)
        if held is not None:
            # Reserved as its response headers arrive: a first token marked now would teach
            # the endpoint a ~0 ms prefill (its t0 fell to 0 after one such request).
            held.learns = False
        return moved, held

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        proto = self._protocol
        s = _Stream()
        self._begin_stream()
        try:
            async for msg in request_iterator:
                phase = msg.WhichOneof("request")
                if phase is None or (phase == "request_headers" and s.start_ns):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected ext_proc message: {phase or 'empty'}")
                if s.done:
                    continue  # Envoy stops after an ImmediateResponse; a stray message changes nothing
                if phase == "request_headers":
                    verdict = await self._open_stream(msg, s)
                    if isinstance(verdict, pb.ProcessingResponse):
                        yield verdict  # refused before its body is buffered, as in BUFFERED mode (or a proxy in the other mode)
                    elif verdict is not None:  # passthrough, reserved
                        headers = self._routing_headers(None, None, None, s.hdrs.get("x-request-id"))
                        yield _destination_reply(headers, verdict.address, proto.destination_namespace)
                    else:
                        s.buffering = True  # answered once the body is decided
                elif phase in ("request_body", "request_trailers") and s.buffering:
                    trailers = phase == "request_trailers"
                    if not trailers:
                        s.body += msg.request_body.body
                        if len(s.body) > self._max_body:
                            s.done = True
                            err = PayloadTooLargeError(f"request body is over {self._max_body} bytes, the limit")
                            yield self._reject(err, s.hdrs)
                            continue
                        if not msg.request_body.end_of_stream:
                            continue  # held: FULL_DUPLEX_STREAMED needs no answer per chunk
                    s.buffering = False
                    s.record = self._new_record(s)
                    whole = bytes(s.body)
                    s.body = bytearray()
                    decided = await self._route(whole, s)
                    if isinstance(decided, pb.ProcessingResponse):
                        s.done = True
                        yield decided
                        continue
                    s.routed, s.reservation, s.admission = decided.routed, decided.reservation, decided.admission
                    if s.routed.endpoint is None:  # configs forbid tier mode here; never route blind
                        s.done = True
                        yield self._reject(NoEndpointError("no endpoint was chosen"), s.hdrs)
                        continue
                    if s.observe:
                        s.observer = self._observer_for(s.routed, s.admission, s.start_ns, s.sampled)
                    sent = decided.body if decided.body is not None else whole
                    headers = {**decided.headers, "content-length": str(len(sent))}
                    yield _destination_reply(headers, self._destination(s.routed), proto.destination_namespace)
                    for piece in _pieces("request_body", sent, not trailers, proto.chunk_bytes):
                        yield piece
                    if trailers:
                        yield responses.continue_for("request_trailers")
                elif phase == "request_body":
                    # Routed at the headers (passthrough), or a chunk after the decision: on as it came.
                    yield _streamed("request_body", msg.request_body.body, msg.request_body.end_of_stream)
                elif phase == "response_headers":
                    served = served_endpoint(msg, proto.destination_namespace)
                    if served is None and s.routed is not None:
                        self._served.labels("unreported").inc()
                    elif served is not None and s.routed is not None:
                        s.routed, s.reservation = self._moved(s.routed, s.reservation, served)
                        if s.observer is not None and s.routed.endpoint is not None and s.observer.endpoint != s.routed.endpoint.address:
                            s.observer = self._observer_for(s.routed, s.admission, s.start_ns, s.sampled)
                    yield self._response_headers_reply(s, msg.response_headers)
                elif phase == "response_body":
                    chunk = msg.response_body
                    if s.error_status:
                        rewritten = self._hold_error_chunk(s, chunk)
                        if rewritten is not None:
                            for piece in _pieces("response_body", rewritten, True, proto.chunk_bytes):
                                yield piece
                        continue
                    replacement = self._observe_chunk(chunk, s.observer, s.reservation, s.routed) if s.observer is not None else None
                    yield _streamed("response_body", chunk.body if replacement is None else replacement, chunk.end_of_stream)
                elif phase == "response_trailers":
                    if s.error_status:  # the error body ends with the trailers: send it first
                        for piece in _pieces("response_body", self._flush_error_body(s), False, proto.chunk_bytes):
                            yield piece
                    yield responses.continue_for("response_trailers")
                elif phase == "request_trailers":
                    yield responses.continue_for("request_trailers")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("ext_proc (epp) stream failed")
            raise
        finally:
            self._end_stream(s)
