"""The subset hint's reading (`extproc.server.epp.parse_subset`): every shape the protocol's
gateways send, and shapes it must not widen."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from extproc.datastore.endpoints import Endpoint
from extproc.server.epp import parse_subset


def value(v) -> struct_pb2.Value:
    s = struct_pb2.Struct()
    s.update({"v": v})
    return s.fields["v"]


def endpoint(address: str) -> Endpoint:
    return Endpoint(address, ["m"])


@pytest.mark.parametrize(
    ("hint", "address", "allowed"),
    [
        pytest.param(["10.0.0.1:8000"], "10.0.0.1:8000", True, id="list-exact"),
        pytest.param(["10.0.0.1:8000"], "10.0.0.1:8001", False, id="list-other-port"),
        pytest.param("10.0.0.2:80, 10.0.0.1:8000", "10.0.0.1:8000", True, id="comma-string"),
        pytest.param(["10.0.0.2:80,10.0.0.1:8000"], "10.0.0.1:8000", True, id="comma-inside-a-list-item"),
        pytest.param(["10.0.0.1"], "10.0.0.1:9999", True, id="bare-ip-any-port"),
        pytest.param(["[fd00::1]:8000"], "[fd00::1]:8000", True, id="ipv6-bracketed"),
        pytest.param(["fd00::1"], "[fd00::1]:8000", True, id="ipv6-bare"),
        # The same IPv6 address written another way: upper case, zeros spelt out.
        pytest.param(["[2001:DB8::1]:8000"], "[2001:db8::1]:8000", True, id="ipv6-upper-case-hint"),
        pytest.param(["[2001:db8:0:0::1]:8000"], "[2001:DB8::1]:8000", True, id="ipv6-uncompressed-hint-upper-case-endpoint"),
        pytest.param(["2001:DB8::1"], "[2001:db8::1]:8000", True, id="ipv6-bare-upper-case"),
        pytest.param(["[2001:db8::2]:8000"], "[2001:db8::1]:8000", False, id="ipv6-another-address"),
        pytest.param([], "10.0.0.1:8000", False, id="empty-list"),
        pytest.param("", "10.0.0.1:8000", False, id="empty-string"),
        pytest.param(42, "10.0.0.1:8000", False, id="a-number-allows-nothing"),
        pytest.param({"a": "10.0.0.1:8000"}, "10.0.0.1:8000", False, id="a-struct-allows-nothing"),
        pytest.param([7, "10.0.0.1:8000"], "10.0.0.1:8000", True, id="non-strings-in-a-list-skipped"),
    ],
)
def test_subset_hint_shapes(hint, address, allowed):
    assert parse_subset(value(hint))(endpoint(address)) is allowed


def test_an_endpoints_address_is_split_once_not_per_request():
    """Every request's subset is checked against every candidate: the endpoint's own address is
    split on its first check and read back after, whatever the request's hint."""
    from extproc.server.epp import _endpoint_host_port

    ep = endpoint("10.9.8.7:8123")  # an address no other test uses
    assert parse_subset(value(["10.9.8.7:8123"]))(ep)
    misses = _endpoint_host_port.cache_info().misses
    for hint in (["10.9.8.7"], ["10.0.0.1:80"], "10.9.8.7:8123"):
        parse_subset(value(hint))(ep)
    assert _endpoint_host_port.cache_info().misses == misses
