"""`llm-extproc envoy-config`: the shipped template with the deployment's addresses, endpoints and
limits, accepted by the real `envoy --mode validate` (end to end: tests/e2e/test_first_contact.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.config.loader import config_from_mapping
from extproc.stack.bootstrap import envoy_bootstrap, render_bootstrap
from extproc.stack.envoy import EnvoyError, load_envoy_config, stripped_headers, validate_config_file

CONFIG = {
    "listen": {"grpc": "0.0.0.0:9123"},
    "limits": {"max_body_bytes": 1 << 20, "grpc_max_message_bytes": 2 << 20},
    "models": [{"name": "Qwen/Qwen3-8B"}, {"name": "other"}],
    "endpoints": [
        {"address": "10.0.0.1:8000", "models": ["Qwen/Qwen3-8B"]},
        {"address": "10.0.0.2:8000", "models": ["Qwen/Qwen3-8B"]},
        {"address": "[fd00::3]:8001", "models": ["other"]},
    ],
}


def _cluster(boot: dict, name: str) -> dict:
    (c,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == name]
    return c


def _addresses(cluster: dict) -> list[tuple[str, int]]:
    return [(e["endpoint"]["address"]["socket_address"]["address"], e["endpoint"]["address"]["socket_address"]["port_value"])
            for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]  # fmt: skip


@pytest.mark.parametrize("template", ["fail-open", "fail-closed"])
def test_bootstrap_is_the_template_with_the_deployment_filled_in(tmp_path: Path, template: str):
    boot = envoy_bootstrap(config_from_mapping(CONFIG), template=template, listener="0.0.0.0:8443")
    listener = boot["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8443}
    assert listener["per_connection_buffer_limit_bytes"] == 1 << 20
    assert _addresses(_cluster(boot, "llm_extproc")) == [("127.0.0.1", 9123)]  # wildcard listen → local sidecar
    if template == "fail-open":
        assert _addresses(_cluster(boot, "llm_fallback")) == [("10.0.0.1", 8000), ("10.0.0.2", 8000), ("fd00::3", 8001)]
    # Everything else as shipped: a later edit to the template flows into the generated file.
    shipped = load_envoy_config(template)
    assert stripped_headers(boot) == stripped_headers(shipped)
    assert _cluster(boot, "llm_endpoints") == _cluster(shipped, "llm_endpoints")
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(boot, template=template, source="cfg.yaml"), encoding="utf-8")
    assert yaml.safe_load(path.read_text()) == boot
    validate_config_file(path)


def test_tier_mode_and_unknown_templates_are_refused_with_the_reason():
    tier = config_from_mapping({**CONFIG, "scheduling": {"mode": "tier"}})
    with pytest.raises(EnvoyError, match="envoy/tier.yaml"):
        envoy_bootstrap(tier)
    with pytest.raises(EnvoyError, match="fail-open, fail-closed"):
        envoy_bootstrap(config_from_mapping(CONFIG), template="tier")
    with pytest.raises(EnvoyError, match="host:port"):
        envoy_bootstrap(config_from_mapping(CONFIG), listener="8080")
    # A picker for a gateway's InferencePool got a BUFFERED bootstrap in silence; every request
    # through it would then be the mode-mismatch 500.
    epp = config_from_mapping({**CONFIG, "protocol": {"mode": "epp"}})
    with pytest.raises(EnvoyError, match="docs/epp.md"):
        envoy_bootstrap(epp)


@pytest.mark.parametrize("template", ["fail-open", "fail-closed"])
def test_configured_trusted_headers_are_stripped_from_clients(tmp_path: Path, template: str):
    # A deployment trusting `x-tenant-id` (ratelimit) and `x-trusted-priority` (priority) got a
    # bootstrap that stripped only the shipped x-llm-tenant: any client could name any tenant
    # (another tenant's rate-limit budget) or claim `critical`.
    cfg = config_from_mapping({
        **CONFIG,
        "ratelimit": {"enabled": True, "tenant_header": "X-Tenant-Id", "default": {"tokens_per_minute": 1000}},
        "admission": {"priority": {"trusted_header": "x-trusted-priority"}},
    })  # fmt: skip
    boot = envoy_bootstrap(cfg, template=template)
    shipped = stripped_headers(load_envoy_config(template))
    assert stripped_headers(boot) == [*shipped, "x-tenant-id", "x-trusted-priority"]
    early = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "early_header_mutation_extensions"][0]["typed_config"]["mutations"]  # fmt: skip
    assert [m["remove"] for m in early] == stripped_headers(boot)  # before routing too
    # The shipped name configured: nothing doubled.
    same = config_from_mapping({**CONFIG, "ratelimit": {"enabled": True, "tenant_header": "x-llm-tenant"}})
    assert stripped_headers(envoy_bootstrap(same, template=template)) == shipped
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(boot, template=template, source="cfg.yaml"), encoding="utf-8")
    validate_config_file(path)


@pytest.mark.parametrize("template", ["fail-open", "fail-closed"])
def test_workers_are_each_listed_and_health_checked(tmp_path: Path, template: str):
    boot = envoy_bootstrap(config_from_mapping(CONFIG), template=template, workers=3)
    cluster = _cluster(boot, "llm_extproc")
    assert _addresses(cluster) == [("127.0.0.1", 9123), ("127.0.0.1", 9124), ("127.0.0.1", 9125)]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert "health_checks" not in _cluster(envoy_bootstrap(config_from_mapping(CONFIG), template=template), "llm_extproc")
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(boot, template=template, source="cfg.yaml"), encoding="utf-8")
    validate_config_file(path)
    with pytest.raises(EnvoyError, match="65535"):
        envoy_bootstrap(config_from_mapping({**CONFIG, "listen": {"grpc": "127.0.0.1:65535"}}), workers=2)


def test_flow_control_raises_the_message_timeout_above_the_longest_queue_wait(tmp_path: Path):
    # A request held in a queue is answered only when dispatched: with the shipped 2 s, Envoy
    # answered 504 to every request queued longer than ~0.5 s.
    flow = {"enabled": True, "bands": {"critical": {"ttl_s": 45}}, "slo_header": {"name": "x-slo-ttft-ms", "trusted": True}}
    boot = envoy_bootstrap(config_from_mapping({**CONFIG, "flow_control": flow}), template="fail-closed")
    (ext_proc,) = [f for f in boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
                   if f["name"] == "envoy.filters.http.ext_proc"]  # fmt: skip
    assert ext_proc["typed_config"]["message_timeout"] == "47.000s"  # 45 s + the 1.5 s decision + 0.5 s
    assert "x-slo-ttft-ms" in stripped_headers(boot)  # trusted: a client's copy must go
    off = envoy_bootstrap(config_from_mapping(CONFIG), template="fail-closed")
    assert "x-slo-ttft-ms" not in stripped_headers(off)
    path = tmp_path / "envoy.yaml"
    path.write_text(render_bootstrap(boot, template="fail-closed", source="cfg.yaml"), encoding="utf-8")
    validate_config_file(path)
