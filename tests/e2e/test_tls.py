"""Envoy ↔ llm-extproc over mTLS (issue 18.4), with certificates the test makes: Envoy with the
shipped transport socket and a client certificate from the CA gets decisions; Envoy without
TLS, or with another CA's certificate, gets none (fail-closed: our 503)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from extproc.stack.envoy import EnvoyProcess, ExtProcTLS, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.certs import Certs, make_certs
from tests.e2e.e2e_helpers import MODEL, Engines, assert_openai_error, chat, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def certs(workdir: Path) -> Certs:
    return make_certs(workdir / "certs")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tls_server(workdir: Path, engines: Engines, certs: Certs) -> AsyncIterator[ExtProcServerProcess]:
    config = {
        "listen": {"grpc_tls": {"cert_file": str(certs.server), "key_file": str(certs.server_key), "client_ca_file": str(certs.ca)}},
        "models": [{"name": MODEL, "aliases": ["qwen3-8b"]}],
        "endpoints": [{"address": e.address, "models": [MODEL]} for e in engines.serving],
    }
    server = await start_server(workdir, config, "tls-server")
    try:
        yield server
    finally:
        await server.aclose()


async def _through(workdir: Path, server: ExtProcServerProcess, label: str, tls: ExtProcTLS | None) -> httpx.Response:
    cfg = rewrite_config(load_envoy_config("fail-closed"), RunSettings(extproc=server.grpc_address, extproc_tls=tls))
    envoy = EnvoyProcess(cfg, workdir=workdir, name=f"envoy-tls-{label}")
    await envoy.start()
    try:
        async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=30) as c:
            return await c.post("/v1/chat/completions", json=chat(max_tokens=4))
    finally:
        await envoy.aclose()


async def test_envoy_with_a_client_certificate_gets_decisions(workdir, tls_server, certs):
    tls = ExtProcTLS(ca_file=str(certs.ca), cert_file=str(certs.client), key_file=str(certs.client_key))
    r = await _through(workdir, tls_server, "mtls", tls)
    assert r.status_code == 200, r.text
    assert r.headers["x-backend"] in ("a", "b")


@pytest.mark.parametrize("variant", ["plaintext", "no-client-cert", "stranger-cert"])
async def test_envoy_without_an_accepted_certificate_gets_none(workdir, tls_server, certs, variant):
    tls = {
        "plaintext": None,
        "no-client-cert": ExtProcTLS(ca_file=str(certs.ca)),
        "stranger-cert": ExtProcTLS(ca_file=str(certs.ca), cert_file=str(certs.stranger), key_file=str(certs.stranger_key)),
    }[variant]
    r = await _through(workdir, tls_server, variant, tls)
    assert_openai_error(r, 503)
