"""LoRA adapters on endpoints: what each engine reports, what the router itself sent, and the
residency tier of an adapter on an endpoint that `lora-affinity-scorer` scores.

Two vLLM metric generations (DESIGN section 13):

* residency (newer vLLM): `vllm:lora_adapter_loaded{adapter_name, level="gpu"|"cpu", pinned,
  rank}` (1 per loaded adapter), `vllm:num_gpu_loaded_lora_adapters`,
  `vllm:max_gpu_lora_adapters`;
* activity (older vLLM): `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters,
  max_lora}`, one series per change whose *value* is the time it was set: only the newest series
  is current. It reports adapters with requests in flight, not the adapters loaded (llm-d-router
  #2605): an idle adapter still in its GPU slot is absent from it.

So the router also remembers which adapters it sent to each endpoint and when
(`SentAdapters`): vLLM keeps the `max_loras` most recently used adapters in its GPU slots (an
LRU, `LRUCacheWorkerLoRAManager`), so where this router is the engine's only client, the
`max_loras` adapters it sent there last, recently, are the ones loaded. On an engine exporting
residency, the engine's word wins; on one exporting activity only, the estimate is the running
adapters plus the router's recent ones.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ADAPTER_RECENT_S",
    "LoraMetrics",
    "SentAdapters",
    "Tier",
    "TIER_SCORES",
    "AdapterNames",
    "residency_tier",
    "gpu_estimate",
]

ADAPTER_RECENT_S = 60.0
"""An adapter the router sent to an endpoint within this many seconds counts as possibly still
loaded there (seconds). vLLM evicts only when another adapter needs the slot, so age alone does
not unload it; the bound keeps a router that lost track (another client, an engine restart) from
believing in a residency for ever. The engine's own residency metric overrides it."""

SENT_HALF_LIFE_S = 30.0
"""Half-life of the router's per-endpoint, per-adapter request counts (seconds): what the spread
rule reads as an adapter's recent traffic."""

MAX_SENT_ADAPTERS = 256
"""Adapters remembered per endpoint (count): the least recently sent is forgotten beyond it."""

Tier = Literal["gpu", "cpu", "free", "evictable", "full"]

TIER_SCORES: dict[str, float] = {"gpu": 1.0, "cpu": 0.7, "free": 0.6, "evictable": 0.3, "full": 0.0}
"""llm-d's residency scorer's scale (DESIGN section 13): loaded on the GPU, loaded in host
memory (a host→GPU copy away), a free GPU slot (a load from disk, no eviction), a slot held by an
idle adapter (a load and an eviction), every slot held by an adapter with requests running."""


@dataclass(frozen=True, slots=True)
class LoraMetrics:
    """One scrape's LoRA state of an engine.

    Attributes:
        generation: "residency" (the engine exports `vllm:lora_adapter_loaded`) or "activity"
            (`vllm:lora_requests_info` only).
        gpu / cpu: adapters loaded in GPU slots / in the host cache (residency generation; empty
            otherwise).
        running / waiting: adapters with requests running / waiting (activity generation, and
            what the residency generation's engines may also still export).
        max_gpu: GPU adapter slots (`vllm:max_gpu_lora_adapters`, or the activity series'
            `max_lora` label), None when not exported.
    """

    generation: Literal["residency", "activity"]
    gpu: frozenset[str] = frozenset()
    cpu: frozenset[str] = frozenset()
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_gpu: int | None = None

    @property
    def adapters(self) -> frozenset[str]:
        """Every adapter name the engine mentioned."""
        return self.gpu | self.cpu | self.running | self.waiting


def adapter_list(value: str) -> frozenset[str]:
    """The adapters of a `running_lora_adapters` / `waiting_lora_adapters` label: names joined
    by commas (vLLM's `",".join(...)`), "" for none."""
    return frozenset(n.strip() for n in value.split(",") if n.strip())


@dataclass(slots=True)
class _Sent:
    last_s: float
    weight: float
    weighed_at: float


@dataclass(slots=True)
class SentAdapters:
    """The adapters this router sent to one endpoint: when it last sent each, and a decaying
    count of its requests (half-life `SENT_HALF_LIFE_S`), most recently sent last. Bounded at
    `MAX_SENT_ADAPTERS` adapters."""

    entries: OrderedDict[str, _Sent] = field(default_factory=OrderedDict)
    _sum: _Sent = field(default_factory=lambda: _Sent(0.0, 0.0, 0.0))
    """Every entry's weights summed, decayed alike (one half-life): `total` in O(1)."""

    def note(self, adapter: str, now: float) -> None:
        """One request of `adapter` routed here at `now` (monotonic seconds)."""
        e = self.entries.pop(adapter, None)
        if e is None:
            e = _Sent(now, 0.0, now)
        e.weight = self.weight_of(e, now) + 1.0
        e.weighed_at = e.last_s = now
        self.entries[adapter] = e
        self._add(1.0, now)
        while len(self.entries) > MAX_SENT_ADAPTERS:
            _, gone = self.entries.popitem(last=False)
            self._add(-self.weight_of(gone, now), now)

    def _add(self, weight: float, now: float) -> None:
        t = self._sum
        t.weight = max(0.0, self.weight_of(t, now) + weight)
        t.weighed_at = max(t.weighed_at, now)

    @staticmethod
    def weight_of(e: _Sent, now: float) -> float:
        return e.weight * math.exp2(-max(0.0, now - e.weighed_at) / SENT_HALF_LIFE_S)

    def rate(self, adapter: str, now: float) -> float:
        """`adapter`'s decayed request count here at `now` (requests, half-life-weighted)."""
        e = self.entries.get(adapter)
        return 0.0 if e is None else self.weight_of(e, now)

    def total(self, now: float) -> float:
        """Every adapter's decayed request count here (requests): the sum of `rate` over the
        remembered adapters, kept as it goes (read per endpoint per LoRA request)."""
        return self.weight_of(self._sum, now)

    def recent(self, now: float, slots: int, within_s: float = ADAPTER_RECENT_S) -> list[str]:
        """The `slots` adapters sent here most recently, each within `within_s` seconds of
        `now`: the router's guess of the engine's LRU GPU slots."""
        out: list[str] = []
        for name in reversed(self.entries):
            if len(out) >= slots or now - self.entries[name].last_s > within_s:
                break
            out.append(name)
        return out


def gpu_estimate(lora: LoraMetrics | None, sent: SentAdapters | None, now: float, slots: int) -> frozenset[str]:
    """The adapters believed loaded in the endpoint's GPU slots: the engine's own list where it
    exports residency; else the adapters running there, and up to `slots` in all of those the
    router sent most recently (`SentAdapters.recent`)."""
    if lora is not None and lora.generation == "residency":
        return lora.gpu
    running = lora.running if lora is not None else frozenset()
    if sent is None:
        return running
    guess = set(running)
    for name in sent.recent(now, slots):
        if len(guess) >= slots:
            break
        guess.add(name)
    return frozenset(guess)


def residency_tier(
    adapter: str, lora: LoraMetrics | None, sent: SentAdapters | None, now: float, default_slots: int
) -> Tier:
    """Where `adapter` stands on one endpoint (`TIER_SCORES`).

    Args:
        adapter: the requested adapter's name.
        lora: the endpoint's latest LoRA scrape, or None (no LoRA metrics exported).
        sent: what this router sent there (`Endpoint.lora_sent`), or None.
        now: monotonic seconds.
        default_slots: GPU adapter slots assumed when the engine does not say (vLLM's
            `--max-loras`, 1 by default in vLLM; the scorer's `max_loras` parameter).
    """
    slots = lora.max_gpu if lora is not None and lora.max_gpu else default_slots
    loaded = gpu_estimate(lora, sent, now, slots)
    if adapter in loaded:
        return "gpu"
    if lora is not None and adapter in lora.cpu:
        return "cpu"
    if len(loaded) < slots:
        return "free"
    busy = lora.running if lora is not None else frozenset()
    return "evictable" if any(name not in busy for name in loaded) else "full"


class AdapterNames:
    """LoRA adapter names → their base model (canonical name): the configured ones
    (`ModelConfig.adapters`) and, where a model allows it (`learn_adapters`), names the engines
    report (`/v1/models` entries with a `parent`, the LoRA metrics' labels). Learned names are
    bounded (`max_learned`); a name that is a model's name or alias is never an adapter.

    Args:
        configured: adapter name → base model name.
        reserved: model names and aliases (never learned as adapters).
        learning: base model names that learn adapters.
        max_learned: most learned names kept (count).
    """

    def __init__(self, configured: dict[str, str], reserved: set[str], learning: set[str], max_learned: int = 1024) -> None:
        self.configured = dict(configured)
        self._reserved = set(reserved)
        self._learning = set(learning)
        self._max_learned = max_learned
        self.learned: dict[str, str] = {}

    @property
    def can_learn(self) -> bool:
        """Whether `learn` may still take a name: a model learns adapters and the bound is not
        reached."""
        return bool(self._learning) and len(self.learned) < self._max_learned

    def base_of(self, name: str) -> str | None:
        """The base model of adapter `name`, or None when it is no known adapter."""
        return self.configured.get(name) or self.learned.get(name)

    def learn(self, adapter: str, base: str) -> bool:
        """An engine serving `base` reported `adapter`; True when it is newly learned. Ignored for
        a base that does not learn, a model name, or past `max_learned`."""
        if (
            not adapter
            or base not in self._learning
            or adapter in self._reserved
            or adapter in self.configured
            or adapter in self.learned
            or len(self.learned) >= self._max_learned
        ):
            return False
        self.learned[adapter] = base
        return True

    def label(self, adapter: str | None) -> str:
        """A bounded metric label: "" for the base model, a configured adapter's name, else
        "other" (learned names come from engines and are not bounded by the config)."""
        if adapter is None:
            return ""
        return adapter if adapter in self.configured else "other"
