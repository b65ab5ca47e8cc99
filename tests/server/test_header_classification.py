"""The request-headers classification both servicers share (`ExtProcServicer._classify_headers`):
the same headers get the same verdict in BUFFERED and in Endpoint Picker Protocol mode — a
generation request without a body is a 400, a generation path with another method a 405, and
any other request goes straight to a listed endpoint, counted as passthrough."""

from __future__ import annotations

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.server.test_contract import ENDPOINTS, error_of, headers_msg, set_headers

CHAT = "/v1/chat/completions"


def passthroughs(app) -> float:
    return app.metrics.registry.get_sample_value("llm_extproc_requests_total", {"outcome": "passthrough", "reason": "ok"}) or 0.0


@pytest.mark.parametrize("mode", ["buffered", "epp"])
async def test_both_servicers_classify_request_headers_alike(make_app, mode):
    app = await make_app(protocol={"mode": mode})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for method, end, status, code in (("POST", True, 400, None), ("GET", True, 405, "method_not_allowed"), ("PUT", False, 405, "method_not_allowed")):
            call = stub.Process()
            await call.write(headers_msg(method, CHAT, end=end))
            got, body, _ = error_of(await call.read())
            assert got == status, (method, end)
            assert code is None or body["error"]["code"] == code
            call.cancel()
        before = passthroughs(app)
        call = stub.Process()
        await call.write(headers_msg("GET", "/v1/models", end=True))
        reply = await call.read()
        assert reply.WhichOneof("response") == "request_headers"
        assert set_headers(reply.request_headers.response)["x-gateway-destination-endpoint"] in ENDPOINTS
        assert passthroughs(app) == before + 1
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
