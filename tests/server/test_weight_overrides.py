"""Operator weight overrides through the admin server: authentication, the Alertmanager webhook,
routing that follows a drain or a lowered weight, `/api/v1/weights` and metrics, expiry."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import httpx
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.server.overrides_api import TOKEN_ENV, TOKEN_FILE_ENV, load_admin_token
from tests.ratelimit.conftest import redis_server  # noqa: F401 - a real redis-server per test
from tests.server.conftest import ENDPOINTS, MODEL
from tests.server.test_contract import body_msg, exchange, headers_msg, set_headers

TOKEN = "s3cret-override-token"
A, B = ENDPOINTS


async def _route(stub) -> str:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    _, r_body = await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(body))
    return set_headers(r_body.request_body.response)["x-gateway-destination-endpoint"]


async def _post(app, path: str, body, token: str | None = TOKEN) -> httpx.Response:
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient() as c:
        return await c.post(f"http://127.0.0.1:{app.admin_port}{path}", json=body, headers=headers)


async def _weights(app) -> dict[str, dict]:
    async with httpx.AsyncClient() as c:
        rows = (await c.get(f"http://127.0.0.1:{app.admin_port}/api/v1/weights")).json()["endpoints"]
    return {r["address"]: r for r in rows}


@pytest.fixture
async def authed_app(make_app, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return await make_app()


@pytest.fixture
async def stub(authed_app):
    """The ext_proc stub of `authed_app` (the shared `stub` fixture talks to another app)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{authed_app.grpc_port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)


async def test_without_a_configured_token_every_write_is_refused(make_app, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    app = await make_app()
    for path in ("/api/v1/weights/override", "/api/v1/alerts"):
        r = await _post(app, path, {"endpoint": A, "action": "drain"}, token="anything")
        assert r.status_code == 403
    assert app.store.get(A).override is None


async def test_missing_or_wrong_token_is_401_and_changes_nothing(authed_app):
    for token in (None, "wrong", TOKEN + "x", TOKEN[:-1]):
        r = await _post(authed_app, "/api/v1/weights/override", {"endpoint": A, "action": "drain"}, token=token)
        assert r.status_code == 401, token
        assert TOKEN not in r.text
    assert authed_app.store.get(A).override is None


async def test_drain_moves_all_traffic_and_shows_in_weights_and_metrics(authed_app, stub):
    r = await _post(authed_app, "/api/v1/weights/override", {"endpoint": A, "action": "drain", "duration_s": 60, "reason": "maintenance"})
    assert r.status_code == 200, r.text
    assert {await _route(stub) for _ in range(8)} == {B}
    rows = await _weights(authed_app)
    assert rows[A]["override"]["factor"] == 0.0 and rows[A]["override"]["reason"] == "maintenance"
    assert rows[A]["weight"] == 0.0 and rows[B]["weight"] > 0.0
    assert 55 < rows[A]["override"]["expires_in_s"] <= 60  # eight routes ran since: slack for a busy machine
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"http://127.0.0.1:{authed_app.admin_port}/metrics")).text
    assert f'llm_extproc_endpoint_weight_override_factor{{endpoint="{A}"}} 0.0' in text
    assert 'llm_extproc_weight_overrides_total{action="drain",source="api"} 1.0' in text
    assert f'llm_extproc_endpoint_score_component{{endpoint="{A}",scorer="weight-override-scorer"}} 0.0' in text
    assert f'llm_extproc_endpoint_score_component{{endpoint="{B}",scorer="weight-override-scorer"}} 1.0' in text
    # Both drained: a drain is a preference, the fleet keeps serving.
    await _post(authed_app, "/api/v1/weights/override", {"endpoint": B, "action": "drain"})
    assert await _route(stub) in ENDPOINTS
    # clear lifts it at once.
    await _post(authed_app, "/api/v1/weights/override", {"endpoint": B, "action": "clear"})
    assert {await _route(stub) for _ in range(4)} == {B}


async def test_lowered_weight_multiplies_the_score_and_expires_by_itself(authed_app, stub):
    before = (await _weights(authed_app))[A]["weight"]
    r = await _post(authed_app, "/api/v1/weights/override", {"endpoint": A, "factor": 0.01, "duration_s": 1.0})
    assert r.status_code == 200, r.text
    assert (await _weights(authed_app))[A]["weight"] == pytest.approx(before * 0.01, abs=1e-3)
    assert {await _route(stub) for _ in range(6)} == {B}
    await asyncio.sleep(1.1)
    rows = await _weights(authed_app)
    assert rows[A]["override"]["factor"] == 1.0 and rows[A]["weight"] == pytest.approx(before, abs=1e-3)
    assert A in {await _route(stub) for _ in range(12)}


async def test_alertmanager_payload_lowers_the_labelled_endpoint(authed_app):
    payload = {
        "version": "4", "status": "firing", "receiver": "llm-extproc",
        "alerts": [
            {"status": "firing", "labels": {"alertname": "LLMEndpointTTFTHigh", "endpoint": A, "weight_action": "lower"}, "annotations": {"weight_factor": "0.5", "weight_duration_s": "30"}},
            {"status": "firing", "labels": {"alertname": "LLMEndpointKVCacheWatermark", "endpoint": B, "weight_action": "drain"}, "annotations": {}},
            {"status": "resolved", "labels": {"alertname": "Old", "endpoint": B}},
            {"status": "firing", "labels": {"alertname": "Elsewhere", "endpoint": "10.9.9.9:1", "weight_action": "lower"}},
            {"status": "firing", "labels": {"alertname": "NoEndpoint", "weight_action": "drain"}},
            {"status": "firing", "labels": {"alertname": "NotifyOnly", "endpoint": A}},
        ],
    }  # fmt: skip
    r = await _post(authed_app, "/api/v1/alerts", payload)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(a["endpoint"], a["action"], a["factor"]) for a in body["applied"]] == [(A, "lower", 0.5), (B, "drain", 0.0)]
    assert len(body["skipped"]) == 4
    rows = await _weights(authed_app)
    assert rows[A]["override"]["source"] == "alertmanager" and rows[A]["override"]["reason"] == "LLMEndpointTTFTHigh"


@pytest.mark.parametrize(
    "body",
    [
        {"endpoint": "10.0.0.1:1", "action": "drain"},
        {"endpoint": A, "action": "boost"},
        {"endpoint": A, "factor": 1.5},
        {"endpoint": A, "factor": "abc"},
        {"endpoint": A, "action": "drain", "duration_s": 86400},
        {"endpoint": A, "action": "drain", "token": "x"},
        [1, 2],
    ],
)
async def test_bad_override_requests_are_400(authed_app, body):
    r = await _post(authed_app, "/api/v1/weights/override", body)
    assert r.status_code == 400, r.text
    assert authed_app.store.get(A).override is None


def test_token_from_file_wins_and_unreadable_file_is_a_clear_error(tmp_path):
    f = tmp_path / "token"
    f.write_text("  from-file\n")
    assert load_admin_token({TOKEN_FILE_ENV: str(f), TOKEN_ENV: "from-env"}) == "from-file"
    assert load_admin_token({TOKEN_ENV: "from-env"}) == "from-env"
    assert load_admin_token({}) is None
    with pytest.raises(ValueError, match=TOKEN_FILE_ENV):
        load_admin_token({TOKEN_FILE_ENV: str(tmp_path / "missing")})
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfehunter2")
    with pytest.raises(ValueError, match=f"^{TOKEN_FILE_ENV}: .* is not UTF-8 text$"):  # was the codec's message alone
        load_admin_token({TOKEN_FILE_ENV: str(binary)})


def test_serve_stops_with_a_clear_message_when_the_token_file_is_unreadable(tmp_path):
    env = {**os.environ, TOKEN_FILE_ENV: str(tmp_path / "missing")}
    done = subprocess.run([sys.executable, "-m", "extproc", "serve"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert TOKEN_FILE_ENV in done.stderr and "Traceback" not in done.stderr


async def test_with_replica_sync_an_override_posted_to_one_replica_applies_on_every_replica(make_app, monkeypatch, redis_server):
    """The admin Service sends the webhook to one pod: with `replicas.sync: redis` that replica
    passes the override on and the others drain (then clear) the endpoint too."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    shared = {
        "replicas": {"sync": "redis", "heartbeat_s": 0.2, "owner_timeout_s": 1.0, "flush_ms": 1},
        "ratelimit": {"redis": {"url": redis_server.url, "timeout_ms": 500}},
    }
    one, other = await make_app(**shared), await make_app(**shared)
    await _until(lambda: one.sync.connected and other.sync.connected)
    alerts = {"alerts": [{"status": "firing", "labels": {"alertname": "EngineSlow", "endpoint": A, "weight_action": "drain"}}]}
    r = await _post(one, "/api/v1/alerts", alerts)
    assert r.status_code == 200 and r.json()["applied"], r.text
    await _until(lambda: other.store.get(A).override is not None)
    row = (await _weights(other))[A]
    assert row["override"]["factor"] == 0.0 and row["override"]["source"] == "alertmanager" and row["override"]["reason"] == "EngineSlow"
    assert other.store.get(B).override is None
    r = await _post(other, "/api/v1/weights/override", {"endpoint": A, "action": "clear"})
    assert r.status_code == 200, r.text
    await _until(lambda: one.store.get(A).override is None)


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
