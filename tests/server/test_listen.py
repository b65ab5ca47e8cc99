"""Where the server listens (issue 18.3, 18.4): loopback by default, a warning for plaintext gRPC
on another interface, TLS and mTLS on the gRPC port, and SO_REUSEPORT so a replacement process
can bind beside one that still serves."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.config.loader import config_from_mapping
from extproc.config.schema import ListenConfig, is_loopback
from tests.e2e.certs import make_certs

from .conftest import make_config


def test_both_ports_default_to_loopback():
    listen = config_from_mapping({"models": [{"name": "m", "path": "builtin:qwen3-8b"}], "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}]}, env={}).listen
    assert (listen.grpc, listen.admin) == ("127.0.0.1:9002", "127.0.0.1:9090")
    assert listen.reuse_port and listen.grpc_tls is None


@pytest.mark.parametrize(("host", "expected"), [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("::", False), ("*", False), ("10.0.0.1", False), ("example.com", False)])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_tls_files_must_be_readable(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot read"):
        ListenConfig(grpc_tls={"cert_file": str(tmp_path / "nope.pem"), "key_file": str(tmp_path / "nope.pem")})


async def test_plaintext_grpc_off_loopback_is_a_warning(make_app, caplog):
    caplog.set_level(logging.WARNING, logger="extproc.server.app")
    await make_app(listen={"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"})
    assert not [r for r in caplog.records if "not loopback" in r.getMessage()]
    await make_app(listen={"grpc": "0.0.0.0:0", "admin": "127.0.0.1:0"})
    (warning,) = [r for r in caplog.records if "not loopback" in r.getMessage()]
    assert warning.levelno == logging.WARNING and "grpc_tls" in warning.getMessage()


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)).status


async def test_mtls_admits_only_clients_with_a_certificate_from_the_ca(make_app, tmp_path: Path, caplog):
    certs = make_certs(tmp_path)
    tls = {"cert_file": str(certs.server), "key_file": str(certs.server_key), "client_ca_file": str(certs.ca)}
    caplog.set_level(logging.WARNING, logger="extproc.server.app")
    app = await make_app(listen={"grpc": "0.0.0.0:0", "admin": "127.0.0.1:0", "grpc_tls": tls})
    assert not [r for r in caplog.records if "not loopback" in r.getMessage()]  # TLS: no warning
    target = f"127.0.0.1:{app.grpc_port}"
    override = [("grpc.ssl_target_name_override", "llm-extproc")]
    ca = certs.ca.read_bytes()
    with_cert = grpc.ssl_channel_credentials(ca, certs.client_key.read_bytes(), certs.client.read_bytes())
    async with grpc.aio.secure_channel(target, with_cert, options=override) as ch:
        assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
    refused = [
        grpc.ssl_channel_credentials(ca),  # TLS without a client certificate
        grpc.ssl_channel_credentials(ca, certs.stranger_key.read_bytes(), certs.stranger.read_bytes()),  # another CA's
    ]
    for creds in refused:
        async with grpc.aio.secure_channel(target, creds, options=override) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _health(ch)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(target) as ch:  # plaintext
        with pytest.raises(grpc.aio.AioRpcError):
            await _health(ch)


async def test_a_replacement_binds_both_ports_beside_a_serving_process(make_app, caplog):
    """SO_REUSEPORT (listen.reuse_port, the default): the new process gets ready before the old
    one is told to drain, and says it shares both ports (a typo for someone else's port would
    split that listener's connections silently); with it off, the second bind fails as before."""
    caplog.set_level(logging.WARNING, logger="extproc.server.app")
    old = await make_app()
    assert not [r for r in caplog.records if "already has a listener" in r.getMessage()]
    ports = {"grpc": f"127.0.0.1:{old.grpc_port}", "admin": f"127.0.0.1:{old.admin_port}"}
    new = await make_app(listen=ports)
    assert (new.grpc_port, new.admin_port) == (old.grpc_port, old.admin_port)
    shared = sorted(r.getMessage().split(" port ")[0] for r in caplog.records if "already has a listener" in r.getMessage())
    assert shared == ["admin", "gRPC"]
    with pytest.raises(RuntimeError, match="cannot listen"):
        await make_app(listen={**ports, "reuse_port": False})


def test_make_config_listens_on_loopback():
    assert is_loopback(make_config().listen.grpc.rpartition(":")[0])


def test_tls_files_must_be_a_pem_chain_its_key_and_a_ca(tmp_path: Path):
    # A readable file that is not PEM passed validation, then grpc refused it at bind and the
    # server said "cannot listen on 127.0.0.1:9002 (address in use or not available)".
    certs = make_certs(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = make_certs(other_dir)
    ok = {"cert_file": str(certs.server), "key_file": str(certs.server_key)}
    ListenConfig(grpc_tls={**ok, "client_ca_file": str(certs.ca)})
    for bad, what in (
        ({**ok, "cert_file": str(garbage)}, "cert_file"),
        ({**ok, "key_file": str(other.server_key)}, "cert_file"),  # a key of another certificate
        ({**ok, "client_ca_file": str(garbage)}, "client_ca_file"),
    ):
        with pytest.raises(ValueError, match=what):
            ListenConfig(grpc_tls=bad)


async def test_a_wildcard_listen_address_sees_an_ipv4_listener_from_either_family():
    """`[::]` binds dual-stack beside an IPv4 `0.0.0.0` listener with SO_REUSEPORT: probing only
    ::1 missed it, the split the start-up warning is there to catch."""
    from extproc.aio import listener_at
    import socket

    sock = socket.socket()
    sock.bind(("0.0.0.0", 0))
    sock.listen()
    try:
        port = sock.getsockname()[1]
        assert await listener_at("::", port) and await listener_at("0.0.0.0", port)
    finally:
        sock.close()
    assert not await listener_at("::", port)
