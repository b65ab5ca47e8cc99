"""A bare Envoy configured the way the Endpoint Picker Protocol's gateways configure their
picker (the extension's test/testdata/envoy.yaml and its chart's values): the ext_proc filter
with request and response bodies FULL_DUPLEX_STREAMED, headers and trailers SEND; the pool's
cluster ORIGINAL_DST, taking the address from the `x-gateway-destination-endpoint` header or,
with `routing="metadata"`, from the `envoy.lb` dynamic metadata the picker writes.

Two pieces a managed gateway provides itself are played here by plain filters: a
`set_metadata` filter before ext_proc puts a subset hint in `envoy.lb.subset_hint` (when
`subset` is given); the route adds the upstream address that served the request
(`%UPSTREAM_REMOTE_ADDRESS%`) as a response header, which a `header_to_metadata` filter after
ext_proc moves into `envoy.lb` / `x-gateway-destination-endpoint-served` for the picker to
read back (Envoy's Lua API has no upstream address).

Used by the end-to-end tests (tests/e2e/test_epp.py) and scripts/bench_stream.py; run it with
`EnvoyProcess(gateway_config(port))`.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["gateway_config"]

_SERVED = "x-gateway-destination-endpoint-served"



def gateway_config(
    grpc_port: int,
    *,
    routing: Literal["header", "metadata"] = "header",
    subset: list[str] | None = None,
    message_timeout: str = "30s",
    buffer_limit_bytes: int = 1 << 20,
) -> dict[str, Any]:
    """The Envoy config (a dict for `EnvoyProcess`): one listener on a kernel-picked port in
    front of an ORIGINAL_DST pool, the picker at 127.0.0.1:`grpc_port`."""
    filters: list[dict[str, Any]] = []
    if subset is not None:
        filters.append(
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {"metadata_namespace": "envoy.lb.subset_hint", "value": {"x-gateway-destination-endpoint-subset": subset}}
                    ],
                },
            }
        )
    filters += [
        {
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": "FULL_DUPLEX_STREAMED",
                    "response_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND",
                    "response_trailer_mode": "SEND",
                },
                "message_timeout": message_timeout,
                "metadata_options": {
                    "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]},
                    "receiving_namespaces": {"untyped": ["envoy.lb"]},
                },
            },
        },
        {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "response_rules": [
                    {
                        "header": _SERVED,
                        "on_header_present": {"metadata_namespace": "envoy.lb", "key": _SERVED, "type": "STRING"},
                        "remove": True,
                    }
                ],
            },
        },
        {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
    ]
    if routing == "header":
        lb = {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
    else:
        lb = {"metadata_key": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    big = {"thresholds": [{"max_connections": 10000, "max_pending_requests": 10000, "max_requests": 10000}]}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "per_connection_buffer_limit_bytes": buffer_limit_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "epp_gateway",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "pool",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {"cluster": "pool", "timeout": "0s"},
                                                            # Filled by the router with the address it connected to.
                                                            "response_headers_to_add": [
                                                                {"header": {"key": _SERVED, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
                                                            ],
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": filters,
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "pool",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "5s",
                    "original_dst_lb_config": lb,
                    "circuit_breakers": big,
                },
                {
                    "name": "epp",
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "circuit_breakers": big,
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "epp",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": grpc_port}}}}]}],
                    },
                },
            ],
        },
    }
