"""The routing policies `demo` and `bench` can put in front of the fleet, by name.

| name                         | front                                   | what picks the endpoint                  |
|------------------------------|-----------------------------------------|------------------------------------------|
| `envoy-round-robin`          | Envoy alone (fail-open config, ext_proc filter removed) | Envoy `ROUND_ROBIN`          |
| `envoy-least-request`        | Envoy alone                             | Envoy `LEAST_REQUEST` (power of two choices) |
| `llm-extproc`                | Envoy + llm-extproc                     | the server's default profile (`load-aware`) |
| `llm-extproc-<profile>`      | Envoy + llm-extproc                     | built-in profile `<profile>`             |
| `llm-extproc-precise`        | Envoy + llm-extproc, simulators publishing KV events | default profile, prefix index from the engines' KV events |
| `llm-extproc-noprefix`       | Envoy + llm-extproc                     | the default profile with `scheduling.prefix.enabled: false` (prefix-blind load-aware) |
| `llm-extproc-lora`           | Envoy + llm-extproc                     | built-in profile `lora`: the default plus `lora-affinity-scorer` (residency) |
| `llm-extproc-lora-activity`  | Envoy + llm-extproc                     | profile `lora` with GIE's activity-only rule (`lora-activity-scorer`) in place of residency |
| `sglang-cache-aware`, `sglang-power-of-two` | sglang-router (replaces Envoy) | `--policy cache_aware` / `power_of_two` |
| `vllm-router-cache-aware`, `vllm-router-kv-aware`, `vllm-router-consistent-hash` | vllm-router (replaces Envoy) | `--policy cache_aware` / `kv_aware` / `consistent_hash` |

Peers come from the optional `bench` extra (`pip install 'llm-extproc[bench]'`); the load
generator talks to a peer router directly, since a peer replaces Envoy + llm-extproc.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["DEFAULT_PROFILE", "EXTPROC_PROFILES", "POLICIES", "Policy", "PolicyError", "parse_policies", "policy_names"]

# The server's built-in scheduling profiles and its default (`extproc.config.schema`), spelled
# out so that `llm-extproc --help` need not import the config schema (~0.4 s); a test checks
# they match the schema.
EXTPROC_PROFILES: tuple[str, ...] = ("load-aware", "least-inflight", "compute-aware", "random", "prefix", "lora")
DEFAULT_PROFILE = "load-aware"


class PolicyError(ValueError):
    """An unknown policy name (the message lists the known ones)."""


@dataclass(frozen=True, slots=True)
class Policy:
    """One routing policy.

    Attributes:
        name: the CLI name (`envoy-least-request`, `llm-extproc-random`, ...).
        kind: `envoy` (Envoy alone), `extproc` (Envoy + llm-extproc) or `peer` (another router).
        description: one line for help texts.
        envoy_lb_policy: Envoy's `lb_policy` for `envoy` policies.
        profile: llm-extproc's `scheduling.profile` for `extproc` policies.
        peer: `sglang` or `vllm-router` for `peer` policies.
        peer_policy: the peer's own `--policy` value.
        kv_events: the simulators publish KV-cache events and llm-extproc subscribes to them
            (the precise prefix index, `extproc.prefix.precise`).
        server_overrides: laid over llm-extproc's generated config for this policy (before
            `bench --extproc-config`), e.g. `{"scheduling": {"prefix": {"enabled": False}}}`.
    """

    name: str
    kind: Literal["envoy", "extproc", "peer"]
    description: str
    envoy_lb_policy: str | None = None
    profile: str | None = None
    peer: Literal["sglang", "vllm-router"] | None = None
    peer_policy: str | None = None
    kv_events: bool = False
    server_overrides: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    @property
    def peer_module(self) -> str | None:
        """The peer's Python launcher module (`python -m <module>`)."""
        return {"sglang": "sglang_router.launch_router", "vllm-router": "vllm_router.launch_router"}.get(self.peer or "")

    @property
    def peer_package(self) -> str | None:
        """The PyPI distribution that provides the peer."""
        return {"sglang": "sglang-router", "vllm-router": "vllm-router"}.get(self.peer or "")

    def unavailable(self) -> str | None:
        """Why this policy cannot run here (a peer whose wheel is missing), or None."""
        module = self.peer_module
        if module is None:
            return None
        if importlib.util.find_spec(module.partition(".")[0]) is None:
            return f"{self.peer_package} is not installed (pip install 'llm-extproc[bench]')"
        return None


def _lora_scorers(lora_scorer: str) -> list[dict[str, Any]]:
    """The built-in `lora` profile's scorers (`extproc.config.schema`) with `lora_scorer` in
    place of `lora-affinity-scorer` (a test checks the rest match)."""
    weights = [
        ("ttft-estimate-scorer", 10.0), (lora_scorer, 10.0), ("queue-depth-scorer", 1.0), ("kv-utilization-scorer", 1.0),
        ("flops-load-scorer", 1.0), ("compute-aware-scorer", 1.0), ("backpressure-scorer", 0.5), ("inflight-scorer", 2.0),
        ("session-affinity-scorer", 1.0), ("weight-override-scorer", 1.0),
    ]  # fmt: skip
    return [{"type": t, "weight": w} for t, w in weights]


def _build() -> dict[str, Policy]:
    policies = [
        Policy("envoy-round-robin", "envoy", "Envoy alone, ROUND_ROBIN", envoy_lb_policy="ROUND_ROBIN"),
        Policy("envoy-least-request", "envoy", "Envoy alone, LEAST_REQUEST", envoy_lb_policy="LEAST_REQUEST"),
        Policy("llm-extproc", "extproc", f"Envoy + llm-extproc, default profile ({DEFAULT_PROFILE})", profile=DEFAULT_PROFILE),
    ]
    policies += [
        Policy(f"llm-extproc-{p}", "extproc", f"Envoy + llm-extproc, profile {p}", profile=p) for p in EXTPROC_PROFILES
    ]
    policies.append(
        Policy(
            "llm-extproc-precise", "extproc", "Envoy + llm-extproc, prefix index from KV events",
            profile=DEFAULT_PROFILE, kv_events=True,
        )
    )
    policies.append(
        Policy(
            "llm-extproc-noprefix",
            "extproc",
            "Envoy + llm-extproc, no prefix index",
            profile=DEFAULT_PROFILE,
            server_overrides={"scheduling": {"prefix": {"enabled": False}}},
        )
    )
    policies.append(
        Policy(
            "llm-extproc-lora-activity",
            "extproc",
            "profile lora, GIE's activity-only LoRA rule",
            profile="lora",
            server_overrides={"scheduling": {"profiles": {"lora": {"scorers": _lora_scorers("lora-activity-scorer")}}}},
        )
    )
    for peer, label, peer_policy in [
        ("sglang", "sglang", "cache_aware"),
        ("sglang", "sglang", "power_of_two"),
        ("vllm-router", "vllm-router", "cache_aware"),
        ("vllm-router", "vllm-router", "kv_aware"),
        ("vllm-router", "vllm-router", "consistent_hash"),
    ]:
        name = f"{label}-{peer_policy.replace('_', '-')}"
        policies.append(
            Policy(name, "peer", f"{peer.removesuffix('-router')}-router alone, --policy {peer_policy}", peer=peer, peer_policy=peer_policy)  # type: ignore[arg-type]
        )
    return {p.name: p for p in policies}


POLICIES: dict[str, Policy] = _build()
"""Every policy by name, in a stable order (Envoy, llm-extproc, peers)."""


def policy_names() -> list[str]:
    """All policy names, in `POLICIES` order."""
    return list(POLICIES)


def parse_policies(spec: str | Iterable[str]) -> list[Policy]:
    """Policies from a comma-separated list (or names); `all` expands to every policy.

    Duplicates are dropped, order kept.

    Raises:
        PolicyError: an unknown name, or an empty list.
    """
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [n for n in names if n]
    if not names:
        raise PolicyError("no policy given; known: " + ", ".join(POLICIES))
    out: list[Policy] = []
    for name in names:
        chosen = list(POLICIES.values()) if name == "all" else [POLICIES.get(name)]
        if chosen == [None]:
            raise PolicyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)} (or all)")
        out += [p for p in chosen if p is not None and p not in out]
    return out
