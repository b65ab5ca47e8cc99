"""deploy/inferencepool: llm-extproc as an InferencePool's endpoint picker.

What this machine can check: the core kinds (ServiceAccount, Role, RoleBinding, ConfigMap,
Deployment, Service) against the Kubernetes schemas offline (kubernetes-validate); the
InferencePool against a schema written here from the extension's v1 API types
(inference.networking.k8s.io/v1, api/v1/inferencepool_types.go: fields, enums, bounds); the
picker's config against llm-extproc's own schema; and the references between them. Not checked
(no API server, no CRDs here): the InferencePool's CEL rules, the Gateway and HTTPRoute
(gateway.networking.k8s.io) beyond their shape, and that a gateway accepts them.
"""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc.config.loader import config_from_mapping
from extproc.server.app import PICKER_HEALTH_SERVICES
from tests.deploy.conftest import DEPLOY, load_all

K8S_VERSION = "1.30.0"
POOL_DIR = DEPLOY / "inferencepool"
CORE_KINDS = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"}

_NAME = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_PORT = {"type": "object", "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}, "required": ["number"], "additionalProperties": False}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": _NAME, "namespace": _NAME}},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64, "additionalProperties": {"type": "string"}}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": _NAME,
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def objects() -> list[dict]:
    return [o for p in sorted(POOL_DIR.glob("*.yaml")) if p.name != "kustomization.yaml" for o in load_all(p)]


def one(kind: str) -> dict:
    (found,) = [o for o in objects() if o["kind"] == kind]
    return found


@pytest.mark.parametrize("obj", [o for o in objects() if o["kind"] in CORE_KINDS], ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_core_kinds_validate_against_the_kubernetes_schemas(obj):
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_object_is_a_kind_we_check():
    kinds = {o["kind"] for o in objects()}
    assert kinds == CORE_KINDS | {"InferencePool", "Gateway", "HTTPRoute"}


def test_inference_pool_matches_the_v1_api():
    pool = one("InferencePool")
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    # The API's CEL rule: a Service reference (the default kind) needs a port.
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref


def test_the_pool_points_at_the_picker_service_and_port():
    pool, service = one("InferencePool"), one("Service")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["appProtocol"] == "kubernetes.io/h2c", "ext_proc is gRPC: the gateway must speak HTTP/2"
    dep = one("Deployment")
    assert service["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[grpc["targetPort"]] == grpc["port"]


def test_the_route_sends_to_the_pool():
    route, pool = one("HTTPRoute"), one("InferencePool")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == ("inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert route["spec"]["parentRefs"][0]["name"] == one("Gateway")["metadata"]["name"]


def test_picker_config_loads_in_epp_mode_on_the_mounted_path():
    cm, dep = one("ConfigMap"), one("Deployment")
    cfg = config_from_mapping(yaml.safe_load(cm["data"]["config.yaml"]))
    assert cfg.protocol.mode == "epp"
    # The pool's pods come from the pool itself (discovery), not a list that goes stale.
    (source,) = cfg.discovery.sources
    assert source.type == "kubernetes" and source.inference_pool == one("InferencePool")["metadata"]["name"]
    assert not cfg.endpoints
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert container["args"] == ["serve", "--config", f"{mount['mountPath']}/config.yaml"]
    grpc_port = int(cfg.listen.grpc.rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port
        assert container[probe]["grpc"]["service"] in PICKER_HEALTH_SERVICES


def test_picker_can_read_what_discovery_watches():
    role, binding, dep = one("Role"), one("RoleBinding"), one("Deployment")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] if {"list", "watch"} <= set(rule["verbs"])}
    assert {("inference.networking.k8s.io", "inferencepools"), ("discovery.k8s.io", "endpointslices")} <= granted
    assert binding["subjects"][0]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]


def test_kustomization_lists_every_file():
    k = yaml.safe_load((POOL_DIR / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(p.name for p in POOL_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
