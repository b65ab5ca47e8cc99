"""A test-side gateway for the Endpoint Picker Protocol, written from the protocol's text
(gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol) and Envoy's
FULL_DUPLEX_STREAMED rules (processing_mode.proto), not from our server's code.

It encodes requests and decodes replies with envoy-data-plane's betterproto classes, an
implementation independent of the upb stubs the server uses, over a raw gRPC stream of bytes.
`Exchange` keeps what a gateway would act on: the destination from the header and from the
`envoy.lb` dynamic metadata, the request body put back together from its streamed pieces, the
order of the replies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import betterproto2
import grpc
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
)
from envoy_data_plane.google.protobuf import Struct

METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DEST = "x-gateway-destination-endpoint"


def open_stream(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
    """One ext_proc stream carrying betterproto-encoded bytes both ways."""
    return channel.stream_stream(METHOD, request_serializer=bytes, response_deserializer=ProcessingResponse.parse)()


def metadata(namespaces: dict[str, dict[str, Any]] | None) -> Metadata | None:
    if not namespaces:
        return None
    return Metadata(filter_metadata={ns: Struct.from_dict(v) for ns, v in namespaces.items()})


def request_headers(method: str, path: str, *, end: bool = False, extra: dict[str, str] | None = None, md=None) -> ProcessingRequest:
    hdrs = {":method": method, ":path": path, ":authority": "gateway.local", **(extra or {})}
    msg = ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hdrs.items()]), end_of_stream=end)
    )
    if md is not None:
        msg.metadata_context = metadata(md)
    return msg


def request_body(chunk: bytes, *, end: bool) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=chunk, end_of_stream=end))


def request_trailers() -> ProcessingRequest:
    return ProcessingRequest(request_trailers=HttpTrailers(trailers=HeaderMap(headers=[HeaderValue(key="x-checksum", raw_value=b"0")])))


def response_headers(status: int, *, content_type: str = "application/json", served: str | None = None, end: bool = False) -> ProcessingRequest:
    hdrs = {":status": str(status), "content-type": content_type}
    msg = ProcessingRequest(
        response_headers=HttpHeaders(headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in hdrs.items()]), end_of_stream=end)
    )
    if served is not None:
        msg.metadata_context = metadata({"envoy.lb": {"x-gateway-destination-endpoint-served": served}})
    return msg


def response_body(chunk: bytes, *, end: bool) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=chunk, end_of_stream=end))


def chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@dataclass
class Exchange:
    """The request half of one stream, as a gateway sees it."""

    kinds: list[str] = field(default_factory=list)
    """The reply kinds in order: "request_headers", "request_body", "request_trailers", "immediate_response"."""
    header_set: dict[str, str] = field(default_factory=dict)
    header_removed: list[str] = field(default_factory=list)
    clear_route_cache: bool = False
    metadata_destination: str | None = None
    body: bytes = b""
    pieces: list[int] = field(default_factory=list)
    """Size of each streamed body piece (bytes)."""
    body_ended: bool = False
    immediate_status: int | None = None
    immediate_body: bytes = b""
    mode_override: bool = False

    @property
    def destination(self) -> str | None:
        return self.header_set.get(DEST)

    def take(self, reply: ProcessingResponse) -> None:
        """Fold one reply in, checking what the protocol and FULL_DUPLEX_STREAMED demand of it."""
        kind, value = _which(reply)
        self.kinds.append(kind)
        if reply.mode_override is not None:
            self.mode_override = True
        if kind == "request_headers":
            common = value.response
            for opt in common.header_mutation.set_headers:
                assert opt.header.value == "", "a header mutation must use raw_value only"
                self.header_set[opt.header.key] = opt.header.raw_value.decode("latin-1")
            self.header_removed = list(common.header_mutation.remove_headers)
            self.clear_route_cache = common.clear_route_cache
            if reply.dynamic_metadata is not None:
                md = reply.dynamic_metadata.to_dict()
                self.metadata_destination = md.get("envoy.lb", {}).get(DEST)
        elif kind == "request_body":
            mutation = value.response.body_mutation
            assert mutation is not None and mutation.streamed_response is not None, "FULL_DUPLEX_STREAMED needs StreamedBodyResponse"
            assert not self.body_ended, "a body piece after the one marked end_of_stream"
            self.body += mutation.streamed_response.body
            self.pieces.append(len(mutation.streamed_response.body))
            self.body_ended = mutation.streamed_response.end_of_stream
        elif kind == "immediate_response":
            self.immediate_status = value.status.code.value
            self.immediate_body = value.body


def _which(reply: ProcessingResponse) -> tuple[str, Any]:
    return betterproto2.which_one_of(reply, "response")


def streamed_body(reply: ProcessingResponse, phase: str = "response_body") -> tuple[bytes, bool]:
    """(bytes, end_of_stream) of a streamed body reply of `phase`."""
    kind, value = _which(reply)
    assert kind == phase, f"expected {phase}, got {kind}"
    mutation = value.response.body_mutation
    assert mutation is not None and mutation.streamed_response is not None, "FULL_DUPLEX_STREAMED needs StreamedBodyResponse"
    return mutation.streamed_response.body, mutation.streamed_response.end_of_stream
