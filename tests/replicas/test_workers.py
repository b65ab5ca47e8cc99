"""`serve --workers N`: each worker's ports, and the refusals that would otherwise surface as a
worker failing to bind."""

from __future__ import annotations

import pytest

from extproc.config.loader import config_from_mapping
from extproc.replicas.workers import worker_addresses


def cfg(grpc: str, admin: str):
    return config_from_mapping({"listen": {"grpc": grpc, "admin": admin}, "models": [{"name": "m"}], "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"]}]})


def test_worker_i_listens_on_the_configured_ports_plus_i():
    got = worker_addresses(cfg("0.0.0.0:9002", "[::1]:9090"), 3)
    assert [(w.grpc, w.admin) for w in got] == [("0.0.0.0:9002", "[::1]:9090"), ("0.0.0.0:9003", "[::1]:9091"), ("0.0.0.0:9004", "[::1]:9092")]


@pytest.mark.parametrize(
    ("grpc", "admin", "workers", "message"),
    [
        ("127.0.0.1:0", "127.0.0.1:9090", 2, "fixed listen.grpc"),
        ("127.0.0.1:9002", "127.0.0.1:9003", 2, "overlap"),
        ("127.0.0.1:65535", "127.0.0.1:9090", 2, "65535"),
        ("127.0.0.1:9002", "127.0.0.1:9090", 0, "at least 1"),
    ],
)
def test_impossible_port_layouts_are_refused_with_the_reason(grpc, admin, workers, message):
    with pytest.raises(ValueError, match=message):
        worker_addresses(cfg(grpc, admin), workers)


def test_one_worker_may_keep_port_zero():
    assert worker_addresses(cfg("127.0.0.1:0", "127.0.0.1:0"), 1)[0].grpc == "127.0.0.1:0"
