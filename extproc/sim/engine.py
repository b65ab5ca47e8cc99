"""The engine model: vLLM V1's scheduler stepped on a simulated clock.

Per step (`vllm/v1/core/sched/scheduler.py`, FCFS policy):

1. Running requests first, in admission order: each gets what it still has to compute (a whole
   remaining prompt chunk, or 1 token when decoding), capped by the step's token budget
   (`max_num_batched_tokens`, chunked prefill). If its new KV slots do not fit in the free
   blocks, the most recently admitted running request is preempted (recompute: its blocks are
   freed, keeping their prefix-cache hashes, and it goes back to the head of the waiting queue),
   until the allocation fits or the request itself was the one preempted.
2. If nothing was preempted, waiting requests are admitted in order while the budget lasts,
   `max_num_seqs` is not reached and their first chunk's blocks fit; a request's leading cached
   blocks (prefix cache hit, at most prompt − 1 tokens) are not computed again. The queue is
   strict FCFS: the first request that does not fit stops admission.
3. The step takes `StepCoefficients` time (see `extproc.sim.profiles`); when it ends, every
   request that has caught up with its tokens samples one more.

The clock is simulated seconds (`Engine.now`), moved only by the engine itself, so engine tests
are deterministic and need no event loop. A driver calls `plan()` then `commit()`; the server
sleeps between the two, tests and scripts do not (`run()`).

Cheapness: when every running request is decoding, nothing waits that could be admitted, and
the blocks for k more tokens each are free, the next k steps have the same batch, so `plan`
returns them as one multi-step plan (k ≤ the smallest remaining output, ≤ `max_steps`); its
cost is O(running), not O(running × k). A driver that learns of a new arrival mid-plan commits
only the steps up to the one in progress (`commit(plan, until=t)`), so the result equals
stepping one at a time (tested).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.prefix.kv_events import BlockStored, KVEvent
from extproc.sim.blocks import BlockPool, chain_block_hashes, wire_hash
from extproc.sim.lora import LoraLoadModel, LoraSlots
from extproc.sim.profiles import StepCoefficients
from extproc.sim.stats import EngineStats
from extproc.types import BlockHash

__all__ = ["EngineConfig", "Engine", "SimRequest", "RequestStatus", "StepPlan", "RequestTooLargeError"]


class RequestTooLargeError(ValueError):
    """A request could never fit the KV pool (prompt + output exceed its capacity)."""


class RequestStatus(enum.Enum):
    PENDING = "pending"  # arrived in the future (not yet visible to the scheduler)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler and pool sizes.

    Attributes:
        num_gpu_blocks: KV pool size (blocks).
        block_size: tokens per block.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget per step (prefill tokens + decode sequences).
        max_model_len: context limit (tokens), enforced by the server.
        enable_prefix_caching: vLLM V1's default is on.
        enable_kv_cache_events: record vLLM's KV-cache events (`Engine.take_kv_events`): a
            `BlockStored` per run of prompt blocks a step registers, with their token ids and
            the parent's hash. Blocks of generated tokens are not announced: the simulator does
            not have their token ids (so no other prompt can hit them here either).
        max_loras: GPU LoRA slots (vLLM `--max-loras`; 0: LoRA off). A batch holds at most this
            many distinct adapters (`extproc.sim.lora`).
        max_cpu_loras: adapters kept in host memory (vLLM `--max-cpu-loras`; 0: `max_loras`).
        lora_load: the adapter load-time model (`extproc.sim.lora.LoraLoadModel`).
    """

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    max_model_len: int = 40960
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool = False
    max_loras: int = 0
    max_cpu_loras: int = 0
    lora_load: LoraLoadModel = field(default_factory=LoraLoadModel)

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_loras < 0 or self.max_cpu_loras < 0:
            raise ValueError("max_loras and max_cpu_loras must be ≥ 0")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be ≥ max_loras ({self.max_loras})")


_uids = itertools.count(1)


class SimRequest:
    """One generation request as the engine tracks it.

    Args:
        prompt_token_ids: the prompt's token ids (for prefix hashing; only their count and
            block hashes are kept).
        output_tokens: how many tokens to generate (tokens, ≥ 1).
        arrival: arrival time (simulated seconds).
        finish_reason: reported when `output_tokens` are done (`length` or `stop`).
        request_id: free-form id for logs.
        notify: called with the request when tokens are ready to emit (the first token, then
            every `notify_every` tokens) and when it finishes; the server uses it to wake a stream.
        notify_every: tokens between notifications (the stream interval).
        hold_kv: P/D prefill side (`kv_transfer_params.do_remote_decode`): when it finishes, its
            blocks are held for a decode engine to pull (`Engine.kv_holds`), not freed.
        external_tokens: P/D decode side: prompt tokens whose KV was pulled from a prefill
            engine (tokens): computed without a prefill step when the request is admitted.
        lora: the LoRA adapter it runs with (its `model`), or None for the base model.
    """

    __slots__ = (
        "uid", "request_id", "prompt_len", "block_hashes", "target_output", "arrival", "status",
        "num_computed", "num_output", "blocks", "num_registered", "first_scheduled", "first_token_time",
        "last_token_time", "finish_time", "finish_reason", "cached_tokens", "notify", "notify_every",
        "notified", "hold_kv", "external_tokens", "_final_reason", "_prompt_ids", "lora",
    )

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        output_tokens: int,
        arrival: float,
        *,
        finish_reason: str = "length",
        request_id: str = "",
        notify: Callable[[SimRequest], None] | None = None,
        notify_every: int = 1,
        hold_kv: bool = False,
        external_tokens: int = 0,
        lora: str | None = None,
    ) -> None:
        if output_tokens < 1:
            raise ValueError(f"output_tokens must be ≥ 1, got {output_tokens}")
        if not prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        self.uid = next(_uids)
        self.request_id = request_id or f"req-{self.uid}"
        self.prompt_len = len(prompt_token_ids)
        self.block_hashes: list[BlockHash] = []
        self.target_output = output_tokens
        self.arrival = arrival
        self.status = RequestStatus.PENDING
        self.num_computed = 0
        self.num_output = 0
        self.blocks: list[int] = []
        self.num_registered = 0
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time = arrival
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.notify = notify
        self.notify_every = max(1, notify_every)
        self.notified = 0
        self.hold_kv = hold_kv
        self.external_tokens = min(max(0, external_tokens), self.prompt_len - 1)
        self._final_reason = finish_reason
        self._prompt_ids: Sequence[int] = prompt_token_ids  # dropped once hashed
        self.lora = lora

    @property
    def num_tokens(self) -> int:
        """Prompt plus output so far (tokens)."""
        return self.prompt_len + self.num_output

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def ttft(self) -> float | None:
        """Time to first token (simulated seconds), once known."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id}, {self.status.value}, prompt={self.prompt_len}, "
            f"out={self.num_output}/{self.target_output}, computed={self.num_computed})"
        )


@dataclass(slots=True)
class StepPlan:
    """What `Engine.plan` scheduled: one mixed step or k identical-batch decode steps.

    Attributes:
        start: simulated start time (seconds).
        ends: simulated end time of each step (seconds), ascending.
        items: (request, new tokens) of a single step; empty for a multi-step decode.
        decode: the requests of a multi-step decode (each gets one token per step).
        epoch: the engine epoch it belongs to (a restart invalidates older plans).
        prefill_tokens, decode_seqs: composition of the (first) step, for logs.
    """

    start: float
    ends: list[float]
    items: list[tuple[SimRequest, int]] = field(default_factory=list)
    decode: list[SimRequest] = field(default_factory=list)
    epoch: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0

    @property
    def end(self) -> float:
        return self.ends[-1]

    @property
    def steps(self) -> int:
        return len(self.ends)


class Engine:
    """vLLM V1's scheduler, a KV block pool with prefix caching, and the step-time model.

    Args:
        config: pool and scheduler sizes.
        coefficients: the step-time model.
        start: initial simulated time (seconds).
    """

    def __init__(self, config: EngineConfig, coefficients: StepCoefficients, *, start: float = 0.0) -> None:
        self.config = config
        self.coefficients = coefficients
        self.now = start
        self.pool = BlockPool(
            config.num_gpu_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            record_events=config.enable_kv_cache_events and config.enable_prefix_caching,
        )
        self.stats = EngineStats()
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self._inbox: list[tuple[float, int, SimRequest]] = []
        self.epoch = 0
        self.lora = (
            LoraSlots(config.max_loras, config.max_cpu_loras or config.max_loras, config.lora_load) if config.max_loras else None
        )
        """GPU slots and host cache of LoRA adapters, None with LoRA off."""
        self.kv_holds: dict[str, tuple[list[int], int, float]] = {}
        """P/D prefill side: request id → (held block ids, prompt tokens, expiry in simulated
        seconds) of finished `hold_kv` requests, until a decode engine pulls them
        (`release_kv_hold`) or `kv_hold_timeout_s` passes."""
        self.kv_hold_timeout_s = 480.0
        """How long finished prefills hold their blocks (simulated seconds): vLLM's
        `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` default (480 s)."""
        self.kv_expired = 0
        """Holds freed by the timeout, never pulled (count; vLLM's `nixl_num_kv_expired_reqs`)."""

    def expire_kv_holds(self, now: float | None = None) -> int:
        """Free the holds whose time ran out at `now` (simulated seconds; default the engine's
        clock); returns how many."""
        now = self.now if now is None else now
        gone = [rid for rid, (_, _, until) in self.kv_holds.items() if until <= now]
        for rid in gone:
            blocks, _, _ = self.kv_holds.pop(rid)
            self.pool.free(blocks)
        self.kv_expired += len(gone)
        return len(gone)

    def release_kv_hold(self, request_id: str, now: float | None = None) -> int | None:
        """A decode engine pulled `request_id`'s blocks: free them here. Returns the prompt
        tokens they held, or None when no hold remains (never made, pulled, or expired)."""
        self.expire_kv_holds(now)
        held = self.kv_holds.pop(request_id, None)
        if held is None:
            return None
        self.pool.free(held[0])
        return held[1]

    # -- requests -------------------------------------------------------------------------
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds (tokens)."""
        return self.config.num_gpu_blocks * self.config.block_size

    def add_request(self, req: SimRequest) -> None:
        """Queue a request; it becomes visible to the scheduler at `req.arrival`.

        Raises:
            RequestTooLargeError: prompt + output could never fit the pool.
            ValueError: a LoRA request on an engine with LoRA off.
        """
        if req.lora is not None and self.lora is None:
            raise ValueError(f"request for LoRA adapter {req.lora!r} on an engine without LoRA (max_loras 0)")
        bs = self.config.block_size
        if -(-(req.prompt_len + req.target_output) // bs) > self.config.num_gpu_blocks:
            raise RequestTooLargeError(
                f"request needs {req.prompt_len + req.target_output} tokens of KV cache but the pool "
                f"holds {self.capacity_tokens()}"
            )
        if self.config.enable_prefix_caching:
            # vLLM keys an adapter's blocks by its name: another adapter never hits them.
            req.block_hashes = chain_block_hashes(req._prompt_ids, bs, seed=0 if req.lora is None else hash(("lora", req.lora)))
        if self.pool.events is None:
            req._prompt_ids = ()  # kept only for the token ids of KV events
        req.status = RequestStatus.PENDING
        heapq.heappush(self._inbox, (req.arrival, req.uid, req))

    def abort(self, req: SimRequest) -> None:
        """Drop a request wherever it is (client went away); counted as `abort`. Idempotent."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self._inbox = [e for e in self._inbox if e[2] is not req]
            heapq.heapify(self._inbox)
        self._finish(req, max(self.now, req.arrival), "abort")

    def has_work(self) -> bool:
        """Anything running, waiting or yet to arrive."""
        return bool(self.running or self.waiting or self._inbox)

    def next_arrival(self) -> float | None:
        """Arrival time of the next not-yet-visible request (simulated seconds), if any."""
        return self._inbox[0][0] if self._inbox else None

    @property
    def num_waiting(self) -> int:
        """Requests waiting, arrived ones plus those whose arrival time is still ahead."""
        return len(self.waiting) + len(self._inbox)

    def restart(self) -> list[SimRequest]:
        """Forget everything (a crashed and restarted vLLM): drop all requests, clear the
        prefix cache, zero the counters. Returns the dropped requests (their `notify` is not
        called; the caller tells their clients)."""
        dropped = [*self.running, *self.waiting, *(e[2] for e in self._inbox)]
        for req in dropped:
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
            req.finish_time = self.now
        self.running.clear()
        self.waiting.clear()
        self._inbox.clear()
        self.kv_holds.clear()
        self.pool.reset()
        self.stats = EngineStats()
        if self.lora is not None:
            self.lora.clear()
        self.epoch += 1
        return dropped

    # -- stepping -------------------------------------------------------------------------
    def _admit_arrivals(self) -> None:
        inbox = self._inbox
        while inbox and inbox[0][0] <= self.now:
            req = heapq.heappop(inbox)[2]
            req.status = RequestStatus.WAITING
            self.waiting.append(req)

    def plan(self, max_steps: int = 1) -> StepPlan | None:
        """Schedule the next step (or several identical decode steps) at `now`.

        Blocks are allocated here, as vLLM's scheduler does before the forward pass. Returns
        None when nothing can run now (idle, or only future arrivals).

        Args:
            max_steps: most decode steps to fold into one plan (≥ 1).
        """
        self._admit_arrivals()
        if self.kv_holds:
            self.expire_kv_holds()
        if not self.running and not self.waiting:
            return None
        if max_steps > 1:
            k = self._decode_run_length(max_steps)
            if k > 1:
                return self._plan_decode_run(k)
        return self._plan_single()

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _decode_run_length(self, max_steps: int) -> int:
        """How many steps the current running batch can decode unchanged (1 = not at all)."""
        running = self.running
        cfg = self.config
        if not running or len(running) > cfg.max_num_batched_tokens:
            return 1
        k = max_steps
        for req in running:
            if req.num_output == 0 or req.num_computed != req.num_tokens - 1:
                return 1
            left = req.target_output - req.num_output
            if left < k:
                k = left
        if k <= 1:
            return 1
        if self.waiting and len(running) < cfg.max_num_seqs and (self.lora is not None or self._head_could_be_admitted()):
            return 1  # (with LoRA a request behind a skipped head may be admissible: step singly)
        free = self.pool.num_free
        bs = cfg.block_size
        while k > 1:
            need = 0
            for req in running:
                more = -(-(req.num_tokens + k - 1) // bs) - len(req.blocks)
                if more > 0:
                    need += more
            if need <= free:
                return k
            k //= 2
        return 1

    def _head_could_be_admitted(self) -> bool:
        """Whether the head of the waiting queue would fit the free blocks now."""
        req = self.waiting[0]
        hits, in_free = self._lookup(req)
        hit_tokens = len(hits) * self.config.block_size
        chunk = min(req.num_tokens - hit_tokens, self.config.max_num_batched_tokens)
        need = self._blocks_for(hit_tokens + chunk) - len(hits)
        return need <= self.pool.num_free - in_free

    def _lookup(self, req: SimRequest) -> tuple[list[int], int]:
        if req.num_computed or not self.config.enable_prefix_caching:
            return [], 0
        return self.pool.find_cached_prefix(req.block_hashes, (req.num_tokens - 1) // self.config.block_size)

    def _plan_decode_run(self, k: int) -> StepPlan:
        co = self.coefficients
        running = self.running
        n = len(running)
        ctx0 = 0
        for req in running:
            ctx0 += req.num_tokens
        base = max(co.a, co.a_c + co.b * n) + co.c * n
        ends: list[float] = []
        t = self.now
        for step in range(k):
            t += base + co.d * (ctx0 + step * n)
            ends.append(t)
        return StepPlan(start=self.now, ends=ends, decode=list(running), epoch=self.epoch, decode_seqs=n)

    def _preempt_last(self) -> SimRequest:
        victim = self.running.pop()
        self.pool.free(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.num_registered = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        return victim

    def _plan_single(self) -> StepPlan:
        cfg = self.config
        pool = self.pool
        budget = cfg.max_num_batched_tokens
        items: list[tuple[SimRequest, int]] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            if num_new <= 0:
                i += 1
                continue
            need = self._blocks_for(req.num_computed + num_new) - len(req.blocks)
            scheduled = True
            while need > pool.num_free:
                preempted = True
                if self._preempt_last() is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            if need > 0:
                req.blocks.extend(pool.allocate(need))
            items.append((req, num_new))
            budget -= num_new
            i += 1

        lora = self.lora
        active = {r.lora for r in self.running if r.lora is not None} if lora is not None else set()
        skipped: list[SimRequest] = []
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting[0]
                if lora is not None and req.lora is not None and req.lora not in active and len(active) >= lora.max_loras:
                    # vLLM V1: a request whose adapter would exceed max_loras is skipped, the next admitted
                    skipped.append(self.waiting.popleft())
                    continue
                first_lookup = req.num_computed == 0
                hits, in_free = self._lookup(req)
                hit_tokens = len(hits) * cfg.block_size
                # KV pulled from a prefill engine counts as computed (it still needs blocks here).
                done = max(hit_tokens, req.external_tokens) if first_lookup else hit_tokens
                num_new = min(req.num_tokens - done, budget)
                need = self._blocks_for(done + num_new) - len(hits)
                if need > pool.num_free - in_free:
                    break
                self.waiting.popleft()
                pool.touch(hits)
                req.blocks = hits + pool.allocate(need)
                req.num_computed = done
                req.num_registered = len(hits)
                if first_lookup and self.config.enable_prefix_caching:
                    self.stats.prefix_queries += req.num_tokens
                    self.stats.prefix_hits += hit_tokens
                if req.first_scheduled is None:
                    req.first_scheduled = self.now
                    req.cached_tokens = done  # vLLM counts pulled KV as cached (the sidecar rewrites it)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                items.append((req, num_new))
                budget -= num_new
                if req.lora is not None:
                    active.add(req.lora)
        self.waiting.extendleft(reversed(skipped))

        co = self.coefficients
        prefill = decode = 0
        ctx = 0
        attn = 0
        for req, m in items:
            if m == 1 and req.num_output > 0 and req.num_computed == req.num_tokens - 1:
                decode += 1
                ctx += req.num_tokens
            else:
                prefill += m
                attn += m * (2 * req.num_computed + m)
        if not items:
            # Everything waits on blocks that only a finish could free; cannot happen while
            # add_request rejects requests larger than the pool, but never spin: idle one floor.
            return StepPlan(start=self.now, ends=[self.now + co.a], epoch=self.epoch)
        dur = max(co.a, co.a_c + co.b * (prefill + decode)) + co.c * decode + co.d * ctx + co.q * attn
        if lora is not None and active:
            # adapters not in a GPU slot are loaded before the forward pass; the step waits
            dur += lora.activate([r.lora for r, _ in items if r.lora is not None], in_use=active)
        return StepPlan(
            start=self.now, ends=[self.now + dur], items=items, epoch=self.epoch,
            prefill_tokens=prefill, decode_seqs=decode,
        )

    def commit(self, plan: StepPlan, until: float | None = None) -> int:
        """Apply a plan's steps: all of them, or (with `until`) those ending at or before
        `until` plus the one in progress then. Moves `now` to the last applied step's end.

        Returns:
            the number of steps applied (0 for a plan from before a restart).
        """
        if plan.epoch != self.epoch:
            return 0
        k = plan.steps
        if until is not None and k > 1:
            k = min(k, bisect_right(plan.ends, until) + 1)
        end = plan.ends[k - 1]
        self.stats.record_busy(plan.start, end)
        self.stats.steps += k
        self.stats.last_batch_tokens = plan.prefill_tokens + plan.decode_seqs
        if plan.decode:
            self._commit_decode_run(plan, k)
        else:
            self._commit_single(plan)
        self.now = end
        return k

    def _register_full_blocks(self, req: SimRequest) -> None:
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        full = req.num_computed // bs
        hashes = req.block_hashes
        pool = self.pool
        ids = req._prompt_ids
        prompt_blocks = len(ids) // bs if pool.events is not None else 0
        run: list[int] = []  # block indexes of the BlockStored being built
        for idx in range(req.num_registered, full):
            if idx >= len(hashes):
                # Generated tokens: a block of them is named by the request and its position,
                # so a preempted request finds its own blocks again on resume.
                hashes.append(BlockHash(hash((hashes[idx - 1] if idx else 0, req.uid, idx))))
            stored = pool.register(req.blocks[idx], hashes[idx], announce=idx < prompt_blocks)
            if stored and idx < prompt_blocks:
                run.append(idx)
            elif run:
                self._announce(req, run)
                run = []
        if run:
            self._announce(req, run)
        if full > req.num_registered:
            req.num_registered = full

    def _announce(self, req: SimRequest, run: list[int]) -> None:
        """Record a `BlockStored` for the consecutive prompt blocks `run` (indexes) of `req`."""
        bs = self.config.block_size
        first, last = run[0], run[-1]
        events = self.pool.events
        assert events is not None
        events.append(
            BlockStored(
                block_hashes=tuple(wire_hash(req.block_hashes[i]) for i in run),
                parent_block_hash=wire_hash(req.block_hashes[first - 1]) if first else None,
                token_ids=tuple(req._prompt_ids[first * bs : (last + 1) * bs]),
                block_size=bs,
                medium="GPU",
                lora_name=req.lora,
                # vLLM's extra hash keys: the adapter's name on every block
                extra_keys=tuple((req.lora,) for _ in run) if req.lora is not None else None,
            )
        )

    def take_kv_events(self) -> list[KVEvent]:
        """KV-cache events since the last call (one engine step's batch; empty when off)."""
        return self.pool.take_events()

    def _commit_decode_run(self, plan: StepPlan, k: int) -> None:
        pool = self.pool
        stats = self.stats
        active = [r for r in plan.decode if r.status is RequestStatus.RUNNING]
        prev = plan.start
        for end in plan.ends[:k]:
            stats.itl.observe(end - prev, len(active))
            prev = end
        end = plan.ends[k - 1]
        stats.generation_tokens += k * len(active)
        any_done = False
        for req in active:
            need = self._blocks_for(req.num_computed + k) - len(req.blocks)
            if need > 0:
                req.blocks.extend(pool.allocate(need))
            req.num_computed += k
            req.num_output += k
            self._register_full_blocks(req)
            any_done |= self._emitted(req, end)
        if any_done:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def _emitted(self, req: SimRequest, end: float) -> bool:
        """After `req` got new tokens at `end`: finish it or notify its stream. True if done."""
        req.last_token_time = end
        if req.num_output >= req.target_output:
            self._finish(req, end, req._final_reason)
            return True
        # vLLM's --stream-interval sends the first token at once, then every `interval` tokens
        # (v1 output processor: finished, first token, or interval reached).
        if req.notify is not None and (req.notified == 0 or req.num_output - req.notified >= req.notify_every):
            req.notified = req.num_output
            req.notify(req)
        return False

    def _commit_single(self, plan: StepPlan) -> None:
        end = plan.end
        stats = self.stats
        any_done = False
        for req, m in plan.items:
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed += m
            self._register_full_blocks(req)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk; more to come
            req.num_output += 1
            stats.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = end
                stats.prompt_tokens += req.prompt_len
                stats.ttft.observe(end - req.arrival)
            else:
                stats.itl.observe(end - req.last_token_time)
            any_done |= self._emitted(req, end)
        if any_done:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]

    def _finish(self, req: SimRequest, when: float, reason: str) -> None:
        if req.blocks and req.hold_kv and reason != "abort":
            self.kv_holds[req.request_id] = (req.blocks, req.prompt_len, when + self.kv_hold_timeout_s)
            req.blocks = []
        if req.blocks:
            self.pool.free(req.blocks)
            req.blocks = []
        req.status = RequestStatus.FINISHED
        req.finish_time = when
        req.finish_reason = reason
        stats = self.stats
        stats.finished[reason] = stats.finished.get(reason, 0) + 1
        stats.e2e.observe(when - req.arrival)
        if req.first_scheduled is not None:
            stats.queue.observe(req.first_scheduled - req.arrival)
        if req.notify is not None:
            req.notified = req.num_output
            req.notify(req)

    # -- virtual-clock driver ---------------------------------------------------------------
    def run(self, *, until: float | None = None, max_steps: int = 64, on_step: Callable[[Engine], None] | None = None) -> None:
        """Step on the virtual clock until idle (or past `until`), jumping over idle gaps.

        Requests may be added from `on_step` or from a finished request's `notify` (a closed
        loop); they arrive at their `arrival` time, which must not be in the past.

        Args:
            until: stop once `now` reaches this time (simulated seconds); None = until idle.
            max_steps: the multi-step decode bound passed to `plan`.
            on_step: called after every commit (for sampling gauges).
        """
        while self.has_work():
            if until is not None and self.now >= until:
                return
            plan = self.plan(max_steps)
            if plan is None:
                nxt = self.next_arrival()
                if nxt is None:
                    return
                self.now = max(self.now, nxt)
                continue
            self.commit(plan, until=self.next_arrival())
            if on_step is not None:
                on_step(self)
