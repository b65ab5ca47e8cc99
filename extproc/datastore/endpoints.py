"""The endpoint datastore: what the scheduler knows about each inference endpoint.

State per endpoint (all mutated on the event loop thread only):

* health, from active probes (`health.py`);
* in-flight requests counted by this server: +1 when a request is routed there, −1 on every
  way its ext_proc stream ends (the reservation object makes release idempotent).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from extproc.config.schema import EndpointConfig
from extproc.types import EndpointAddress

__all__ = ["Endpoint", "Datastore", "Reservation"]


@dataclass(slots=True, eq=False)
class Endpoint:
    """One endpoint and its live state.

    Attributes:
        address: `ip:port`.
        models: canonical model names served.
        labels: configured labels.
        healthy: result of the latest probes (True until probed otherwise when probing is off).
        inflight: requests routed here and not yet ended (count).
        consecutive_failures / consecutive_successes: probe streaks.
        probed: whether any probe has completed.
    """

    address: EndpointAddress
    models: frozenset[str]
    labels: dict[str, str] = field(default_factory=dict)
    healthy: bool = True
    inflight: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_probe_error: str | None = None
    probed: bool = False
    engine: Any = None
    """Latest scraped engine metrics (`extproc.datastore.scraper.EngineMetrics`), or None."""
    node: Any = None
    """Latest node-agent report (`extproc.datastore.agent_client.NodeReport`), or None."""
    stream_stats: Any = None
    """Response-path latency statistics (`extproc.telemetry.stats.EndpointStreamStats`), or None."""


class Reservation:
    """A request's claim on an endpoint; `release()` is idempotent."""

    __slots__ = ("endpoint", "_store", "_released")

    def __init__(self, store: Datastore, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._store = store
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Return the in-flight slot; safe to call more than once."""
        if not self._released:
            self._released = True
            self._store._release(self)


class Datastore:
    """Endpoints by address and by model; in-flight accounting.

    Args:
        endpoints: endpoint configurations.
        on_change: optional callback(endpoint) after an endpoint's in-flight count changes
            (metrics hook).
    """

    def __init__(self, endpoints: Iterable[EndpointConfig], *, on_change=None) -> None:
        self._by_addr: dict[str, Endpoint] = {}
        self._by_model: dict[str, list[Endpoint]] = {}
        for cfg in endpoints:
            ep = Endpoint(EndpointAddress(cfg.address), frozenset(cfg.models), dict(cfg.labels))
            self._by_addr[ep.address] = ep
            for m in cfg.models:
                self._by_model.setdefault(m, []).append(ep)
        self._on_change = on_change
        self._open: set[Reservation] = set()

    def all(self) -> list[Endpoint]:
        """Every endpoint, in configuration order."""
        return list(self._by_addr.values())

    def get(self, address: str) -> Endpoint | None:
        return self._by_addr.get(address)

    def for_model(self, model: str) -> list[Endpoint]:
        """Endpoints serving a canonical model name (healthy or not)."""
        return self._by_model.get(model, [])

    def reserve(self, endpoint: Endpoint) -> Reservation:
        """Count a request in flight on `endpoint`; release the returned reservation when it ends."""
        endpoint.inflight += 1
        r = Reservation(self, endpoint)
        self._open.add(r)
        if self._on_change is not None:
            self._on_change(endpoint)
        return r

    def _release(self, r: Reservation) -> None:
        self._open.discard(r)
        r.endpoint.inflight -= 1
        if self._on_change is not None:
            self._on_change(r.endpoint)

    @property
    def open_reservations(self) -> int:
        """Reservations not yet released (count): 0 when no request is in flight."""
        return len(self._open)
