"""The discovery source interface."""

from __future__ import annotations

import abc
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pydantic

from extproc.config_base import Strict

if TYPE_CHECKING:
    from extproc.config.schema import Config, EndpointConfig

__all__ = ["Discovered", "DiscoverySource", "EndpointTemplate", "Publish", "SourceContext", "SOCKET_FIELDS", "render_socket"]


@dataclass(frozen=True, slots=True)
class Discovered:
    """One endpoint a source sees.

    Attributes:
        config: the endpoint as the datastore takes it (address `ip:port`, models, labels).
        ready: False for an endpoint its source lists but that must take no new requests (a
            Kubernetes endpoint not ready, or terminating): drained like one that left.
    """

    config: EndpointConfig
    ready: bool = True


Publish = Callable[[Mapping[str, Discovered]], None]
"""A source's report: every endpoint it sees now, by address (replaces its previous report)."""


@dataclass(frozen=True, slots=True)
class SourceContext:
    """What a source may need besides its own parameters.

    Attributes:
        config: the running configuration.
        config_path: the file it was loaded from, or None (embedded defaults, tests).
    """

    config: Config
    config_path: Path | None = None


class DiscoverySource(abc.ABC):
    """A discovery source. `run()` publishes the endpoints it sees, first as soon as it knows
    them, then on every change; it runs until cancelled and never raises (a source that cannot
    reach its backend keeps quiet, and the endpoints it published last stay)."""

    name: str = "source"

    @abc.abstractmethod
    async def run(self, publish: Publish) -> None:
        """Publish endpoint sets until cancelled."""


_PROBE_HOSTS = ("192.0.2.1", "[2001:db8::1]")
"""Documentation addresses (RFC 5737, RFC 3849) a socket template is rendered with at load, so
what it renders to is checked as a listed endpoint's value is."""


_ZMQ_TEMPLATE = re.compile(r"tcp://\{host\}:[0-9]{1,5}")
_AGENT_TEMPLATE = re.compile(r"\{host\}:[0-9]{1,5}")


def _check_socket_template(field: str, template: str) -> None:
    """Check a per-endpoint socket template (`kv_events`, `kv_events_replay`, `agent`).

    The only placeholder is `{host}`, required (without it every discovered endpoint would get
    the same socket); `{{` / `}}` are literal braces.

    Raises:
        ValueError: a malformed or unknown placeholder, a missing `{host}`, a template that is
            not exactly `tcp://{host}:PORT` (`kv_events*`) or `{host}:PORT` (`agent`), or a
            rendering that is not a valid value of that field or not on the address itself
            (the message names the field).
    """
    try:
        names = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{field} template {template!r} is malformed ({exc}); write a literal brace as {{{{ or }}}}") from None
    for name, conv, spec in names:
        if name != "host" or conv or spec:
            shown = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"{field} template {template!r} has the unknown placeholder {shown}; the only one is {{host}}")
    if not names:
        raise ValueError(f"{field} template {template!r} has no {{host}}: every discovered endpoint would get the same socket")
    if field == "agent":
        if "://" in template:
            raise ValueError(f"agent template {template!r} is host:port, without a scheme (e.g. '{{host}}:9100')")
    elif not template.startswith("tcp://"):
        raise ValueError(f"{field} template {template!r} must start with tcp:// (a ZMQ TCP socket, e.g. 'tcp://{{host}}:5557')")
    from extproc.config.schema import EndpointConfig

    for host in _PROBE_HOSTS:
        rendered = render_socket(template, host)
        extra = {"kv_events": "tcp://192.0.2.1:1"} if field == "kv_events_replay" else {}
        try:
            EndpointConfig(address="192.0.2.1:1", models=["m"], **extra, **{field: rendered})
        except pydantic.ValidationError as exc:
            why = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors(include_url=False))
            raise ValueError(f"{field} template {template!r} renders to {rendered!r}, which is not valid: {why}") from None
    # Exactly the discovered address and a port: anything around {host} could make it a DNS
    # name ({host}.evil.example), a second host ({host}@evil, ...,evil:1), a ZMQ source
    # interface (eth0;{host}) or a gRPC target scheme (ipv4:..., unix:...).
    shape = _AGENT_TEMPLATE if field == "agent" else _ZMQ_TEMPLATE
    if shape.fullmatch(template) is None:
        example = "{host}:9100" if field == "agent" else "tcp://{host}:5557"
        raise ValueError(f"{field} template {template!r} must be exactly like {example!r}: {{host}} becomes the discovered address, nothing may surround it")
    for host in _PROBE_HOSTS:
        rendered = render_socket(template, host)
        if rendered.removeprefix("tcp://").rsplit(":", 1)[0] != host:  # the shape admits nothing else; kept as the rule
            raise ValueError(f"{field} template {template!r} renders to {rendered!r}, not to the address {host}")


SOCKET_FIELDS = ("kv_events", "kv_events_replay", "agent")
"""The per-endpoint sockets a template (or a Pod annotation) gives a discovered endpoint."""


def render_socket(template: str, host: str) -> str:
    """`template` with `{host}` replaced by `host` (already bracketed if IPv6)."""
    return template.format(host=host)


class EndpointTemplate(Strict):
    """What a discovered address becomes: the port to reach it on, what it serves, and the
    sockets beside it.

    Attributes:
        port: the engine's HTTP port on each discovered address (1..65535).
        models: canonical model names every discovered endpoint serves (configured models).
        labels: labels every discovered endpoint gets (engine profile, gpu, zone, ...), read
            by label filters as those of a listed endpoint.
        kv_events: the engine's KV-event publisher as a template of the discovered address,
            `tcp://{host}:5557` (vLLM `--kv-events-config` `endpoint` `tcp://*:5557`); `{host}`
            becomes the address (`[...]` for IPv6). None: no subscription.
        kv_events_replay: the engine's replay socket, same form (`tcp://{host}:5558`); needs
            `kv_events`.
        agent: the node agent, `{host}:9100` (a sidecar or a host-network agent on the same
            address); None: no agent.
    """

    port: int = pydantic.Field(ge=1, le=65535)
    models: list[str] = pydantic.Field(min_length=1)
    labels: dict[str, str] = pydantic.Field(default_factory=dict)
    kv_events: str | None = None
    kv_events_replay: str | None = None
    agent: str | None = None

    @pydantic.field_validator("kv_events", "kv_events_replay", "agent")
    @classmethod
    def _socket_template(cls, v: str | None, info: pydantic.ValidationInfo) -> str | None:
        if v is not None:
            _check_socket_template(str(info.field_name), v)
        return v

    @pydantic.model_validator(mode="after")
    def _replay_needs_events(self) -> EndpointTemplate:
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events")
        return self

    def endpoint(
        self, ip: str, port: int | None = None, labels: Mapping[str, str] | None = None, socket_ports: Mapping[str, int] | None = None
    ) -> EndpointConfig:
        """The endpoint at `ip` (IPv4 or IPv6 literal) on `port` (default `self.port`), with
        `labels` over the template's and the template's sockets rendered for `ip`.

        Args:
            socket_ports: per-endpoint port overrides, field (`kv_events`, `kv_events_replay`,
                `agent`) → port 1..65535 (a Pod's annotations): that socket becomes
                `tcp://ip:port` (`ip:port` for `agent`), on `ip` always. A replay socket left
                without `kv_events` is dropped.

        Raises:
            ValueError: `ip` is not an IP literal.
        """
        from extproc.config.schema import EndpointConfig

        host = f"[{ip}]" if ":" in ip else ip
        sockets = {
            name: render_socket(template, host)
            for name in SOCKET_FIELDS
            if (template := getattr(self, name)) is not None
        }
        for name, p in (socket_ports or {}).items():
            sockets[name] = f"{host}:{p}" if name == "agent" else f"tcp://{host}:{p}"
        if "kv_events" not in sockets:
            sockets.pop("kv_events_replay", None)
        return EndpointConfig(
            address=f"{host}:{port or self.port}", models=list(self.models), labels={**self.labels, **(labels or {})}, **sockets
        )
