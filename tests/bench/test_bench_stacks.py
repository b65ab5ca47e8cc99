"""The per-policy stack's pure parts: Envoy-alone configs (validated by the real Envoy), the
server config for a simulated fleet, and the busy-port check."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from extproc.bench.policies import POLICIES
from extproc.bench.stacks import (
    PolicyStack, PortBusyError, StackSettings, check_port_free, envoy_only_config, merge_config, overlay_max_model_len,
    policy_server_config, server_config,
)
from extproc.config.loader import config_from_mapping
from extproc.stack.envoy import EnvoyError, RunSettings, load_envoy_config, rewrite_config, validate_config_file


def _filters(cfg: dict) -> list[str]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [f["name"] for f in hcm["http_filters"]]


@pytest.mark.parametrize("lb_policy", ["ROUND_ROBIN", "LEAST_REQUEST"], ids=["round-robin", "least-request"])
def test_envoy_only_config_drops_ext_proc_and_envoy_accepts_it(tmp_path: Path, lb_policy: str) -> None:
    original = load_envoy_config("fail-open")
    cfg = envoy_only_config(original, lb_policy)
    assert "envoy.filters.http.ext_proc" not in _filters(cfg)
    assert "envoy.filters.http.header_mutation" in _filters(cfg)  # clients still cannot pick
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    assert "llm_extproc" not in clusters and clusters["llm_fallback"]["lb_policy"] == lb_policy
    assert "envoy.filters.http.ext_proc" in _filters(original)  # the input is untouched
    run = rewrite_config(cfg, RunSettings(endpoints=[("127.0.0.1", 8001), ("127.0.0.1", 8002)]))
    path = tmp_path / "envoy-only.yaml"
    path.write_text(yaml.safe_dump(run), encoding="utf-8")
    validate_config_file(path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: c, "lb_policy must be one of"),
        (lambda c: c["static_resources"]["clusters"].pop(1), "no 'llm_fallback' cluster"),
        (lambda c: c["static_resources"].pop("listeners"), "no static listener"),
    ],
    ids=["bad-lb-policy", "no-fallback-cluster", "no-listener"],
)
def test_envoy_only_config_errors(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    cfg = load_envoy_config("fail-open")
    mutate(cfg)
    with pytest.raises(EnvoyError, match=message):
        envoy_only_config(cfg, "MAGLEV" if message.startswith("lb_policy") else "ROUND_ROBIN")


def test_envoy_only_config_needs_an_ext_proc_filter_to_remove() -> None:
    once = envoy_only_config(load_envoy_config("fail-open"), "ROUND_ROBIN")
    with pytest.raises(EnvoyError, match="no envoy.filters.http.ext_proc filter"):
        envoy_only_config(once, "ROUND_ROBIN")


def test_server_config_is_valid_and_labels_each_endpoint() -> None:
    fleet = {"127.0.0.1:9001": "h100-qwen3-8b", "127.0.0.1:9002": "a100-qwen3-8b"}
    cfg = config_from_mapping(server_config(fleet, profile="least-inflight"))
    (model,) = cfg.models  # both engines serve Qwen3-8B: one model entry
    assert model.name == "Qwen/Qwen3-8B" and model.architecture == "builtin:qwen3-8b"
    assert model.aliases == ["qwen3-8b"]  # the short name `up` users type, as in the example config
    assert model.max_model_len == 40960  # Qwen3-8B's max_position_embeddings, what the simulator enforces
    assert [(e.address, e.labels["gpu"], e.labels["profile"]) for e in cfg.endpoints] == [
        ("127.0.0.1:9001", "h100", "h100-qwen3-8b"),
        ("127.0.0.1:9002", "a100", "a100-qwen3-8b"),
    ]
    assert cfg.scheduling.profile == "least-inflight"


def test_server_config_subscribes_to_kv_events_where_published() -> None:
    fleet = {"127.0.0.1:9001": "h100-qwen3-8b", "127.0.0.1:9002": "h100-qwen3-8b"}
    events = {"127.0.0.1:9001": ("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002")}
    cfg = config_from_mapping(server_config(fleet, profile="load-aware", kv_events=events))
    assert [(e.kv_events, e.kv_events_replay) for e in cfg.endpoints] == [
        ("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"),
        (None, None),
    ]


def test_merge_config_lays_mappings_over_and_replaces_the_rest() -> None:
    base = {"scheduling": {"profile": "load-aware", "metrics": {"interval_s": 0.1}}, "endpoints": [1, 2]}
    out = merge_config(base, {"scheduling": {"metrics": {"timeout_s": 0.2}}, "endpoints": [3]})
    assert out == {"scheduling": {"profile": "load-aware", "metrics": {"interval_s": 0.1, "timeout_s": 0.2}}, "endpoints": [3]}
    assert base["scheduling"]["metrics"] == {"interval_s": 0.1}  # untouched


def test_policy_server_config_lays_the_policy_then_the_run_over_the_fleet() -> None:
    """`llm-extproc-noprefix` runs the default profile with the prefix index off; a run's own
    `--extproc-config` still goes last."""
    fleet = {"127.0.0.1:9001": "h100-qwen3-8b"}
    settings = StackSettings(server_overrides={"scheduling": {"explain_header": True}})
    cfg = config_from_mapping(policy_server_config(POLICIES["llm-extproc-noprefix"], settings, fleet))
    assert cfg.scheduling.profile == "load-aware" and not cfg.scheduling.prefix.enabled and cfg.scheduling.explain_header
    assert config_from_mapping(policy_server_config(POLICIES["llm-extproc"], StackSettings(), fleet)).scheduling.prefix.enabled
    with pytest.raises(ValueError, match="not an llm-extproc policy"):
        policy_server_config(POLICIES["envoy-least-request"], settings, fleet)


def test_an_overlays_models_are_laid_over_the_fleets_by_name(tmp_path: Path) -> None:
    """`up --extproc-config` refused `models`: aliases, truncation and max_model_len could not
    be tried with the stack. An entry now lays its fields over the fleet's model of that name,
    and the simulators get its max_model_len too."""
    fleet = {"127.0.0.1:9001": "h100-qwen3-8b"}
    overlay = {"models": [{"name": "Qwen/Qwen3-8B", "aliases": ["fast"], "max_model_len": 8192, "truncation": "head-tail"}]}
    settings = StackSettings(profiles=("h100-qwen3-8b",), server_overrides=overlay)
    (model,) = config_from_mapping(policy_server_config(POLICIES["llm-extproc"], settings, fleet)).models
    assert (model.aliases, model.max_model_len, model.truncation.mode) == (["fast"], 8192, "head-tail")
    assert (model.tokenizer, model.architecture) == ("builtin:qwen3", "builtin:qwen3-8b")  # kept from the fleet's
    assert overlay_max_model_len(overlay, ("h100-qwen3-8b",)) == 8192
    assert overlay_max_model_len({"limits": {}}, ("h100-qwen3-8b",)) is None
    for policy in ("llm-extproc", "envoy-least-request"):  # every policy's engines alike
        argv = PolicyStack(POLICIES[policy], settings, workdir=tmp_path).fleet.sims[0].argv()
        assert argv[argv.index("--max-model-len") + 1] == "8192"
    with pytest.raises(ValueError, match="'meta-llama/Llama-3.1-8B-Instruct' is not served by the fleet; its models: Qwen/Qwen3-8B"):
        merge_config(server_config(fleet, profile="load-aware"), {"models": [{"name": "meta-llama/Llama-3.1-8B-Instruct"}]})


def test_check_port_free() -> None:
    check_port_free(0)  # any port: nothing to check
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortBusyError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free(port)
    check_port_free(port)  # released: free again
