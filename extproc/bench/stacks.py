"""The local stack for one routing policy: a simulator fleet plus the front the policy needs.

    stack = PolicyStack(POLICIES["llm-extproc"], settings, workdir=Path("/tmp/run"))
    await stack.start()      # simulators, then llm-extproc, then Envoy (each waits for ready)
    ... stack.url ...        # where clients (the load generator) send requests
    await stack.aclose()     # reverse order, every child stopped by PID

Fronts, by `Policy.kind`:
  - `extproc`: Envoy on `envoy/fail-open.yaml` + `llm-extproc serve` with the policy's profile;
  - `envoy`: Envoy alone: the fail-open config without the ext_proc filter (and its cluster),
    the fallback cluster's `lb_policy` set to the policy's (`envoy_only_config`);
  - `peer`: sglang-router or vllm-router started on the fleet's URLs, talked to directly.
    DESIGN 10's gotchas: each router gets its own `--prometheus-port` (both default to 29000),
    `HF_ENDPOINT` points at a closed local port so sglang-router never tries the hub for a
    tokenizer, and the simulators answer vllm-router's `/tokenize` calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from extproc.bench.policies import Policy
from extproc.sim.profiles import PROFILES, SIM_TOKENIZER
from extproc.stack.envoy import FALLBACK_CLUSTER, EnvoyError, EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.fleet import DEFAULT_FLEET, Fleet, LoraFleet
from extproc.stack.pd import SidecarProcess
from extproc.stack.ports import free_ports
from extproc.stack.procs import ChildHandle, ManagedProcess, wait_until
from extproc.stack.server import ExtProcServerProcess

__all__ = [
    "PortBusyError", "PolicyStack", "StackSettings", "check_port_free", "envoy_only_config", "merge_config",
    "policy_server_config", "server_config",
]

_HCM = "envoy.filters.network.http_connection_manager"
_EXT_PROC = "envoy.filters.http.ext_proc"
ENVOY_LB_POLICIES = ("ROUND_ROBIN", "LEAST_REQUEST", "RANDOM")


class PortBusyError(OSError):
    """A fixed port asked for is already in use (the message says which and what to do)."""


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise `PortBusyError` when `host:port` cannot be bound (port 0 always passes).

    Raises:
        PortBusyError: the port is taken, or not ours to bind (the message names it).
    """
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise PortBusyError(
                f"port {port} on {host} {why}; stop whatever holds it or pick another with --port (0 = any free port)"
            ) from None


@dataclass(frozen=True, slots=True)
class StackSettings:
    """How to run the fleet and the front.

    Attributes:
        profiles: simulator profile per endpoint.
        speed: simulated seconds per wall second (the simulators' `--speed`).
        stream_interval: output tokens per SSE chunk (the simulators' `--stream-interval`).
        seed: simulator seeds start here (endpoint i: seed + i).
        port: the client-facing port (Envoy's listener or the peer router); 0 = any free one.
        envoy_concurrency: Envoy worker threads.
        server_overrides: merged into llm-extproc's generated config (`merge_config`) for
            llm-extproc policies, e.g. `{"scheduling": {"profiles": {"load-aware": {...}}}}` to
            try other scorer weights on the same requests.
        roles: P/D role per endpoint (`prefill`, `decode`, `both`; same length as `profiles`),
            or None for a unified fleet. Each decode engine gets a `pd-sidecar` in front, which
            the router and Envoy route to instead of the engine.
        lora: LoRA adapters the simulators serve (`--fleet lora`), or None; the generated config
            lists them as the model's `adapters`.
    """

    profiles: Sequence[str] = DEFAULT_FLEET
    speed: float = 1.0
    stream_interval: int = 8
    seed: int = 0
    port: int = 0
    envoy_concurrency: int = 2
    server_overrides: Mapping[str, Any] | None = None
    roles: Sequence[str] | None = None
    lora: LoraFleet | None = None


def envoy_only_config(cfg: Mapping[str, Any], lb_policy: str) -> dict[str, Any]:
    """A copy of a fail-open config with llm-extproc taken out: Envoy alone balances the engines.

    Removes the ext_proc HTTP filter and the cluster it calls, and sets the fallback cluster's
    `lb_policy` (every request takes the fallback route, since no routing header survives the
    header-stripping filters). `cfg` is untouched.

    Raises:
        EnvoyError: the config is not shaped like ours (no listener HCM, no ext_proc filter, no
            fallback cluster), or `lb_policy` is not one of `ENVOY_LB_POLICIES`.
    """
    if lb_policy not in ENVOY_LB_POLICIES:
        raise EnvoyError(f"lb_policy must be one of {', '.join(ENVOY_LB_POLICIES)}, got {lb_policy!r}")
    out = copy.deepcopy(dict(cfg))
    try:
        clusters = out["static_resources"]["clusters"]
        chains = out["static_resources"]["listeners"][0]["filter_chains"]
    except (KeyError, IndexError, TypeError):
        raise EnvoyError("Envoy config has no static listener or clusters") from None
    hcms = [f["typed_config"] for chain in chains for f in chain.get("filters", []) if f.get("name") == _HCM]
    if not hcms:
        raise EnvoyError(f"the listener has no {_HCM} filter")
    hcm = hcms[0]
    ext_procs = [f for f in hcm.get("http_filters", []) if f.get("name") == _EXT_PROC]
    if not ext_procs:
        raise EnvoyError(f"the config has no {_EXT_PROC} filter to remove")
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f.get("name") != _EXT_PROC]
    extproc_clusters = {f["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] for f in ext_procs}
    fallback = [c for c in clusters if c.get("name") == FALLBACK_CLUSTER]
    if not fallback:
        raise EnvoyError(f"the config has no {FALLBACK_CLUSTER!r} cluster")
    fallback[0]["lb_policy"] = lb_policy
    out["static_resources"]["clusters"] = [c for c in clusters if c.get("name") not in extproc_clusters]
    return out


def server_config(
    addresses: Mapping[str, str],
    *,
    profile: str,
    kv_events: Mapping[str, tuple[str, str | None]] | None = None,
    roles: Mapping[str, str] | None = None,
    lora: LoraFleet | None = None,
) -> dict[str, Any]:
    """llm-extproc's config for a simulated fleet: one model entry per served model.

    Args:
        addresses: simulator profile name by endpoint address (`ip:port`).
        profile: the scheduling profile.
        kv_events: (KV-event endpoint, replay endpoint) by address, for endpoints whose prefix
            index comes from their events (`Fleet.kv_events`).
        roles: P/D role by address, for those not `both`.
        lora: the adapters the simulators serve: each model's `adapters`, and their GPU slots
            as `scheduling.lora_max_loras`.

    Each model gets the architecture and context limit of its simulator profile, the tokenizer
    the simulator counts with (Qwen3's, whatever the profile's model) and its short name (the
    architecture's: `qwen3-8b`) as an alias; endpoints are
    labelled with their GPU and profile. Shutdown grace is short: a local run has nothing to drain.
    """
    models: dict[str, dict[str, Any]] = {}
    endpoints = []
    for address, name in addresses.items():
        p = PROFILES[name]
        models.setdefault(
            p.model,
            # The short name (`qwen3-8b`) as an alias, as deploy/config.example.yaml has it.
            {
                "name": p.model, "aliases": [p.arch_name], "tokenizer": SIM_TOKENIZER,
                "architecture": f"builtin:{p.arch_name}", "max_model_len": p.max_model_len,
            },  # fmt: skip
        )
        endpoints.append({"address": address, "models": [p.model], "labels": {"gpu": p.gpu.name, "profile": p.name}})
        if roles and roles.get(address, "both") != "both":
            endpoints[-1]["role"] = roles[address]
        if kv_events and address in kv_events:
            events, replay = kv_events[address]
            endpoints[-1].update({"kv_events": events, **({"kv_events_replay": replay} if replay else {})})
    scheduling: dict[str, Any] = {"profile": profile}
    if lora is not None:
        for m in models.values():
            m["adapters"] = list(lora.adapters)
        scheduling["lora_max_loras"] = lora.max_loras
    return {
        "limits": {"shutdown_grace_s": 2.0},
        "models": list(models.values()),
        "endpoints": endpoints,
        "scheduling": scheduling,
    }


def merge_config(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` laid over it: mappings merge key by key (recursively), the
    top-level `models` list entry by entry (`merge_models`), anything else (other lists
    included) replaces. Neither argument is changed.

    Raises:
        ValueError: a `models` entry names no model of `base` (`merge_models`).
    """
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if key == "models" and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = merge_models(out[key], value)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_models(base: Sequence[Any], overrides: Sequence[Any]) -> list[Any]:
    """`base`'s model entries, each with the `overrides` entry of the same `name` laid over it
    (`merge_config`): an overlay adds aliases, truncation, `max_model_len`, ... to the models the
    stack's fleet serves, and cannot add a model no simulator serves.

    Raises:
        ValueError: an override entry is not a mapping with a `name`, or names no model of `base`.
    """
    out = [copy.deepcopy(m) for m in base]
    by_name = {m.get("name"): i for i, m in enumerate(out) if isinstance(m, Mapping)}
    for i, entry in enumerate(overrides):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise ValueError(f"models[{i}] must be a mapping with the name of a model the fleet serves, got {entry!r}")
        if entry["name"] not in by_name:
            raise ValueError(
                f"models[{i}]: {entry['name']!r} is not served by the fleet; its models: {', '.join(map(str, by_name))}"
            )
        j = by_name[entry["name"]]
        out[j] = merge_config(out[j], entry)
    return out


def overlay_max_model_len(overrides: Mapping[str, Any] | None, profiles: Sequence[str]) -> int | None:
    """The `max_model_len` an overlay's `models` entry sets for the model the fleet of `profiles`
    serves (tokens), or None when it sets none."""
    served = {PROFILES[p].model for p in profiles}
    for entry in (overrides or {}).get("models") or ():
        if isinstance(entry, Mapping) and entry.get("name") in served and isinstance(entry.get("max_model_len"), int):
            return entry["max_model_len"]
    return None


def policy_server_config(
    policy: Policy,
    settings: StackSettings,
    addresses: Mapping[str, str],
    *,
    kv_events: Mapping[str, tuple[str, str | None]] | None = None,
    roles: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """llm-extproc's config for an `extproc` policy: `server_config` with the policy's profile,
    then the policy's own `server_overrides`, then `settings.server_overrides` laid over it.

    Args:
        addresses: simulator profile name by endpoint address (`ip:port`).
        kv_events: the simulators' KV-event endpoints, as `server_config` takes them (precise policies).
        roles: P/D role by address (`server_config`).

    Raises:
        ValueError: `policy` is not an llm-extproc policy (no profile).
    """
    if policy.profile is None:
        raise ValueError(f"{policy.name} is not an llm-extproc policy")
    cfg = server_config(addresses, profile=policy.profile, kv_events=kv_events, roles=roles, lora=settings.lora)
    for overrides in (policy.server_overrides, settings.server_overrides):
        cfg = merge_config(cfg, overrides or {})
    return cfg


def _message_timeout_s(cfg: Mapping[str, Any]) -> float | None:
    """Envoy's ext_proc `message_timeout` for llm-extproc's config `cfg` (seconds): above the
    longest flow-control queue wait when flow control is on (as `envoy-config` sets it; with the
    shipped 2 s a request queued past ~0.5 s got Envoy's 504), else None (the shipped value)."""
    from extproc.config.loader import config_from_mapping

    parsed = config_from_mapping(cfg)
    if not parsed.flow_control.enabled:
        return None
    return parsed.flow_control.message_timeout_s(parsed.limits.decision_timeout_ms)


class PolicyStack:
    """A fleet and the front for `policy`, started and stopped as one.

    Args:
        policy: what routes requests.
        settings: fleet and port settings.
        workdir: every child's log (`sim-<i>.log`, `llm-extproc.log`, `envoy.log`, `<peer>.log`).

    Nothing runs until `start()`.
    """

    def __init__(self, policy: Policy, settings: StackSettings, *, workdir: Path) -> None:
        self.policy = policy
        self.settings = settings
        self.workdir = Path(workdir)
        self.fleet = Fleet(
            settings.profiles,
            workdir=self.workdir,
            speed=settings.speed,
            stream_interval=settings.stream_interval,
            seed=settings.seed,
            load_shape="vllm-router" if policy.peer == "vllm-router" else "sglang",
            kv_events=policy.kv_events,
            # An overlay's max_model_len is the engines' too, for every policy's fleet alike, as on a
            # real fleet (where the check against each engine's /v1/models flags a difference).
            max_model_len=overlay_max_model_len(settings.server_overrides, settings.profiles),
            roles=settings.roles,
            lora=settings.lora,
        )
        self.sidecars: dict[str, SidecarProcess] = {}
        """The pd-sidecar in front of each decode engine, by the engine's address."""
        self.server: ExtProcServerProcess | None = None
        self.envoy: EnvoyProcess | None = None
        self.peer: ManagedProcess | None = None
        self._peer_port: int | None = None
        self._peer_metrics_port: int | None = None
        self._message_timeout_s: float | None = None

    @property
    def url(self) -> str:
        """Base URL clients send requests to."""
        if self.envoy is not None:
            return self.envoy.url
        if self.peer is not None:
            return f"http://127.0.0.1:{self._peer_port}"
        raise RuntimeError("the stack is not started")

    @property
    def endpoint_headers(self) -> tuple[str, ...]:
        """Response headers naming the endpoint that served (Envoy's `x-llm-endpoint`)."""
        return ("x-llm-endpoint",) if self.envoy is not None else ()

    def services(self) -> list[tuple[str, str]]:
        """`(what, URL)` of every started service, for people: front first, then admin pages."""
        out: list[tuple[str, str]] = [(f"{self.policy.name} (OpenAI API)", f"{self.url}/v1")]
        if self.envoy is not None:
            out.append(("Envoy admin", self.envoy.admin_url))
        if self.server is not None:
            out.append(("llm-extproc admin", f"{self.server.admin_url}/api/v1/endpoints"))
            out.append(("llm-extproc metrics", f"{self.server.admin_url}/metrics"))
        if self.peer is not None:
            out.append((f"{self.policy.peer} metrics", f"http://127.0.0.1:{self._peer_metrics_port}/metrics"))
        for sim in self.fleet.sims:
            role = f" {sim.role}" if sim.role != "both" else ""
            out.append((f"{sim.name} {sim.profile}{role}", f"{sim.url}/metrics  {sim.url}/sim/state"))
        for address, side in self.sidecars.items():
            out.append((f"{side.name} (pd-sidecar for {address})", f"http://{side.address}/v1"))
        return out

    def routed_endpoints(self) -> tuple[dict[str, str], dict[str, str]]:
        """(profile by address, P/D role by address) of what the router and Envoy route to:
        each decode engine's sidecar in its place, the others as they are."""
        profiles, roles = {}, {}
        for sim in self.fleet.sims:
            address = self.sidecars[sim.address].address if sim.address in self.sidecars else sim.address
            profiles[address], roles[address] = sim.profile, sim.role
        return profiles, roles

    async def _start_sidecars(self) -> None:
        prefillers = [s.address for s in self.fleet.sims if s.role in ("prefill", "both")]
        decoders = [s for s in self.fleet.sims if s.role == "decode"]
        for sim in decoders:
            self.sidecars[sim.address] = SidecarProcess(sim.url, prefillers, name=f"sidecar-{sim.name}", workdir=self.workdir)
        await asyncio.gather(*(side.start() for side in self.sidecars.values()))

    @property
    def pids(self) -> list[int]:
        """PIDs of every child started so far."""
        procs: list[ManagedProcess | None] = [self.peer]
        for owner in (self.envoy, self.server):
            with contextlib.suppress(RuntimeError):  # not spawned yet: no process
                procs.append(owner.process if owner is not None else None)
        procs += [side._proc for side in self.sidecars.values()]
        return [*self.fleet.pids, *(p.pid for p in procs if p is not None and p.pid is not None)]

    def exited_child(self) -> ManagedProcess | None:
        """The first child started that is no longer running (a simulator, a sidecar,
        llm-extproc, Envoy or the peer router), else None: `up` watches it, so a stack whose
        child died says so instead of answering 503s with nothing on its console."""
        handles: list[ChildHandle | None] = [*self.fleet.sims, *self.sidecars.values(), self.server, self.envoy]
        for handle in handles:
            if handle is not None and handle.exited:
                return handle.process
        if self.peer is not None and self.peer.pid is not None and not self.peer.running:
            return self.peer
        return None

    async def start(self) -> None:
        """Start the fleet, then the front; on any failure stop what started and raise.

        Raises:
            PortBusyError: `settings.port` is taken.
            ProcessError: a child exited or was not ready in time (with its log tail).
            EnvoyError: no Envoy binary or a config problem.
        """
        check_port_free(self.settings.port)
        try:
            await self.fleet.start()
            if any(s.role == "decode" for s in self.fleet.sims):
                await self._start_sidecars()
            if self.policy.kind == "peer":
                await self._start_peer()
            else:
                if self.policy.kind == "extproc":
                    await self._start_server()
                await self._start_envoy()
        except BaseException:
            await self.aclose()
            raise

    async def _start_server(self) -> None:
        path = self.workdir / "llm-extproc.yaml"
        profiles, roles = self.routed_endpoints()
        cfg = policy_server_config(self.policy, self.settings, profiles, kv_events=self.fleet.kv_events, roles=roles)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
        self._message_timeout_s = _message_timeout_s(cfg)
        self.server = ExtProcServerProcess(path, workdir=self.workdir, log_level="warning")
        await self.server.start()

    async def _start_envoy(self) -> None:
        base = load_envoy_config("fail-open")
        if self.policy.kind == "envoy":
            assert self.policy.envoy_lb_policy is not None
            base = envoy_only_config(base, self.policy.envoy_lb_policy)
        # Envoy's fallback (and an Envoy-only policy) balances over what can answer a request
        # alone: every engine but the prefill-only ones, decode engines through their sidecars.
        _, roles = self.routed_endpoints()
        endpoints = [("127.0.0.1", int(a.rsplit(":", 1)[1])) for a, role in roles.items() if role != "prefill"]
        cfg = rewrite_config(
            base,
            RunSettings(
                listener=("127.0.0.1", self.settings.port),
                extproc=self.server.grpc_address if self.server is not None else None,
                endpoints=endpoints,
                message_timeout_s=self._message_timeout_s,
            ),
        )
        self.envoy = EnvoyProcess(cfg, workdir=self.workdir, concurrency=self.settings.envoy_concurrency)
        await self.envoy.start()

    def _peer_argv(self, port: int, metrics_port: int) -> list[str]:
        assert self.policy.peer_module is not None and self.policy.peer_policy is not None
        return [
            sys.executable, "-m", self.policy.peer_module,
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *self.fleet.urls,
            "--policy", self.policy.peer_policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--log-level", "warn" if self.policy.peer == "sglang" else "warning",
        ]  # fmt: skip

    async def _start_peer(self, timeout_s: float = 60.0) -> None:
        reason = self.policy.unavailable()
        if reason is not None:
            raise RuntimeError(f"{self.policy.name}: {reason}")
        ports = free_ports(2)
        self._peer_port = self.settings.port or ports[0]
        self._peer_metrics_port = ports[1]
        # A closed local port as the hub: sglang-router asks it for a tokenizer and gets a refusal.
        env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
        self.peer = ManagedProcess(
            self._peer_argv(self._peer_port, self._peer_metrics_port),
            name=self.policy.name,
            log_path=self.workdir / f"{self.policy.name}.log",
            env=env,
        )
        self.peer.spawn()
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:

            async def ready() -> bool:
                return (await client.get(f"{self.url}/health")).status_code == 200

            await wait_until(ready, proc=self.peer, what="healthy", timeout_s=timeout_s, interval_s=0.1)

    async def aclose(self) -> None:
        """Stop the front, then llm-extproc, then the fleet (each by PID, bounded). Safe twice."""
        if self.envoy is not None:
            await self.envoy.aclose()
        if self.peer is not None:
            await self.peer.astop(10.0)
        if self.server is not None:
            await self.server.aclose(timeout_s=10.0)
        await asyncio.gather(*(side.aclose() for side in self.sidecars.values()), return_exceptions=True)
        await self.fleet.aclose()
