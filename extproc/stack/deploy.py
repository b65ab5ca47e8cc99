"""The deployment artefacts that carry Envoy configuration, rendered from `envoy/fail-open.yaml`.

One source of truth: the compose demo's Envoy config and the Istio EnvoyFilters are built from
the shipped fail-open config (header stripping, ext_proc settings, the ORIGINAL_DST cluster,
served paths and the JSON 404), so a change there reaches every deployment by re-running
`python scripts/gen_deploy.py` (tests/deploy checks the committed files are current).

    compose_envoy_config()          deploy/compose/envoy.yaml (static addresses of the compose network)
    istio_envoyfilter("gateway")    deploy/istio/envoyfilter-gateway.yaml (ingress gateway)
    istio_envoyfilter("sidecar")    deploy/istio/envoyfilter-sidecar.yaml (clients' sidecars)
    istio_gateway()                 deploy/istio/gateway.yaml (Gateway, VirtualService, DestinationRule)
    bootstrap_from_envoyfilter(ef)  the patches put into a plain bootstrap, for `envoy --mode validate`

Names shared with the Kubernetes manifests are constants here (`K8S`); tests/deploy checks the
manifests agree with them and with the CLI defaults. What a user sets for their gateway — its
selector and namespace, hosts, port, TLS — is read from deploy/istio/values.yaml
(`gateway_values`), never edited here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from extproc.stack.envoy import RunSettings, load_envoy_config, rewrite_config

__all__ = [
    "COMPOSE",
    "GATEWAY_VALUES",
    "K8S",
    "bootstrap_from_envoyfilter",
    "compose_envoy_config",
    "gateway_values",
    "istio_cluster_name",
    "istio_envoyfilter",
    "istio_gateway",
]

COMPOSE: dict[str, Any] = {
    "subnet": "172.28.0.0/24",
    "extproc": "172.28.0.10",
    "sims": {"sim-h100": "172.28.0.11", "sim-a100-1": "172.28.0.12", "sim-a100-2": "172.28.0.13"},
    "agents": {"sim-h100": "172.28.0.21", "sim-a100-1": "172.28.0.22", "sim-a100-2": "172.28.0.23"},
    "sim_port": 8000,
}
"""Fixed addresses of the compose network: Envoy's ORIGINAL_DST cluster connects to the literal
`ip:port` llm-extproc writes, so the endpoints need addresses known before start."""

K8S: dict[str, Any] = {
    "namespace": "llm",
    "extproc_service": "llm-extproc",
    "grpc_port": 9002,
    "admin_port": 9090,
    "vllm_service": "vllm",
    "vllm_port": 8000,
}
"""Kubernetes names the EnvoyFilters point at (deploy/k8s/base uses the same)."""

GATEWAY_VALUES = Path(__file__).resolve().parents[2] / "deploy/istio/values.yaml"
"""The user's gateway settings the Istio files are generated from."""

_TLS_MODES = ("SIMPLE", "MUTUAL")


def gateway_values(path: str | Path = GATEWAY_VALUES) -> dict[str, Any]:
    """The `gateway:` section of deploy/istio/values.yaml, checked: `selector` (labels, str →
    str), `namespace`, `hosts` (non-empty list of host names or `*`), `port` (1..65535), `tls`
    (None, or `port`, `credential_name`, `mode` SIMPLE | MUTUAL, `https_redirect` bool).

    Raises:
        ValueError: a missing or malformed value (names the key).
    """
    raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    g = raw.get("gateway") if isinstance(raw, dict) else None
    if not isinstance(g, dict):
        raise ValueError(f"{path}: needs a gateway: mapping")
    unknown = set(g) - {"selector", "namespace", "hosts", "port", "tls"}
    if unknown:
        raise ValueError(f"{path}: gateway has unknown keys {sorted(unknown)}")
    selector, hosts = g.get("selector"), g.get("hosts")
    if not (isinstance(selector, dict) and selector and all(isinstance(k, str) and isinstance(v, str) for k, v in selector.items())):
        raise ValueError(f"{path}: gateway.selector must map label names to values")
    if not isinstance(g.get("namespace"), str) or not g["namespace"]:
        raise ValueError(f"{path}: gateway.namespace must be a namespace name")
    if not (isinstance(hosts, list) and hosts and all(isinstance(h, str) and h and " " not in h for h in hosts)):
        raise ValueError(f"{path}: gateway.hosts must be a non-empty list of host names (or \"*\")")
    out = {"selector": dict(selector), "namespace": g["namespace"], "hosts": list(hosts), "port": _port(path, "gateway.port", g.get("port")), "tls": None}
    tls = g.get("tls")
    if tls is not None:
        if not isinstance(tls, dict) or set(tls) - {"port", "credential_name", "mode", "https_redirect"}:
            raise ValueError(f"{path}: gateway.tls must be null or {{port, credential_name, mode, https_redirect}}")
        if not isinstance(tls.get("credential_name"), str) or not tls["credential_name"]:
            raise ValueError(f"{path}: gateway.tls.credential_name must name the TLS Secret")
        mode = tls.get("mode", "SIMPLE")
        if mode not in _TLS_MODES:
            raise ValueError(f"{path}: gateway.tls.mode must be one of {', '.join(_TLS_MODES)}, got {mode!r}")
        redirect = tls.get("https_redirect", True)
        if not isinstance(redirect, bool):
            raise ValueError(f"{path}: gateway.tls.https_redirect must be true or false")
        out["tls"] = {"port": _port(path, "gateway.tls.port", tls.get("port", 443)), "credential_name": tls["credential_name"], "mode": mode, "https_redirect": redirect}
        if out["tls"]["port"] == out["port"]:
            raise ValueError(f"{path}: gateway.tls.port and gateway.port must differ")
    return out


def _port(path: str | Path, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{path}: {key} must be a port number (1..65535), got {value!r}")
    return value


def _served_port(values: dict[str, Any]) -> int:
    """The gateway port whose virtual hosts carry the LLM routes (the TLS one when set)."""
    return values["tls"]["port"] if values["tls"] else values["port"]


_HCM = "envoy.filters.network.http_connection_manager"
_PREAMBLE = """\
# GENERATED by `python scripts/gen_deploy.py` ({what}); do not edit: change your gateway's
# hosts, port and TLS in deploy/istio/values.yaml, Envoy's settings in envoy/fail-open.yaml, and
# re-run the script (tests/deploy/test_envoy_artefacts.py fails while this file is stale). Why
# each setting is what it is: the comments in envoy/fail-open.yaml and
# docs/decisions/0002-envoy-topology.md.
"""


def preamble(what: str) -> str:
    """The comment block heading every generated file."""
    return _PREAMBLE.format(what=what)


def istio_cluster_name(service: str, namespace: str, port: int) -> str:
    """Envoy's name for a Kubernetes Service's cluster inside Istio:
    `outbound|<port>||<service>.<namespace>.svc.cluster.local` (Istio's xDS naming; a cluster
    name that does not exist makes every ext_proc call fail, and with failure_mode_allow the
    gateway then silently fails open)."""
    return f"outbound|{port}||{service}.{namespace}.svc.cluster.local"


def _source() -> dict[str, Any]:
    return load_envoy_config("fail-open")


def _hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    for f in cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]:
        if f["name"] == _HCM:
            return f["typed_config"]
    raise ValueError("envoy/fail-open.yaml has no HTTP connection manager")


def _cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == name]
    return found


def compose_envoy_config() -> dict[str, Any]:
    """fail-open.yaml with the compose network's addresses: listener 0.0.0.0:8080, admin
    0.0.0.0:9901 (Prometheus scrapes it), llm-extproc and the three simulators by fixed IP."""
    return rewrite_config(
        _source(),
        RunSettings(
            listener=("0.0.0.0", 8080),
            admin=("0.0.0.0", 9901),
            extproc=(COMPOSE["extproc"], K8S["grpc_port"]),
            endpoints=[(ip, COMPOSE["sim_port"]) for ip in COMPOSE["sims"].values()],
        ),
    )


def _patch_parts(fallback_cluster: str, extproc_cluster: str) -> dict[str, Any]:
    """The pieces of fail-open.yaml an EnvoyFilter inserts, with Istio's cluster names."""
    cfg = _source()
    hcm = _hcm(cfg)
    filters = {f["name"]: copy.deepcopy(f) for f in hcm["http_filters"]}
    ext_proc = filters["envoy.filters.http.ext_proc"]
    ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = extproc_cluster
    vhost = hcm["route_config"]["virtual_hosts"][0]
    routes = {r["name"]: copy.deepcopy(r) for r in vhost["routes"]}
    routes["fallback"]["route"]["cluster"] = fallback_cluster
    original_dst = copy.deepcopy(_cluster(cfg, "llm_endpoints"))
    return {
        "early": copy.deepcopy(hcm["early_header_mutation_extensions"]),
        "header_mutation": filters["envoy.filters.http.header_mutation"],
        "ext_proc": ext_proc,
        "routes": [routes["pinned"], routes["fallback"], routes["not_served"]],
        "response_headers_to_add": copy.deepcopy(vhost.get("response_headers_to_add", [])),
        "local_reply_config": copy.deepcopy(hcm["local_reply_config"]),
        "original_dst": original_dst,
        "buffer_limit": cfg["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"],
        "hcm_settings": {k: hcm[k] for k in ("normalize_path", "merge_slashes", "path_with_escaped_slashes_action", "stream_idle_timeout")},
    }


def istio_envoyfilter(variant: str, mode: str = "endpoint", values: dict[str, Any] | None = None) -> dict[str, Any]:
    """An EnvoyFilter inserting llm-extproc in front of the vLLM Service.

    Args:
        variant: `gateway` (the ingress gateway's listeners, GATEWAY context) or `sidecar`
            (the outbound listener of clients' sidecars for the vLLM Service, SIDECAR_OUTBOUND).
        mode: `endpoint` (llm-extproc pins an ip:port: the ORIGINAL_DST cluster and the
            pinned / fallback / not-served routes come with the filter) or `tier` (llm-extproc
            sets x-llm-tier: the routes are a VirtualService's, deploy/istio/tier.yaml, to
            DestinationRule subsets; the filter adds no cluster or route).
        values: the gateway's settings (`gateway_values()`, read from deploy/istio/values.yaml
            when None): its selector, namespace, and the `<host>:<port>` virtual hosts the
            routes are patched into.

    Raises:
        ValueError: unknown variant or mode.
    """
    if variant not in ("gateway", "sidecar"):
        raise ValueError(f"variant must be gateway or sidecar, got {variant!r}")
    if mode not in ("endpoint", "tier"):
        raise ValueError(f"mode must be endpoint or tier, got {mode!r}")
    values = gateway_values() if values is None else values
    ns = K8S["namespace"]
    vllm_host = f"{K8S['vllm_service']}.{ns}.svc.cluster.local"
    parts = _patch_parts(
        istio_cluster_name(K8S["vllm_service"], ns, K8S["vllm_port"]),
        istio_cluster_name(K8S["extproc_service"], ns, K8S["grpc_port"]),
    )
    if variant == "gateway":
        context = "GATEWAY"
        listener_match: dict[str, Any] = {"context": context, "listener": {"filterChain": {"filter": {"name": _HCM}}}}
        port = _served_port(values)
        route_matches = [{"context": context, "routeConfiguration": {"vhost": {"name": f"{host}:{port}"}}} for host in values["hosts"]]
        metadata = {"name": "llm-extproc-gateway", "namespace": values["namespace"]}
        selector = {"workloadSelector": {"labels": dict(values["selector"])}}
    else:
        context = "SIDECAR_OUTBOUND"
        listener_match = {
            "context": context,
            "listener": {"portNumber": K8S["vllm_port"], "filterChain": {"filter": {"name": _HCM}}},
        }
        route_matches = [{"context": context, "routeConfiguration": {"vhost": {"name": f"{vllm_host}:{K8S['vllm_port']}"}}}]
        metadata = {"name": "llm-extproc-sidecar", "namespace": ns}
        selector = {"workloadSelector": {"labels": {"llm-extproc/client": "true"}}}
    patches: list[dict[str, Any]] = [
        # 1. Early header mutation: strip client copies of the routing headers before a route is picked.
        {
            "applyTo": "NETWORK_FILTER",
            "match": listener_match,
            "patch": {
                "operation": "MERGE",
                "value": {
                    "name": _HCM,
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "early_header_mutation_extensions": parts["early"],
                        "local_reply_config": parts["local_reply_config"],
                        **parts["hcm_settings"],
                    },
                },
            },
        },
        # 2. The same strip as a filter, then ext_proc, both before the router.
        *(
            {
                "applyTo": "HTTP_FILTER",
                "match": {**listener_match, "listener": {**listener_match["listener"], "filterChain": {"filter": {"name": _HCM, "subFilter": {"name": "envoy.filters.http.router"}}}}},
                "patch": {"operation": "INSERT_BEFORE", "value": parts[key]},
            }
            for key in ("header_mutation", "ext_proc")
        ),
        # 3. Envoy buffers at most the body size llm-extproc accepts (its limits.max_body_bytes);
        #    responses name the engine that served them.
        {"applyTo": "LISTENER", "match": {"context": context, **({"listener": {"portNumber": K8S["vllm_port"]}} if variant == "sidecar" else {})},
         "patch": {"operation": "MERGE", "value": {"per_connection_buffer_limit_bytes": parts["buffer_limit"]}}},
        *(
            {"applyTo": "VIRTUAL_HOST", "match": m, "patch": {"operation": "MERGE", "value": {"response_headers_to_add": parts["response_headers_to_add"]}}}
            for m in route_matches
        ),
    ]
    if mode == "endpoint":
        patches += _endpoint_mode_patches(context, route_matches, parts)
    if mode == "tier":
        metadata = {**metadata, "name": metadata["name"] + "-tier"}
    return {"apiVersion": "networking.istio.io/v1alpha3", "kind": "EnvoyFilter", "metadata": metadata, "spec": {**selector, "configPatches": patches}}


def _endpoint_mode_patches(context: str, route_matches: list[dict[str, Any]], parts: dict[str, Any]) -> list[dict[str, Any]]:
    """The ORIGINAL_DST cluster and the routes of endpoint mode (inserted first, in file order,
    into each virtual host matched)."""
    return [
        # 4. The ORIGINAL_DST cluster the pinned route uses.
        {"applyTo": "CLUSTER", "match": {"context": context}, "patch": {"operation": "ADD", "value": parts["original_dst"]}},
        # 5. Routes: pinned (header set by llm-extproc) first; served paths without a decision
        #    go to the vLLM Service (Istio's own cluster: the fail-open fallback); other paths 404.
        *(
            {"applyTo": "HTTP_ROUTE", "match": route_match, "patch": {"operation": op, "value": route}}
            for route_match in route_matches
            for op, route in (("INSERT_FIRST", parts["routes"][2]), ("INSERT_FIRST", parts["routes"][1]), ("INSERT_FIRST", parts["routes"][0]))
        ),
    ]


def bootstrap_from_envoyfilter(ef: dict[str, Any]) -> dict[str, Any]:
    """A static bootstrap holding what the EnvoyFilter's patches add, in the places Istio puts
    them, with stand-ins for the clusters Istio itself creates (the ext_proc Service over HTTP/2,
    the vLLM Service): what `envoy --mode validate` can check without a mesh.

    Raises:
        ValueError: a patch of a kind this renderer does not know.
    """
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "istio",
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "route_config": {"name": "istio", "virtual_hosts": []},
    }
    clusters: list[dict[str, Any]] = []
    listener_extra: dict[str, Any] = {}
    vhosts: dict[str, dict[str, Any]] = {}

    def vhost(match: dict[str, Any]) -> dict[str, Any]:
        """The virtual host Istio names `<host>:<port>` (one per Gateway host), made on first use."""
        name = match["routeConfiguration"]["vhost"]["name"]
        if name not in vhosts:
            vhosts[name] = {"name": name, "domains": [name.rsplit(":", 1)[0]], "routes": []}
            hcm["route_config"]["virtual_hosts"].append(vhosts[name])
        return vhosts[name]

    for p in ef["spec"]["configPatches"]:
        op, value, kind = p["patch"]["operation"], copy.deepcopy(p["patch"]["value"]), p["applyTo"]
        if kind == "NETWORK_FILTER" and op == "MERGE":
            hcm.update({k: v for k, v in value["typed_config"].items() if k != "@type"})
        elif kind == "HTTP_FILTER" and op == "INSERT_BEFORE":
            hcm["http_filters"].insert(len(hcm["http_filters"]) - 1, value)
        elif kind == "LISTENER" and op == "MERGE":
            listener_extra.update(value)
        elif kind == "VIRTUAL_HOST" and op == "MERGE":
            vhost(p["match"]).update(value)
        elif kind == "CLUSTER" and op == "ADD":
            clusters.append(value)
        elif kind == "HTTP_ROUTE" and op == "INSERT_FIRST":
            vhost(p["match"])["routes"].insert(0, value)
        else:
            raise ValueError(f"unknown patch {kind} {op}")
    ns = K8S["namespace"]
    grpc_cluster = istio_cluster_name(K8S["extproc_service"], ns, K8S["grpc_port"])
    vllm_cluster = istio_cluster_name(K8S["vllm_service"], ns, K8S["vllm_port"])

    def stand_in(name: str, port: int, h2: bool) -> dict[str, Any]:
        c: dict[str, Any] = {
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
        }  # fmt: skip
        if h2:
            c["typed_extension_protocol_options"] = {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            }
        return c

    clusters += [stand_in(grpc_cluster, K8S["grpc_port"], True), stand_in(vllm_cluster, K8S["vllm_port"], False)]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "istio_stand_in",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [{"filters": [{"name": _HCM, "typed_config": hcm}]}],
                    **listener_extra,
                }
            ],
            "clusters": clusters,
        },
    }


def istio_gateway(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """deploy/istio/gateway.yaml: the Gateway (its hosts on the plaintext port, and with `tls` an
    HTTPS server on the TLS port, the plaintext one then redirecting when `https_redirect`), the
    VirtualService binding those hosts to the vLLM Service (in endpoint mode only what Istio
    needs to build the virtual hosts the EnvoyFilter's routes are patched into), and the vLLM
    DestinationRule (least request, as envoy/fail-open.yaml's fallback).

    Args:
        values: `gateway_values()` (read from deploy/istio/values.yaml when None).
    """
    values = gateway_values() if values is None else values
    ns, hosts = K8S["namespace"], values["hosts"]
    vllm_host = f"{K8S['vllm_service']}.{ns}.svc.cluster.local"
    plain: dict[str, Any] = {"port": {"number": values["port"], "name": "http", "protocol": "HTTP"}, "hosts": list(hosts)}
    servers = [plain]
    tls = values["tls"]
    if tls:
        if tls["https_redirect"]:
            plain["tls"] = {"httpsRedirect": True}
        servers.append({
            "port": {"number": tls["port"], "name": "https", "protocol": "HTTPS"},
            "hosts": list(hosts),
            "tls": {"mode": tls["mode"], "credentialName": tls["credential_name"]},
        })  # fmt: skip
    gateway = {
        "apiVersion": "networking.istio.io/v1beta1", "kind": "Gateway",
        "metadata": {"name": "llm-gateway", "namespace": ns},
        "spec": {"selector": dict(values["selector"]), "servers": servers},
    }  # fmt: skip
    service = {
        "apiVersion": "networking.istio.io/v1beta1", "kind": "VirtualService",
        "metadata": {"name": "llm", "namespace": ns},
        "spec": {
            "hosts": list(hosts), "gateways": ["llm-gateway"],
            # timeout 0: generations stream for minutes
            "http": [{"name": "engines", "route": [{"destination": {"host": vllm_host, "port": {"number": K8S["vllm_port"]}}}], "timeout": "0s"}],
        },
    }  # fmt: skip
    rule = {
        "apiVersion": "networking.istio.io/v1beta1", "kind": "DestinationRule",
        "metadata": {"name": K8S["vllm_service"], "namespace": ns},
        "spec": {
            "host": vllm_host,
            "trafficPolicy": {
                "loadBalancer": {"simple": "LEAST_REQUEST"},
                "connectionPool": {"http": {"http2MaxRequests": 100000, "maxRequestsPerConnection": 0}, "tcp": {"maxConnections": 100000}},
            },
        },
    }  # fmt: skip
    return [gateway, service, rule]
