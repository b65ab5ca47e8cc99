"""The DNS source: a name's A and AAAA records (a Kubernetes headless service lists one record
per ready pod), re-resolved every `interval_s`, each address on the configured port, serving
the configured models with the configured labels.

Answers: records → those endpoints; NXDOMAIN or no record of either type → none (the service
scaled to zero: every endpoint drains). Any other failure — a timeout, SERVFAIL or refusal from
every server, YXDOMAIN, or another dnspython error — says nothing about the fleet: the last answer
stays and the failure is logged (once per outage).
Resolution uses dnspython's asyncio resolver, with no cache: every period asks the server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Literal

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver
import pydantic

from extproc.config.schema import parse_host_port
from extproc.discovery.base import Discovered, DiscoverySource, EndpointTemplate, Publish, SourceContext

__all__ = ["Params", "Source", "ResolverDown"]

log = logging.getLogger(__name__)


class Params(EndpointTemplate):
    """`{type: dns}` parameters (with `port`, `models`, `labels`, `kv_events`,
    `kv_events_replay`, `agent` of `EndpointTemplate`).

    Attributes:
        name: the name to resolve (e.g. `vllm.inference.svc.cluster.local`, a headless service).
        interval_s: re-resolve period (seconds).
        timeout_s: one resolution's time limit, retries included (seconds).
        nameservers: `ip` or `ip:port` of the servers to ask (port 53 by default); empty: the
            system's (`/etc/resolv.conf`).
        record_types: which records to ask for.
    """

    type: Literal["dns"] = "dns"
    name: str = pydantic.Field(min_length=1)
    interval_s: float = pydantic.Field(default=5.0, gt=0)
    timeout_s: float = pydantic.Field(default=2.0, gt=0)
    nameservers: list[str] = pydantic.Field(default_factory=list)
    record_types: list[Literal["A", "AAAA"]] = pydantic.Field(default_factory=lambda: ["A", "AAAA"], min_length=1)

    @pydantic.field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        try:
            dns.name.from_text(v)
        except dns.exception.DNSException as exc:
            raise ValueError(f"{v!r} is not a DNS name: {exc}") from None
        return v

    @pydantic.field_validator("nameservers")
    @classmethod
    def _servers(cls, v: list[str]) -> list[str]:
        for s in v:
            _split_server(s)
        return v


def _split_server(value: str) -> tuple[str, int]:
    """`ip` / `ip:port` / `[ipv6]:port` → (ip, port).

    Raises:
        ValueError: not an IP literal, or a port outside 1..65535.
    """
    bare = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        return str(ipaddress.ip_address(bare)), 53
    except ValueError:
        pass
    try:
        host, port = parse_host_port(value)
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"a nameserver is an IP address with an optional port, got {value!r}") from None
    if port == 0:
        raise ValueError(f"nameserver port out of range in {value!r}")
    return host, port


class ResolverDown(Exception):
    """No usable answer (timeout, SERVFAIL, refused, YXDOMAIN, another resolver error): the
    fleet is unknown, not empty."""


class Source(DiscoverySource):
    """Resolves `params.name` every `params.interval_s` and publishes the addresses found.

    Args:
        params: `Params`.
        ctx: unused (the source needs nothing from the running configuration).
    """

    def __init__(self, params: Params, ctx: SourceContext | None = None) -> None:
        self._params = params
        self.name = f"dns:{params.name}"
        self._resolver = dns.asyncresolver.Resolver(configure=not params.nameservers)
        if params.nameservers:
            self._resolver.nameservers = [dns.nameserver.Do53Nameserver(*_split_server(s)) for s in params.nameservers]
        self._resolver.cache = None
        self.resolutions = 0
        """Successful resolutions (count)."""
        self.failures = 0
        """Resolutions that got no answer (count)."""
        self._by_type: dict[str, list[str]] = {}  # each record type's last answer
        self._failing: set[str] = set()  # types whose last ask failed (warned once)

    async def resolve(self) -> list[str]:
        """The name's addresses now, sorted (empty: NXDOMAIN or no records).

        Each record type is asked on its own. One that fails while another answers keeps its
        own last answer (none yet: no addresses of that type): a server that refuses AAAA but
        answers A (dnsmasq without `--local`, some resolvers) must not cost the A records.

        Raises:
            ResolverDown: no type got a usable answer (any dnspython error but NXDOMAIN and
                NoAnswer, or a socket error, for every type).
        """
        found: dict[str, list[str]] = {}
        errors: dict[str, str] = {}
        for rtype in self._params.record_types:
            try:
                answer = await self._resolver.resolve(self._params.name, rtype, lifetime=self._params.timeout_s, search=False)
            except dns.resolver.NXDOMAIN:
                self._by_type.clear()
                return []
            except dns.resolver.NoAnswer:
                found[rtype] = []
                continue
            except (dns.exception.DNSException, OSError) as exc:  # NoNameservers, Timeout, YXDOMAIN, ...
                errors[rtype] = f"{type(exc).__name__}: {exc}"
                continue
            found[rtype] = [r.address for r in answer if r.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)]
        if not found:
            raise ResolverDown("; ".join(f"{t}: {e}" for t, e in errors.items()))
        for rtype, error in errors.items():
            if rtype not in self._failing:
                log.warning("%s: %s records not answered (%s); the other types' answers are used", self.name, rtype, error)
        self._failing = set(errors)
        self._by_type.update(found)
        addresses = {a for t in self._params.record_types for a in self._by_type.get(t, ())}
        return sorted(addresses, key=lambda a: ipaddress.ip_address(a).packed)

    async def run(self, publish: Publish) -> None:
        down = False
        last: list[str] | None = None
        while True:
            try:
                ips = await self.resolve()
            except ResolverDown as exc:
                self.failures += 1
                if not down:
                    log.warning("%s: no answer (%s); keeping the endpoints last resolved (%d)", self.name, exc, len(last or []))
                down = True
            else:
                self.resolutions += 1
                if down:
                    log.info("%s: answering again", self.name)
                down = False
                if ips != last:
                    log.info("%s: %d addresses", self.name, len(ips))
                    last = ips
                    publish({e.address: Discovered(e) for e in (self._params.endpoint(ip) for ip in ips)})
            await asyncio.sleep(self._params.interval_s)
