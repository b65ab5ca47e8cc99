"""Throwaway certificates for the TLS tests: a CA, a server certificate, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Certs", "make_certs"]


@dataclass(frozen=True, slots=True)
class Certs:
    """PEM file paths: `ca`; `server`/`server_key` (SAN DNS `llm-extproc`, IP 127.0.0.1);
    `client`/`client_key` (signed by `ca`); `stranger`/`stranger_key` (a client certificate
    signed by another CA)."""

    ca: Path
    server: Path
    server_key: Path
    client: Path
    client_key: Path
    stranger: Path
    stranger_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return path


def _issue(subject: str, key, issuer: str, issuer_key, *, ca: bool, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        sans = [x509.DNSName("llm-extproc"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path) -> Certs:
    """Write a fresh CA, server and client certificates (EC P-256, valid one day) under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM

    def write(cert: x509.Certificate, name: str) -> Path:
        path = directory / name
        path.write_bytes(cert.public_bytes(pem))
        return path

    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in ("server", "client", "stranger")}
    return Certs(
        ca=write(_issue("test-ca", ca_key, "test-ca", ca_key, ca=True), "ca.pem"),
        server=write(_issue("llm-extproc", keys["server"], "test-ca", ca_key, ca=False, server=True), "server.pem"),
        server_key=_write_key(keys["server"], directory / "server-key.pem"),
        client=write(_issue("envoy", keys["client"], "test-ca", ca_key, ca=False), "client.pem"),
        client_key=_write_key(keys["client"], directory / "client-key.pem"),
        stranger=write(_issue("stranger", keys["stranger"], "other-ca", other_ca_key, ca=False), "stranger.pem"),
        stranger_key=_write_key(keys["stranger"], directory / "stranger-key.pem"),
    )
