"""`lora-activity-scorer`: the Gateway API Inference Extension's LoRA affinity rule, kept as a
comparison policy for the LoRA benchmark (not in any built-in profile).

It reads only `vllm:lora_requests_info` (the engine's adapters with requests running or
waiting, and `max_lora`): 1.0 where the adapter is running or waiting, 0.8 where fewer than
`max_lora` adapters are active (room to load), 0.6 where it is waiting (never reached: running
and waiting come from one dict in vLLM), 0 otherwise — GIE's 1.0 / 0.8 / 0.6 / 0. It is the
activity-only signal llm-d-router #2605 showed wrong: an adapter loaded but idle looks absent,
so at low concurrency every endpoint scores 0.8 and the choice is the load scorers' alone.
It ignores the residency metrics and the router's own memory on purpose. A request for the base
model scores 1 everywhere. No parameters; `scheduling.lora_max_loras` when `max_lora` is absent.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("lora-activity-scorer")
class LoraActivityScorer(Plugin):
    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        adapter = ctx.request.adapter
        if adapter is None:
            return [1.0] * len(endpoints)
        out = []
        for ep in endpoints:
            lora = ep.engine.lora if ep.engine is not None else None
            running = lora.running if lora is not None else frozenset()
            waiting = lora.waiting if lora is not None else frozenset()
            slots = lora.max_gpu if lora is not None and lora.max_gpu else ctx.lora_max_loras
            if adapter in running:
                out.append(1.0)
            elif len(running | waiting) < slots:
                out.append(0.8)
            elif adapter in waiting:
                out.append(0.6)
            else:
                out.append(0.0)
        return out
