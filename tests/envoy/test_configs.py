"""The configs in envoy/: Envoy accepts each as is, they keep the settings DESIGN section 3 asks
for, in step with llm-extproc's own limits, and they strip the same routing headers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config.schema import LimitsConfig
from extproc.server.responses import OWNED_HEADERS
from extproc.stack.envoy import (
    CONFIG_NAMES,
    EnvoyError,
    ExtProcTLS,
    body_limit_message,
    RunSettings,
    config_path,
    load_envoy_config,
    rewrite_config,
    served_path_regex,
    served_path_routes,
    stripped_headers,
    validate_config_file,
)

ENVOY_DIR = Path(__file__).resolve().parents[2] / "envoy"
CONFIG_FILES = sorted(ENVOY_DIR.glob("*.yaml"))


def _hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _http_filter(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    (f,) = [f for f in _hcm(cfg)["http_filters"] if f["name"] == name]
    return f["typed_config"]


def _cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == name]
    return c


def _routes(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for vh in _hcm(cfg)["route_config"]["virtual_hosts"] for r in vh["routes"]]


def test_every_shipped_name_has_its_file_and_every_file_a_name() -> None:
    assert sorted(p.stem for p in CONFIG_FILES) == sorted(CONFIG_NAMES)
    for name in CONFIG_NAMES:
        assert config_path(name).is_file()


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_envoy_validate_accepts(path: Path) -> None:
    assert "OK" in validate_config_file(path)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_strips_exactly_the_owned_routing_headers(path: Path) -> None:
    # The server keeps the same list (it also overwrites them); one list for both layers.
    cfg = load_envoy_config(path)
    assert stripped_headers(cfg) == list(OWNED_HEADERS)
    # The early (pre-routing) mutation removes the same list.
    (early,) = _hcm(cfg)["early_header_mutation_extensions"]
    assert [m["remove"] for m in early["typed_config"]["mutations"]] == list(OWNED_HEADERS)
    # header_mutation sits right before ext_proc, which sits before the router.
    names = [f["name"] for f in _hcm(cfg)["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_limits_match_the_servers_defaults(path: Path) -> None:
    cfg = load_envoy_config(path)
    limits = LimitsConfig()
    assert cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == limits.max_body_bytes
    envoy_grpc = _http_filter(cfg, "envoy.filters.http.ext_proc")["grpc_service"]["envoy_grpc"]
    assert envoy_grpc["max_receive_message_length"] == limits.grpc_max_message_bytes
    assert envoy_grpc["max_receive_message_length"] > limits.max_body_bytes


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_ext_proc_settings(path: Path) -> None:
    ext_proc = _http_filter(load_envoy_config(path), "envoy.filters.http.ext_proc")
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "request_trailer_mode": "SKIP",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    assert ext_proc["allow_mode_override"] is True
    # 2 s: above the server's own decision budget (1500 ms), far above Envoy's 200 ms default.
    assert ext_proc["message_timeout"] == "2s"
    assert LimitsConfig().decision_timeout_ms < 2000
    expected_fail_open = path.stem in ("fail-open", "tier")
    assert ext_proc["failure_mode_allow"] is expected_fail_open
    if not expected_fail_open:
        assert ext_proc["status_on_error"] == {"code": "ServiceUnavailable"}


ENDPOINT_MODE_FILES = [p for p in CONFIG_FILES if p.stem != "tier"]


@pytest.mark.parametrize("path", ENDPOINT_MODE_FILES, ids=[p.name for p in ENDPOINT_MODE_FILES])
def test_clusters_routes_and_timeouts(path: Path) -> None:
    cfg = load_envoy_config(path)
    pinned = _cluster(cfg, "llm_endpoints")
    assert pinned["type"] == "ORIGINAL_DST"
    assert pinned["lb_policy"] == "CLUSTER_PROVIDED"
    assert pinned["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
    ext = _cluster(cfg, "llm_extproc")
    assert "http2_protocol_options" in ext["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]
    # Each in-flight request holds one ext_proc stream: Envoy's 1024 default would cap concurrency.
    for cluster in cfg["static_resources"]["clusters"]:
        (t,) = cluster["circuit_breakers"]["thresholds"]
        assert min(t["max_connections"], t["max_pending_requests"], t["max_requests"]) >= 10 * 1024, cluster["name"]
    # Header present → ORIGINAL_DST; absent → the fallback (fail-open) or a 503 (fail-closed).
    first, second, _not_served = _routes(cfg)
    assert first["match"]["headers"] == [{"name": "x-gateway-destination-endpoint", "present_match": True}]
    assert first["route"] == {"cluster": "llm_endpoints", "timeout": "0s"}
    assert "headers" not in second["match"]
    if path.stem == "fail-open":
        assert second["route"] == {"cluster": "llm_fallback", "timeout": "0s"}
        assert _cluster(cfg, "llm_fallback")["lb_policy"] == "LEAST_REQUEST"
    else:
        assert second["direct_response"]["status"] == 503
    # Non-streaming generations are silent until done: idle timeout well above Envoy's 5 min.
    assert int(_hcm(cfg)["stream_idle_timeout"].rstrip("s")) >= 600
    assert _hcm(cfg)["codec_type"] == "AUTO"


def test_tier_config_routes_each_tier_to_its_cluster() -> None:
    cfg = load_envoy_config("tier")
    routes = _routes(cfg)
    tiers = ["low-latency", "balanced", "high-throughput"]
    for route, tier in zip(routes, tiers):
        assert route["match"]["headers"] == [{"name": "x-llm-tier", "string_match": {"exact": tier}}]
        cluster = _cluster(cfg, route["route"]["cluster"])
        assert cluster["name"] == "llm_tier_" + tier.replace("-", "_")
        assert cluster["lb_policy"] == "LEAST_REQUEST"
        # Health through the node agent's port, never the engine's own.
        (hc,) = cluster["health_checks"]
        assert hc["http_health_check"]["path"] == "/healthz"
        for lb in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]:
            assert lb["endpoint"]["health_check_config"]["port_value"] != lb["endpoint"]["address"]["socket_address"]["port_value"]
    assert routes[3]["route"]["cluster"] == "llm_fallback" and "headers" not in routes[3]["match"]
    assert len(routes) == 5  # then the not_served 404
    # No ORIGINAL_DST cluster: no header can steer a request to an address of its choosing.
    assert all(c["type"] != "ORIGINAL_DST" for c in cfg["static_resources"]["clusters"])


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_local_replies_become_openai_json(path: Path) -> None:
    mappers = _hcm(load_envoy_config(path))["local_reply_config"]["mappers"]
    assert len(mappers) >= 4
    for m in mappers:
        fmt = m["body_format_override"]
        assert fmt["content_type"] == "application/json"
        assert set(fmt["json_format"]) == {"error"}
        assert set(fmt["json_format"]["error"]) == {"message", "type", "param", "code"}
    codes = [m["body_format_override"]["json_format"]["error"]["code"] for m in mappers]
    assert "request_too_large" in codes and "routing_unavailable" in codes and "routing_timeout" in codes


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_only_served_paths_are_forwarded_everything_else_is_a_json_404(path: Path) -> None:
    """Issue 18.1: every route that forwards (or, fail-closed, refuses for want of a decision)
    matches the served paths; the last catches the rest with a 404, without asking ext_proc."""
    cfg = load_envoy_config(path)
    routes = _routes(cfg)
    *forwarding, last = routes
    assert forwarding == served_path_routes(cfg)
    assert all(r["match"]["safe_regex"] == {"regex": served_path_regex()} for r in forwarding)
    assert last["match"] == {"prefix": "/"} and last["direct_response"]["status"] == 404
    body = last["direct_response"]["body"]["inline_string"]
    assert json.loads(body)["error"]["code"] == "not_found"
    assert last["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True


def test_the_allow_list_extends_every_forwarding_route(tmp_path: Path) -> None:
    cfg = rewrite_config(load_envoy_config("fail-open"), RunSettings(extra_served_paths=["/v1/embeddings"]))
    regexes = {r["match"]["safe_regex"]["regex"] for r in served_path_routes(cfg)}
    assert regexes == {served_path_regex(["/v1/embeddings"])} and regexes.pop().endswith("|/v1/embeddings")
    with pytest.raises(EnvoyError, match="must start with /"):
        served_path_regex(["v1/x"])
    out = tmp_path / "allow.yaml"
    out.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    assert "OK" in validate_config_file(out)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_the_commented_tls_block_is_what_extproc_tls_writes(path: Path) -> None:
    """The shipped (commented) Envoy side of llm-extproc's listen.grpc_tls, uncommented, is the
    transport socket the TLS e2e test runs with."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index("      # transport_socket:")
    block = []
    for line in lines[start:]:
        if not line.startswith("      # ") or (block and not line.startswith("      #   ")):
            break
        block.append(line.replace("      # ", "", 1))
    shipped = yaml.safe_load("\n".join(block))["transport_socket"]
    tls = ExtProcTLS("/etc/llm-extproc/ca.pem", "/etc/envoy/client.pem", "/etc/envoy/client-key.pem")
    assert shipped == tls.transport_socket()


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_envoys_own_413_states_the_limit_it_enforces(path: Path) -> None:
    """A client refused by Envoy's buffer limit is told the limit, as llm-extproc's own 413 does;
    envoy-config with another `limits.max_body_bytes` says that one."""
    cfg = load_envoy_config(path)

    def message(c: dict) -> str:
        (m,) = [m for m in _hcm(c)["local_reply_config"]["mappers"] if m["body_format_override"]["json_format"]["error"]["code"] == "request_too_large"]
        return m["body_format_override"]["json_format"]["error"]["message"]

    limit = cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"]
    assert message(cfg) == body_limit_message(limit)
    assert message(rewrite_config(cfg, RunSettings(max_body_bytes=65536, grpc_max_message_bytes=262144))) == body_limit_message(65536)
    assert "65536 bytes" in body_limit_message(65536)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_client_connections_are_bounded(path: Path) -> None:
    (monitor,) = load_envoy_config(path)["overload_manager"]["resource_monitors"]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert 1000 <= monitor["typed_config"]["max_active_downstream_connections"] <= 1_000_000
