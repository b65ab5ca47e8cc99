"""Fixtures for the telemetry tests: a fresh registry, stats on a fixed clock, an observer factory."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from extproc.telemetry.metrics import TelemetryMetrics
from extproc.telemetry.observer import ObserverOptions, StreamObserver
from extproc.telemetry.stats import EndpointStreamStats, StreamStatsParams
from tests.telemetry.telemetry_helpers import ENDPOINT, MODEL, START, WALL


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry) -> TelemetryMetrics:
    return TelemetryMetrics(registry)


@pytest.fixture
def stats() -> EndpointStreamStats:
    return EndpointStreamStats(StreamStatsParams(snapshot_ttl_s=0), clock_ns=lambda: START)


@pytest.fixture
def make_observer(stats, metrics):
    """`make_observer(markers=False, route_weight=None, **kw)` → a StreamObserver on fixed clocks."""

    def make(*, markers: bool = False, route_weight: float | None = None, **kw) -> StreamObserver:
        return StreamObserver(
            endpoint=ENDPOINT,
            model=MODEL,
            request_start_ns=START,
            stats=kw.pop("stats", stats),
            metrics=kw.pop("metrics", metrics),
            options=kw.pop("options", ObserverOptions(markers=markers)),
            route_weight=route_weight,
            clock_ns=lambda: START,
            wall_clock_ns=lambda: WALL,
            **kw,
        )

    return make
