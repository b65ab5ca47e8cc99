"""Ask an llm-extproc replica for decisions directly over ext_proc, as Envoy would, and hold them.

    async with grpc.aio.insecure_channel("127.0.0.1:9002") as ch:
        held = await decide(ch, chat_body("hello"))     # the routing reply has arrived
        held.endpoint                                   # "10.0.0.1:8000"
        await held.end()                                # the stream ends: the replica releases it

For the replica tests and `scripts/bench_replicas.py`: a decision held open stays in flight on the
replica (and, with sync, on every replica) until `end()`, so a burst's spread can be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.server.responses import DESTINATION_HEADER

__all__ = ["HeldDecision", "chat_body", "decide", "DESTINATION_HEADER"]


def chat_body(model: str, content: str, **extra: Any) -> bytes:
    """An OpenAI chat-completions body with one user message (JSON bytes)."""
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}], **extra})


@dataclass(slots=True)
class HeldDecision:
    """One ext_proc stream after its routing reply, still open.

    Attributes:
        endpoint: the chosen endpoint (`ip:port`), or None when the replica refused the request.
        reply: the body-phase reply.
    """

    endpoint: str | None
    reply: pb.ProcessingResponse
    _call: Any

    async def end(self) -> None:
        """End the stream (the request is over; the replica releases its reservation)."""
        await self._call.done_writing()
        try:
            while await self._call.read() != grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError:
            pass


async def decide(channel: grpc.aio.Channel, body: bytes, path: str = "/v1/chat/completions") -> HeldDecision:
    """Send one request's headers and body on a new ext_proc stream; return once the routing
    reply arrived, with the stream still open.

    Raises:
        grpc.aio.AioRpcError: the replica is unreachable or ended the stream.
    """
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    hdrs = {":method": b"POST", ":path": path.encode(), ":authority": b"llm.local", "content-type": b"application/json"}
    await call.write(
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in hdrs.items()]))
        )
    )
    await call.read()
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    reply = await call.read()
    endpoint = None
    if reply.WhichOneof("response") == "request_body":
        for opt in reply.request_body.response.header_mutation.set_headers:
            if opt.header.key == DESTINATION_HEADER:
                endpoint = opt.header.raw_value.decode()
    return HeldDecision(endpoint, reply, call)
