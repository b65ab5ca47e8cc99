"""P/D disaggregation on the ext_proc wire: the decode endpoint is the destination, the prefill
endpoint goes in `x-prefiller-host-port`, a client's copy of that header is removed on every
path, and both endpoints' reservations end with the stream."""

from __future__ import annotations

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.server.responses import OWNED_HEADERS, PREFILLER_HEADER
from tests.server.test_contract import MODEL, body_msg, exchange, headers_msg, set_headers

PREFILL, DECODE = "127.0.0.1:18001", "127.0.0.1:18002"
ROLES = [{"address": PREFILL, "models": [MODEL], "role": "prefill"}, {"address": DECODE, "models": [MODEL], "labels": {"llm-d.ai/role": "decode"}}]
FORGED = {PREFILLER_HEADER: b"169.254.169.254:80"}


@pytest.fixture
async def stub_for():
    """Factory: a stub on a started app's gRPC port; channels closed after the test."""
    channels: list[grpc.aio.Channel] = []

    async def factory(app) -> pb_grpc.ExternalProcessorStub:
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}"))
        return pb_grpc.ExternalProcessorStub(channels[-1])

    yield factory
    for ch in channels:
        await ch.close()


def chat(words: int) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(words))}], "max_tokens": 8})


def decided(app, reason: str) -> float:
    decision = "prefill-decode" if reason == "long_prompt" else "decode-only"
    return app.metrics.registry.get_sample_value("llm_extproc_disagg_decision_total", {"decision": decision, "reason": reason}) or 0.0


async def test_a_long_prompt_names_its_prefill_endpoint_and_a_short_one_does_not(make_app, stub_for):
    app = await make_app(endpoints=ROLES)
    stub = await stub_for(app)
    r_headers, r_body = await exchange(stub, headers_msg("POST", "/v1/chat/completions", extra=FORGED), body_msg(chat(800)))
    # The client's header is removed as soon as the headers arrive...
    assert PREFILLER_HEADER in r_headers.request_headers.response.header_mutation.remove_headers
    assert r_body.WhichOneof("response") == "request_body", r_body
    hdrs = set_headers(r_body.request_body.response)
    # ...and the decision's own value overwrites whatever might be left.
    assert hdrs["x-gateway-destination-endpoint"] == DECODE and hdrs[PREFILLER_HEADER] == PREFILL
    assert decided(app, "long_prompt") == 1

    _, r_body = await exchange(stub, headers_msg("POST", "/v1/chat/completions", extra=FORGED), body_msg(chat(20)))
    common = r_body.request_body.response
    assert set_headers(common)["x-gateway-destination-endpoint"] == DECODE and PREFILLER_HEADER not in set_headers(common)
    # A short prompt's route removes the header: a forged one never reaches the decode sidecar.
    assert list(common.header_mutation.remove_headers) == [PREFILLER_HEADER]
    assert decided(app, "short_prompt") == 1
    # Both streams ended: nothing held on either endpoint.
    for address in (PREFILL, DECODE):
        ep = app.store.get(address)
        assert (ep.inflight, ep.prefill_inflight, ep.reserved_blocks, ep.prefill_tokens) == (0, 0, 0, 0), address


async def test_passthrough_requests_never_carry_a_client_prefiller_header(make_app, stub_for):
    app = await make_app(endpoints=ROLES)
    stub = await stub_for(app)
    (reply,) = await exchange(stub, headers_msg("GET", "/v1/models", end=True, extra=FORGED))
    common = reply.request_headers.response
    assert PREFILLER_HEADER in common.header_mutation.remove_headers and PREFILLER_HEADER not in set_headers(common)
    assert PREFILLER_HEADER in OWNED_HEADERS


async def test_a_unified_fleet_is_routed_as_before(make_app, stub_for):
    app = await make_app()  # two endpoints, role both
    stub = await stub_for(app)
    _, r_body = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat(800)))
    assert PREFILLER_HEADER not in set_headers(r_body.request_body.response)
    assert decided(app, "long_prompt") == 0 and decided(app, "short_prompt") == 0
