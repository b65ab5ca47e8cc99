"""A fleet of simulated vLLM endpoints, each `llm-extproc sim` in its own subprocess.

    fleet = Fleet(DEFAULT_FLEET, workdir=Path("/tmp/run"), speed=1.0, stream_interval=8)
    await fleet.start()          # all in parallel; each binds port 0 and reports its URL
    ... fleet.addresses ...      # ["127.0.0.1:41234", ...] in profile order
    await fleet.aclose()         # SIGTERM by PID, bounded wait, SIGKILL

Every simulator runs in its own process (never in the caller's: a load generator sharing a
process with four engine loops would measure its own CPU contention). Each binds port 0 and
prints `sim listening on http://HOST:PORT ...` (see `extproc.sim.cli`); we read the port from its
log, so concurrent fleets on one host never race for a port. A fleet is started once: to get
empty caches and queues, start a new one.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from extproc.sim.profiles import PROFILES
from extproc.stack.procs import ChildHandle, ManagedProcess, ProcessError, wait_until

__all__ = ["DEFAULT_FLEET", "PD_FLEET", "Fleet", "LoraFleet", "NamedFleet", "NAMED_FLEETS", "SimProcess", "SIM_ROLES", "adapter_names", "fleet_spec"]

DEFAULT_FLEET: tuple[str, ...] = ("h100-qwen3-8b", "h100-qwen3-8b", "a100-qwen3-8b", "a100-qwen3-8b")
"""The demo and bench fleet: two H100 and two A100 engines serving Qwen3-8B (mixed speeds)."""

PD_FLEET: tuple[tuple[str, str], ...] = (
    ("h100-qwen3-8b", "prefill"), ("h100-qwen3-8b", "prefill"), ("h100-qwen3-8b", "decode"), ("h100-qwen3-8b", "decode"),
)
"""`up --fleet pd`: two prefill and two decode H100 engines serving Qwen3-8B, (profile, role)
each; the decode ones behind `llm-extproc pd-sidecar` (`extproc.stack.pd`)."""

SIM_ROLES = ("prefill", "decode", "both")
"""A simulator's P/D roles (`sim --role`)."""


def adapter_names(n: int) -> list[str]:
    """Adapter names of a simulated LoRA fleet: `adapter-00` … (at least two digits)."""
    width = max(2, len(str(n - 1)))
    return [f"adapter-{i:0{width}d}" for i in range(n)]


@dataclass(frozen=True, slots=True)
class LoraFleet:
    """LoRA adapters every simulator of a fleet serves (`llm-extproc sim --lora-modules ...`).

    Attributes:
        adapters: adapter names.
        max_loras / max_cpu_loras: GPU slots / host-cached adapters per engine.
        rank: the adapters' rank (sizes their load time, `extproc.sim.lora`).
        metrics: the LoRA metric generation the simulators export (`residency` or `activity`).
    """

    adapters: tuple[str, ...]
    max_loras: int = 4
    max_cpu_loras: int = 8
    rank: int = 16
    metrics: str = "residency"

    def sim_args(self) -> list[str]:
        """The simulator's LoRA options."""
        return [
            "--lora-modules", ",".join(self.adapters), "--max-loras", str(self.max_loras),
            "--max-cpu-loras", str(self.max_cpu_loras), "--lora-rank", str(self.rank), "--lora-metrics", self.metrics,
        ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class NamedFleet:
    """What a `--fleet` value names: simulator profiles, their P/D roles and LoRA adapters.

    Attributes:
        profiles: one simulator profile per engine.
        roles: P/D role per engine (same length as `profiles`), or None: every one `both`.
        lora: the adapters every engine serves, or None.
    """

    profiles: tuple[str, ...]
    roles: tuple[str, ...] | None = None
    lora: LoraFleet | None = None


NAMED_FLEETS: dict[str, NamedFleet] = {
    "pd": NamedFleet(tuple(p for p, _ in PD_FLEET), tuple(r for _, r in PD_FLEET)),
    "lora": NamedFleet(("h100-qwen3-8b",) * 4, lora=LoraFleet(tuple(adapter_names(32)))),
}
"""Fleets `--fleet` accepts by name. `pd`: `PD_FLEET`. `lora`: four H100 engines serving
Qwen3-8B with 32 rank-16 adapters, 4 GPU slots and 8 host-cached each (the issue's measurement
setting)."""


def fleet_spec(value: str, default: Sequence[str] = ()) -> NamedFleet:
    """A `--fleet` value: a name of `NAMED_FLEETS`, else simulator profiles separated by commas
    (`default` when it names none). The profiles are not checked against `PROFILES` here."""
    named = NAMED_FLEETS.get(value.strip())
    if named is not None:
        return named
    return NamedFleet(tuple(p.strip() for p in value.split(",") if p.strip()) or tuple(default))

_READY = re.compile(r"^sim listening on (http://([0-9.]+):(\d+)) (.*)$", re.MULTILINE)
_KV_EVENTS = re.compile(r"\bkv_events=(tcp://\S+)")
_KV_REPLAY = re.compile(r"\bkv_replay=(tcp://\S+)")


class SimProcess(ChildHandle):
    """One `llm-extproc sim` child on 127.0.0.1, port picked by the simulator itself.

    Args:
        profile: engine profile name (`extproc.sim.profiles.PROFILES`).
        name: label for logs and errors (`sim-0`); the log is `<workdir>/<name>.log`.
        workdir: where the log goes.
        speed: simulated seconds per wall second.
        stream_interval: output tokens per streamed chunk (vLLM `--stream-interval`).
        seed: the simulator's seed.
        load_shape: `/get_load` body shape (`sglang` or `vllm-router`).
        port: the port to listen on; 0 lets the simulator pick (a restart on the same port
            passes the previous run's `port`).
        kv_events: publish vLLM KV-cache events (and serve their replay), each on a free port;
            `kv_events_endpoint` / `kv_events_replay` name them once started.
        max_model_len: the simulator's context limit (tokens; `sim --max-model-len`), or None
            for the profile's.
        role: its P/D role (`sim --role`: prefill, decode or both).
        lora: LoRA adapters it serves, or None.

    Raises:
        ValueError: unknown profile or role, or speed / stream_interval out of range.

    Nothing runs until `start()`.
    """

    def __init__(
        self,
        profile: str,
        *,
        name: str,
        workdir: Path,
        speed: float = 1.0,
        stream_interval: int = 1,
        seed: int = 0,
        load_shape: str = "sglang",
        port: int = 0,
        kv_events: bool = False,
        max_model_len: int | None = None,
        role: str = "both",
        lora: LoraFleet | None = None,
    ) -> None:
        if role not in SIM_ROLES:
            raise ValueError(f"unknown P/D role {role!r}; one of {', '.join(SIM_ROLES)}")
        if profile not in PROFILES:
            raise ValueError(f"unknown simulator profile {profile!r}; known: {', '.join(PROFILES)}")
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.profile = profile
        self.name = name
        self.workdir = Path(workdir)
        self.speed = speed
        self.stream_interval = stream_interval
        self.seed = seed
        self.load_shape = load_shape
        self._listen_port = port
        self.kv_events = kv_events
        self.max_model_len = max_model_len
        self.role = role
        self.lora = lora
        self.kv_events_endpoint: str | None = None
        self.kv_events_replay: str | None = None
        self.port: int | None = None
        self._proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:41234` (serves `/v1/...`, `/metrics`, `/sim/state`)."""
        if self.port is None:
            raise RuntimeError(f"{self.name} is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """`ip:port`, as Envoy's `x-llm-endpoint` and llm-extproc's config spell it."""
        return self.url.removeprefix("http://")

    def argv(self) -> list[str]:
        """The child's command line."""
        return [
            sys.executable, "-m", "extproc", "sim",
            "--host", "127.0.0.1", "--port", str(self._listen_port),
            "--profile", self.profile,
            "--speed", repr(float(self.speed)),
            "--stream-interval", str(self.stream_interval),
            "--seed", str(self.seed),
            "--load-shape", self.load_shape,
            *(("--kv-events-port", "0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*") if self.kv_events else ()),
            *(("--max-model-len", str(self.max_model_len)) if self.max_model_len is not None else ()),
            *(("--role", self.role) if self.role != "both" else ()),
            *(self.lora.sim_args() if self.lora is not None else ()),
        ]  # fmt: skip

    async def start(self, timeout_s: float = 90.0) -> None:
        """Spawn the simulator; return once it printed its URL and `/health` answers 200.

        Raises:
            ProcessError: it exited or was not ready within `timeout_s` seconds (with its log).
            RuntimeError: already started.
        """
        if self._proc is not None:
            raise RuntimeError(f"{self.name} already started")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = ManagedProcess(self.argv(), name=self.name, log_path=self.workdir / f"{self.name}.log", env=env)
        self._proc.spawn()
        try:

            async def listening() -> bool:
                match = _READY.search(self._proc.log_tail(16_000)) if self._proc else None
                if match:
                    self.port = int(match.group(3))
                    events, replay = _KV_EVENTS.search(match.group(4)), _KV_REPLAY.search(match.group(4))
                    self.kv_events_endpoint = events.group(1) if events else None
                    self.kv_events_replay = replay.group(1) if replay else None
                return match is not None

            await wait_until(listening, proc=self._proc, what="listening", timeout_s=timeout_s, interval_s=0.1)
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:

                async def healthy() -> bool:
                    return (await client.get(f"{self.url}/health")).status_code == 200

                await wait_until(healthy, proc=self._proc, what="healthy", timeout_s=timeout_s)
        except BaseException:
            await self.aclose()
            raise


class Fleet:
    """Simulators for `profiles` (one per entry, in order), started and stopped together.

    Args:
        profiles: engine profile per endpoint (default `DEFAULT_FLEET`).
        workdir: logs go to `<workdir>/sim-<i>.log`.
        speed, stream_interval, load_shape, kv_events, max_model_len, lora: as `SimProcess`.
        seed: endpoint i gets seed `seed + i`.
        roles: P/D role per endpoint (same length as `profiles`); None: all `both`.

    Raises:
        ValueError: no profiles, roles not one per profile, or a bad profile, role or setting.
    """

    def __init__(
        self,
        profiles: Sequence[str] = DEFAULT_FLEET,
        *,
        workdir: Path,
        speed: float = 1.0,
        stream_interval: int = 1,
        seed: int = 0,
        load_shape: str = "sglang",
        kv_events: bool = False,
        max_model_len: int | None = None,
        roles: Sequence[str] | None = None,
        lora: LoraFleet | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("a fleet needs at least one simulator profile")
        if roles is not None and len(roles) != len(profiles):
            raise ValueError(f"{len(roles)} roles for {len(profiles)} simulators: give one per simulator")
        self.sims = [
            SimProcess(
                p, name=f"sim-{i}", workdir=workdir, speed=speed, stream_interval=stream_interval,
                seed=seed + i, load_shape=load_shape, kv_events=kv_events, max_model_len=max_model_len, lora=lora,
                role=roles[i] if roles is not None else "both",
            )
            for i, p in enumerate(profiles)
        ]  # fmt: skip
        self._started = False

    @property
    def addresses(self) -> list[str]:
        """`ip:port` of each simulator, in profile order."""
        return [s.address for s in self.sims]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sims]

    @property
    def profiles(self) -> dict[str, str]:
        """Profile name by address."""
        return {s.address: s.profile for s in self.sims}

    @property
    def kv_events(self) -> dict[str, tuple[str, str | None]]:
        """(KV-event endpoint, replay endpoint) by address, for simulators publishing them."""
        return {s.address: (s.kv_events_endpoint, s.kv_events_replay) for s in self.sims if s.kv_events_endpoint}

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self.sims if s.pid is not None]

    async def start(self, timeout_s: float = 90.0) -> None:
        """Start every simulator in parallel; on any failure stop them all and raise.

        Raises:
            ProcessError: a simulator failed to start (the first failure, with its log).
            RuntimeError: already started.
        """
        if self._started:
            raise RuntimeError("fleet already started (start a new Fleet for empty caches)")
        self._started = True
        results = await asyncio.gather(*(s.start(timeout_s) for s in self.sims), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.aclose()
            first = next((f for f in failures if isinstance(f, ProcessError)), failures[0])
            raise first

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop every simulator (in parallel, each bounded by `timeout_s` seconds)."""
        await asyncio.gather(*(s.aclose(timeout_s) for s in self.sims), return_exceptions=True)
