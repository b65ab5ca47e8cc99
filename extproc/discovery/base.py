"""The discovery source interface."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pydantic

from extproc.config_base import Strict

if TYPE_CHECKING:
    from extproc.config.schema import Config, EndpointConfig

__all__ = ["Discovered", "DiscoverySource", "EndpointTemplate", "Publish", "SourceContext"]


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


class EndpointTemplate(Strict):
    """What a discovered address becomes: the port to reach it on and what it serves.

    Attributes:
        port: the engine's HTTP port on each discovered address (1..65535).
        models: canonical model names every discovered endpoint serves (configured models).
        labels: labels every discovered endpoint gets (engine profile, gpu, zone, ...), read
            by label filters as those of a listed endpoint.
    """

    port: int = pydantic.Field(ge=1, le=65535)
    models: list[str] = pydantic.Field(min_length=1)
    labels: dict[str, str] = pydantic.Field(default_factory=dict)

    def endpoint(self, ip: str, port: int | None = None, labels: Mapping[str, str] | None = None) -> EndpointConfig:
        """The endpoint at `ip` (IPv4 or IPv6 literal) on `port` (default `self.port`), with
        `labels` over the template's.

        Raises:
            ValueError: `ip` is not an IP literal.
        """
        from extproc.config.schema import EndpointConfig

        host = f"[{ip}]" if ":" in ip else ip
        return EndpointConfig(address=f"{host}:{port or self.port}", models=list(self.models), labels={**self.labels, **(labels or {})})
