"""The servicers' shared `_Stream`: nothing may be reserved for a stream that was already
answered with an `ImmediateResponse`, and every way a stream ends releases what it holds."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.server import epp_gateway as gw
from tests.server.test_contract import body_msg, chat_body, error_of, headers_msg
from tests.server.test_epp_contract import CHAT
from tests.server.test_epp_contract import chat_body as epp_chat_body
from tests.server.test_ratelimit_contract import AUTH, CAPPED


async def test_buffered_stray_body_after_a_refused_decision_reserves_nothing(make_app):
    """BUFFERED: the body is refused (400, not JSON); a stray second body on the same stream
    must not be decided again: the stream, already answered with an ImmediateResponse, would
    then hold a KV reservation and the tenant's only concurrency slot until it ends."""
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


EPP_AUTH = {"authorization": AUTH["authorization"].decode()}


async def _read_n(call, n: int) -> None:
    for _ in range(n):
        await call.read()


@pytest.mark.parametrize(
    "how",
    ["cancel mid-body", "cancel after decision", "served elsewhere then cancel", "error body held then cancel",
     "error body whole", "trailers then cancel", "over the body limit then stray chunks"],
)  # fmt: skip
async def test_epp_every_end_releases_kv_and_the_concurrency_slot(make_app, how):
    app = await make_app(protocol={"mode": "epp", "fallbacks": 1}, ratelimit=CAPPED, limits={
        "max_body_bytes": 2048, "grpc_max_message_bytes": 262144, "shutdown_grace_s": 1})
    lim = app.ratelimit
    t = lim.tenant({"authorization": EPP_AUTH["authorization"]})

    async def inflight_now() -> int:
        return (await lim.backend.peek(lim.scopes(t, "Qwen/Qwen3-8B"))).uses[0].inflight

    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        call = gw.open_stream(ch)
        await call.write(gw.request_headers("POST", CHAT, extra=EPP_AUTH))
        body = epp_chat_body(max_tokens=20)
        if how == "cancel mid-body":
            await call.write(gw.request_body(body[:10], end=False))
            await asyncio.sleep(0.1)
        elif how == "over the body limit then stray chunks":
            await call.write(gw.request_body(b"x" * 3000, end=False))
            await call.read()
            await call.write(gw.request_body(body, end=True))
            await call.write(gw.response_headers(200))
            await asyncio.sleep(0.1)
        elif how == "trailers then cancel":
            await call.write(gw.request_body(body, end=False))
            await call.write(gw.request_trailers())
            await _read_n(call, 3)
        else:
            await call.write(gw.request_body(body, end=True))
            await _read_n(call, 2)  # destination, body
            if how == "served elsewhere then cancel":
                dest = app.store.all()
                other = [e.address for e in dest if e.inflight == 0][0]
                await call.write(gw.response_headers(200, served=other))
                await call.read()
            elif how.startswith("error body"):
                await call.write(gw.response_headers(500))
                await call.read()
                await call.write(gw.response_body(b'{"object": "error"', end=False))
                if how == "error body whole":
                    await call.write(gw.response_body(b"}", end=True))
                    await call.read()
                    await call.done_writing()
                    assert await call.read() == grpc.aio.EOF
        assert app.servicer.active_streams == 1 or how == "error body whole"
        call.cancel()
        deadline = asyncio.get_running_loop().time() + 5
        while app.servicer.active_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
    assert app.servicer.active_streams == 0, how
    assert app.store.open_reservations == 0, how
    assert all(ep.inflight == 0 for ep in app.store.all()), how
    assert await inflight_now() == 0, how


async def test_a_failure_after_the_reservation_in_route_still_releases_everything(make_app, monkeypatch):
    """`ExtProcServicer._route` reserves (KV, in-flight), then keeps working (`with_model` for
    an alias, metrics, headers) before its Decision reaches a `_Stream`: a raise there must
    release the reservation and give the rate-limit charge back. Fault injected in
    `with_model` (the alias rewrite)."""
    import extproc.server.extproc as servicer_module

    calls: list[str] = []

    def broken(body: bytes, model: str) -> bytes:
        calls.append(model)
        raise ValueError("injected")

    monkeypatch.setattr(servicer_module, "with_model", broken)
    app = await make_app(ratelimit=CAPPED)
    lim = app.ratelimit
    t = lim.tenant({"authorization": AUTH["authorization"].decode()})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        call = stub.Process()
        await call.write(headers_msg("POST", "/v1/chat/completions", extra=AUTH))
        await call.read()
        await call.write(body_msg(chat_body(max_tokens=20, model="qwen3-8b")))
        reply = await call.read()
        assert calls == ["Qwen/Qwen3-8B"], "the fault was not injected: the test proves nothing"
        assert reply.HasField("immediate_response") and reply.immediate_response.status.code == 500, reply
        call.cancel()
        deadline = asyncio.get_running_loop().time() + 5
        while app.servicer.active_streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
    assert app.servicer.active_streams == 0
    assert app.store.open_reservations == 0, "KV reservation leaked"
    assert (await lim.backend.peek(lim.scopes(t, "Qwen/Qwen3-8B"))).uses[0].inflight == 0, "concurrency slot leaked"
