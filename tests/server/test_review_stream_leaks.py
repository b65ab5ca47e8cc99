"""Adversarial review of the servicers' shared `_Stream`: nothing may be reserved for a stream
that was already answered with an `ImmediateResponse`."""

from __future__ import annotations

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.server.test_contract import body_msg, chat_body, error_of, headers_msg
from tests.server.test_ratelimit_contract import AUTH, CAPPED


async def test_buffered_stray_body_after_a_refused_decision_reserves_nothing(make_app):
    """BUFFERED: the body is refused (400, not JSON); a stray second body on the same stream
    must not be decided again. It is: the stream, already answered with an ImmediateResponse,
    then holds a KV reservation and the tenant's only concurrency slot until it ends (the EPP
    servicer sets `done` on a refusal; `ExtProcServicer.Process` does not)."""
    app = await make_app(ratelimit=CAPPED)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
        await call.read()
        await call.write(body_msg(b"{not json"))
        status, _, _ = error_of(await call.read())
        assert status == 400
        await call.write(body_msg(chat_body(max_tokens=20)))
        reply = await call.read()
        held = app.store.open_reservations
        call.cancel()
    assert reply.WhichOneof("response") == "request_body"
    assert not reply.request_body.response.header_mutation.set_headers, "a refused stream was routed on a stray body"
    assert held == 0
