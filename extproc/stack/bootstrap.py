"""The Envoy bootstrap for a deployment, from llm-extproc's own configuration.

Endpoints are typed once: `llm-extproc envoy-config --config FILE` loads a shipped template
(`envoy/fail-open.yaml` or `envoy/fail-closed.yaml`, the same files `envoy --mode validate`
checks in the tests) and substitutes only what the deployment decides — the listener and admin
addresses, llm-extproc's gRPC address (the `llm_extproc` cluster), the fail-open fallback
cluster's endpoints (every configured endpoint), the body / gRPC message limits (equal to
`limits.max_body_bytes` / `limits.grpc_max_message_bytes`, so both layers draw the line at the
same byte), and the headers the config trusts (`ratelimit.tenant_header`,
`admission.priority.trusted_header`, flow control's trusted headers) added to those stripped
from clients, and with flow control on, the ext_proc `message_timeout` raised above the longest
queue wait (`FlowControlConfig.message_timeout_s`). Everything else — header stripping, the ext_proc filter, the `ORIGINAL_DST`
cluster, error mapping — comes from the template as shipped, so a later edit to the shipped
YAML flows into every generated file.
"""

from __future__ import annotations

from typing import Any

import yaml

from extproc.config.schema import Config, parse_host_port
from extproc.stack.envoy import EnvoyError, RunSettings, config_path, load_envoy_config, rewrite_config, strip_request_headers

__all__ = ["TEMPLATES", "envoy_bootstrap", "render_bootstrap"]

TEMPLATES = ("fail-open", "fail-closed")
"""Shipped configs `envoy_bootstrap` fills in (tier mode needs per-tier membership and node-agent
health ports that llm-extproc's config does not hold: envoy/tier.yaml is edited by hand)."""

_ANY_HOST = {"0.0.0.0", "::", ""}


def _host_port(value: str) -> tuple[str, int]:
    host, port = parse_host_port(value)
    return host.strip("[]"), port


def envoy_bootstrap(
    cfg: Config,
    *,
    template: str = "fail-open",
    listener: str = "0.0.0.0:8080",
    admin: str = "127.0.0.1:9901",
    extproc: str | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """The Envoy bootstrap (a parsed YAML mapping) for `cfg`.

    Args:
        cfg: llm-extproc's validated configuration (endpoints, listen address, limits).
        template: `fail-open` (fallback cluster over the same endpoints) or `fail-closed`.
        listener: `host:port` of Envoy's client-facing listener.
        admin: `host:port` of Envoy's admin API.
        extproc: `host:port` where Envoy reaches llm-extproc's gRPC server; default
            `listen.grpc`, with a wildcard host (0.0.0.0) read as 127.0.0.1 (a sidecar).
        workers: `serve --workers N`: the cluster lists ports port .. port + N − 1, health-checked.

    Raises:
        EnvoyError: epp or tier mode, an unknown template, a malformed address, a worker count that
            runs past port 65535, or a template whose fields are not where the shipped ones keep them.
    """
    if cfg.protocol.mode == "epp":
        raise EnvoyError(
            "protocol.mode is epp: the picker of a gateway that configures it itself (Envoy Gateway, Istio, "
            "kgateway, GKE: an InferencePool's endpointPickerRef), which these BUFFERED templates are not; "
            "see docs/epp.md (deploy/inferencepool), or set protocol.mode: buffered for our own Envoy"
        )
    if cfg.scheduling.mode == "tier":
        raise EnvoyError(
            "scheduling.mode is tier: its Envoy clusters (one per tier, health-checked through the node agents' "
            "HTTP ports) are not in llm-extproc's config; start from envoy/tier.yaml"
        )
    if template not in TEMPLATES:
        raise EnvoyError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")
    if not cfg.endpoints:
        raise EnvoyError(
            "the configuration lists no endpoints: a fleet found by dns or kubernetes discovery is not known when the "
            "bootstrap is written; list the fallback endpoints, or point the llm_fallback cluster at your Service by hand"
        )
    try:
        grpc_host, grpc_port = _host_port(extproc or cfg.listen.grpc)
        grpc_host = "127.0.0.1" if grpc_host in _ANY_HOST else grpc_host
        if workers < 1 or grpc_port + workers - 1 > 65535:
            raise ValueError(f"{workers} workers from port {grpc_port}: need 1 or more, ports up to 65535")
        settings = RunSettings(
            listener=_host_port(listener),
            admin=_host_port(admin),
            extproc=(grpc_host, grpc_port),
            extproc_replicas=[(grpc_host, grpc_port + i) for i in range(1, workers)],
            endpoints=[_host_port(e.address) for e in cfg.endpoints],
            max_body_bytes=cfg.limits.max_body_bytes,
            grpc_max_message_bytes=cfg.limits.grpc_max_message_bytes,
            message_timeout_s=(
                cfg.flow_control.message_timeout_s(cfg.limits.decision_timeout_ms) if cfg.flow_control.enabled else None
            ),
        )
    except ValueError as exc:
        raise EnvoyError(str(exc)) from None
    boot = rewrite_config(load_envoy_config(template), settings)
    # Headers this config trusts (a layer after Envoy's strip sets them): a client's copy must
    # go, as the shipped x-llm-tenant does, or any client names any tenant or claims `critical`.
    trusted = [cfg.ratelimit.tenant_header, cfg.admission.priority.trusted_header, *cfg.flow_control.trusted_headers]
    strip_request_headers(boot, [h for h in trusted if h])
    return boot


def render_bootstrap(bootstrap: dict[str, Any], *, template: str, source: str) -> str:
    """`bootstrap` as YAML text, headed by a comment naming the template and the config it
    came from (the template's own comments explain each setting)."""
    head = (
        f"# Generated by `llm-extproc envoy-config` from {source} and the shipped template "
        f"{config_path(template).name}\n# (read that file for why each setting is what it is). "
        "Regenerate rather than edit.\n"
    )
    return head + yaml.safe_dump(bootstrap, sort_keys=False)
