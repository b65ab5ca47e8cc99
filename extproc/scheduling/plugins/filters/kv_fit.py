"""`kv-fit-filter`: KV-cache admission — drop endpoints whose free KV blocks cannot hold the request.

Blocks needed = ceil over (prompt tokens + expected output) with the prompt blocks shared by
the `n` choices (`extproc.pipeline.kv.blocks_for_request`), for each prompt of a batched
completion; the endpoint must have its largest prompt's free (`blocks_to_start`: the engine
admits a batch's prompts one by one) and all of them are reserved (`blocks_needed`). Expected
output = `max_tokens` when
given, else the model's `default_output_tokens` (not the `max_model_len` worst case, which
would starve the fleet). Free blocks = `num_gpu_blocks × (1 − kv_cache_usage_perc)` from the
engine's metrics minus our own unsettled reservations on that endpoint.

An endpoint that does not export `vllm:cache_config_info` (or has not been scraped) cannot be
judged and is kept.

What a pick reserves (`blocks_to_reserve`) is every prompt's blocks up to the endpoint's free
blocks: the engine runs a batch's prompts as blocks free up, and the rest wait in its queue,
where its own usage metric counts them as they start. Reserving the whole of a huge batch drove
the endpoint's free blocks negative, and every other request was refused there until the
reservation settled.

A request this filter can never pass on any endpoint (its largest prompt needs more than the
pool less the headroom, `usable_blocks`) is a 400, not a 429 to retry for ever (the pipeline's
refusal asks the filter).

Parameters:
    headroom_fraction (float 0..0.5, default 0): keep this fraction of the pool free, e.g. 0.05
        so decode growth of running requests does not preempt them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from extproc.datastore.endpoints import Endpoint
from extproc.pipeline.kv import blocks_for_prompts, blocks_for_request
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register

__all__ = ["KVFitFilter", "blocks_to_reserve", "blocks_to_start", "free_blocks", "blocks_needed"]


def _blocks(ctx: SchedulingContext, ep: Endpoint) -> tuple[int, int]:
    r = ctx.request
    if not r.prompt_lengths:  # one prompt, every request but a batched completion: once, per endpoint
        blocks = blocks_for_request(r.prompt_tokens, ctx.expected_output_tokens, ctx.block_size(ep), r.n)
        return blocks, blocks
    return blocks_for_prompts(r.prompt_lengths, ctx.expected_output_tokens, ctx.block_size(ep), r.n)


def blocks_needed(ctx: SchedulingContext, ep: Endpoint) -> int:
    """KV blocks the request may occupy on `ep` (blocks): every prompt of a batched completion
    with its own n choices (`extproc.pipeline.kv.blocks_for_prompts`); what is reserved."""
    return _blocks(ctx, ep)[0]


def blocks_to_start(ctx: SchedulingContext, ep: Endpoint) -> int:
    """KV blocks `ep` must have free to start the request (blocks): its largest prompt with its
    n choices; the engine admits a batch's prompts one by one. For one prompt, `blocks_needed`."""
    return _blocks(ctx, ep)[1]


def blocks_to_reserve(ctx: SchedulingContext, ep: Endpoint) -> int:
    """KV blocks a pick on `ep` reserves (blocks): `blocks_needed`, but no more than the
    endpoint's free blocks (`free_blocks`, when known) and no less than `blocks_to_start`."""
    need, start = _blocks(ctx, ep)
    free = free_blocks(ep)
    if free is None or need <= free:
        return need
    return max(start, free)


def free_blocks(ep: Endpoint) -> int | None:
    """Free blocks after our unsettled reservations (blocks), or None when unknown."""
    engine = ep.engine
    if engine is None or engine.free_blocks is None:
        return None
    return engine.free_blocks - ep.reserved_blocks


@register("kv-fit-filter")
class KVFitFilter(Plugin):
    class Params(Params):
        headroom_fraction: float = Field(default=0.0, ge=0.0, le=0.5)

    def _headroom(self, ep: Endpoint) -> int:
        return int(self.params.headroom_fraction * (ep.engine.num_gpu_blocks or 0)) if ep.engine is not None else 0

    def usable_blocks(self, ep: Endpoint) -> int | None:
        """The most blocks a request may need to start on `ep` and still pass, the pool empty
        (blocks): `num_gpu_blocks` less the headroom; None when the pool is unknown."""
        if ep.engine is None or not ep.engine.num_gpu_blocks:
            return None
        return ep.engine.num_gpu_blocks - self._headroom(ep)

    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        out = []
        for ep in endpoints:
            free = free_blocks(ep)
            if free is None:
                out.append(ep)
                continue
            if blocks_to_start(ctx, ep) <= free - self._headroom(ep):
                out.append(ep)
        return out
