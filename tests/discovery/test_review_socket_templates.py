"""Adversarial review: a discovered endpoint's socket templates must put the router on the
discovered address itself (docs/discovery.md: "{host} becomes the address"), never on a name a
DNS answer resolves, nor on a second host or a ZMQ source-interface spec."""

from __future__ import annotations

import pydantic
import pytest

from extproc.discovery.base import EndpointTemplate


@pytest.mark.parametrize(
    ("field", "template"),
    [
        ("kv_events", "tcp://{host}.evil.example:5557"),  # renders 10.1.2.3.evil.example: a DNS name
        ("agent", "{host}.evil.example:9100"),
        ("kv_events", "tcp://eth0;{host}:5557"),  # ZMQ "source;destination" syntax
        ("kv_events", "tcp://{host}{host}:5557"),
        ("agent", "{host}@evil:9100"),
        ("agent", "{host}:9100,evil:1"),
        ("agent", "ipv4:{host}:9100,169.254.169.254:80"),  # gRPC's multi-address target syntax
        ("agent", "unix:/run/{host}.sock:1"),  # gRPC dials a Unix socket
    ],
)
def test_socket_template_that_does_not_render_to_the_address_is_refused(field: str, template: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        EndpointTemplate(port=8000, models=["m"], **{field: template})
