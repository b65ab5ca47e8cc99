"""`rewrite_config` changes exactly the fields a run needs, and the result still validates."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.stack.envoy import (
    CONFIG_NAMES,
    EnvoyError,
    RunSettings,
    body_limit_message,
    config_path,
    load_envoy_config,
    rewrite_config,
    validate_config_file,
)

LISTENER = "static_resources/listeners/0"
HCM = f"{LISTENER}/filter_chains/0/filters/0/typed_config"
EXT_PROC_GRPC = f"{LISTENER}/filter_chains/0/filters/0/typed_config/http_filters/1/typed_config/grpc_service/envoy_grpc"
EXTPROC_EP = "static_resources/clusters/{i}/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address"


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{"a/b/0/c": leaf} for every leaf of a parsed YAML tree."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    a, b = _flatten(before), _flatten(after)
    return {k: b.get(k, "<removed>") for k in a.keys() | b.keys() if a.get(k, "<absent>") != b.get(k, "<absent>")}


def _cluster_index(cfg: dict[str, Any], name: str) -> int:
    return [c["name"] for c in cfg["static_resources"]["clusters"]].index(name)


FULL = RunSettings(
    listener=("127.0.0.1", 18080),
    admin=("127.0.0.1", 19901),
    extproc=("127.0.0.1", 19002),
    endpoints=[("127.0.0.1", 18001), ("127.0.0.1", 18002), ("127.0.0.1", 18003)],
    max_body_bytes=1024 * 1024,
    grpc_max_message_bytes=2 * 1024 * 1024,
)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_full_rewrite_changes_exactly_the_run_fields(name: str) -> None:
    original = load_envoy_config(name)
    pristine = copy.deepcopy(original)
    out = rewrite_config(original, FULL)
    assert original == pristine, "the input must not be modified"
    ext = _cluster_index(out, "llm_extproc")
    expected = {
        "admin/address/socket_address/port_value": 19901,
        f"{LISTENER}/address/socket_address/address": "127.0.0.1",
        f"{LISTENER}/address/socket_address/port_value": 18080,
        f"{LISTENER}/per_connection_buffer_limit_bytes": 1024 * 1024,
        f"{EXT_PROC_GRPC}/max_receive_message_length": 2 * 1024 * 1024,
        f"{EXTPROC_EP.format(i=ext)}/port_value": 19002,
        # Envoy's own 413 states the limit it enforces.
        f"{HCM}/local_reply_config/mappers/0/body_format_override/json_format/error/message": body_limit_message(1024 * 1024),
    }
    if name in ("fail-open", "tier"):
        fb = _cluster_index(out, "llm_fallback")
        base = f"static_resources/clusters/{fb}/load_assignment/endpoints/0/lb_endpoints"
        expected[f"{base}/0/endpoint/address/socket_address/port_value"] = 18001
        expected[f"{base}/1/endpoint/address/socket_address/port_value"] = 18002
        expected[f"{base}/2/endpoint/address/socket_address/address"] = "127.0.0.1"
        expected[f"{base}/2/endpoint/address/socket_address/port_value"] = 18003
    # Values equal to the shipped defaults (127.0.0.1 admin/ext_proc hosts) do not show as changes.
    assert _changed(original, out) == expected


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_default_settings_only_move_listener_and_admin_to_ephemeral_localhost(name: str) -> None:
    original = load_envoy_config(name)
    assert _changed(original, rewrite_config(original, RunSettings())) == {
        "admin/address/socket_address/port_value": 0,
        f"{LISTENER}/address/socket_address/address": "127.0.0.1",
        f"{LISTENER}/address/socket_address/port_value": 0,
    }


def test_nothing_to_change_is_a_copy() -> None:
    original = load_envoy_config("fail-open")
    assert rewrite_config(original, RunSettings(listener=None, admin=None)) == original


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_rewritten_config_still_validates(name: str, tmp_path: Path) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(rewrite_config(load_envoy_config(name), FULL)))
    assert "OK" in validate_config_file(path)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (RunSettings(grpc_max_message_bytes=4 * 1024 * 1024), "max_receive_message_length"),
        (RunSettings(max_body_bytes=8 * 1024 * 1024), "max_receive_message_length"),
        (RunSettings(endpoints=[]), "endpoints must not be empty"),
    ],
    ids=["grpc-limit-not-above-body", "body-limit-reaches-grpc-limit", "no-endpoints"],
)
def test_inconsistent_settings_are_refused(settings: RunSettings, message: str) -> None:
    with pytest.raises(EnvoyError, match=message):
        rewrite_config(load_envoy_config("fail-open"), settings)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"admin": {}}, "admin address"),
        ({"admin": {"address": {}}, "static_resources": {"listeners": []}}, "exactly one static listener"),
    ],
    ids=["no-admin-address", "no-listener"],
)
def test_unexpected_shape_is_a_clear_error(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvoyError, match=message):
        rewrite_config(cfg, RunSettings())


def test_unknown_config_name_or_file(tmp_path: Path) -> None:
    with pytest.raises(EnvoyError, match="cannot read"):
        load_envoy_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(EnvoyError, match="must be a mapping"):
        load_envoy_config(bad)
    with pytest.raises(EnvoyError, match="unknown Envoy config"):
        config_path("no-such-config")
