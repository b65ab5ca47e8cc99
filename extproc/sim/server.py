"""`SimServer`: an OpenAI-compatible HTTP front for one simulated vLLM engine.

One aiohttp app and one engine task per server. The engine task plans a step (or a run of
identical decode steps), sleeps until the step's simulated end mapped to wall time
(``wall = wall0 + (sim − sim0) / speed``), then commits it; handlers only enqueue requests and
wait on an `asyncio.Event` that the engine sets at the first token, then every `stream_interval`
tokens, and at the end.
Nothing sleeps per request or per token. If the process falls behind (CPU), the engine's
clock does not skip ahead: it runs steps back to back until it has caught up.

Routes (vLLM's shapes unless noted):

    POST /v1/chat/completions, /v1/completions   generation, SSE or not, usage, n choices
    POST /v1/responses                            the Responses API (text in, one message out)
    GET  /v1/models, /health, /metrics, /version
    POST /tokenize, /detokenize
    GET  /get_load                                SGLang's [{dp_rank, num_reqs, num_waiting_reqs,
                                                  num_tokens}] (sglang-router sums num_tokens), or
                                                  {"load": n} for vllm-router (`load_shape`)
    GET  /server_info, /get_server_info           SGLang server info (model_path, dp_size, ...)
    GET  /model_info, /get_model_info             SGLang model info (model_path, is_generation, ...)
    GET/POST/DELETE /sim/faults                   fault injection (extproc.sim.faults)
    GET  /sim/gpu                                 simulated per-GPU memory and utilisation
    GET  /sim/state                               engine snapshot (ours)
    POST /reset_prefix_cache                      drop the prefix cache (vLLM's dev route); 503
                                                  while requests hold blocks (vLLM refuses then)

With `kv_events_endpoint`, the engine publishes vLLM's KV-cache events (ZMQ PUB, msgpack
`KVEventBatch`, one per step that changed the prefix cache; `extproc.sim.kv_publisher`).

Every response carries `x-sim-speed: <float>`: multiply wall durations by it to get simulated
seconds. `/metrics` is in simulated seconds already.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import random
import threading
import time
import uuid
from bisect import bisect_right
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from extproc.errors import BadRequestError
from extproc.pipeline.tokens import TokenCounter
from extproc.sim.pd import NixlStats, TransferRequest, parse_kv_transfer, prefill_params
from extproc.sim.api import (
    DONE,
    SimAPIError,
    completion_body,
    context_length_error,
    chat_messages,
    model_not_found,
    output_text,
    parse_generation,
    parse_responses,
    responses_body,
    responses_event,
    stream_chunk,
    usage_chunk,
)
from extproc.sim.engine import Engine, EngineConfig, RequestTooLargeError, SimRequest, StepPlan
from extproc.sim.faults import Faults, FaultUpdate, parse_fault_update
from extproc.sim.kv_publisher import KVEventPublisher
from extproc.sim.lora import LoraLoadModel
from extproc.sim.metrics import register_metrics
from extproc.sim.profiles import DEFAULT_PROFILE, SIM_TOKENIZER, Profile, get_profile
from extproc.sim.workload import choose_output_len

__all__ = ["MAX_GPU_BLOCKS", "MAX_SPEED", "SimOptionError", "SimServer", "shared_token_counter", "LOAD_SHAPES"]

log = logging.getLogger(__name__)

LOAD_SHAPES = ("sglang", "vllm-router")
MAX_SPEED = 1e6
"""Most simulated seconds per wall second: at a million, a day's run keeps the simulated clock
(a float of wall time × speed) to ~20 µs, under the engine's millisecond steps; at 1e12 a step
vanished in the rounding within seconds, and at 1e308 the clock overflowed to inf and every
request after the second one hung."""
MAX_GPU_BLOCKS = 1 << 22
"""Most KV blocks in the pool (4,194,304): over twice the largest profile's pool at block size 1
(a100-llama-3.1-70b-tp8, 1.5 M tokens). The pool keeps one entry per block (~120 B), so 1e14
blocks exhausted memory at start instead of failing."""


class SimOptionError(ValueError):
    """A `SimServer` argument out of range: `option` is the keyword (`"speed"`), `problem` says
    what is wrong with the value (`"must be a finite number > 0, got nan"`); `str()` is both.
    `llm-extproc sim` names its own option (`--speed`) instead."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.option = option
        self.problem = problem
_MIN_TICK_S = 0.005  # wall seconds a multi-step decode plan may cover at least
_MAX_PLAN_STEPS = 256
_NEVER = 1 << 62
_counter_lock = threading.Lock()


@functools.cache
def _load_counter() -> TokenCounter:
    return TokenCounter.from_source(SIM_TOKENIZER)


def shared_token_counter() -> TokenCounter:
    """The Qwen3 token counter, loaded once per process (1–2 s) and shared by all servers."""
    with _counter_lock:
        return _load_counter()


_ARCH_CLASSES = {"qwen3": ("qwen3", "Qwen3ForCausalLM"), "llama": ("llama", "LlamaForCausalLM")}


@web.middleware
async def _fastapi_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown route or method answered as vLLM's FastAPI does: `{"detail": "Not Found"}`
    (JSON), not aiohttp's text/plain `404: Not Found`."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        return web.json_response({"detail": exc.reason}, status=exc.status)


def _check_options(
    *, host: str, model: str | None, speed: float, stream_interval: int, num_gpu_blocks: int | None, max_num_seqs: int | None,
    max_num_batched_tokens: int | None, block_size: int | None, max_model_len: int | None,
    gpu_memory_utilization: float | None, max_waiting: int | None, queue_full_status: int, load_shape: str,
) -> None:
    """`SimServer`'s arguments that need no profile, checked.

    Raises:
        SimOptionError: the first argument out of range. A zero for an optional size used to
            mean "the default" (Python's `or`), a NaN or inf speed hung every request, a
            memory fraction of 2 sized the pool for twice the GPU's memory.
    """
    if not host:
        raise SimOptionError("host", "must be an address to listen on (127.0.0.1, 0.0.0.0, ::), got ''")
    if model is not None and not model.strip():
        raise SimOptionError("model", f"must be a model name, got {model!r}")
    if not (0 < speed <= MAX_SPEED):  # also refuses NaN
        raise SimOptionError("speed", f"must be a finite number > 0 and ≤ {MAX_SPEED:g}, got {speed}")
    for name, value, least in (
        ("stream_interval", stream_interval, 1),
        ("num_gpu_blocks", num_gpu_blocks, 1),
        ("max_num_seqs", max_num_seqs, 1),
        ("max_num_batched_tokens", max_num_batched_tokens, 1),
        ("block_size", block_size, 1),
        ("max_model_len", max_model_len, 1),
        ("max_waiting", max_waiting, 0),
    ):
        if value is not None and value < least:
            raise SimOptionError(name, f"must be ≥ {least}, got {value}")
    if num_gpu_blocks is not None and num_gpu_blocks > MAX_GPU_BLOCKS:
        raise SimOptionError("num_gpu_blocks", f"must be ≤ {MAX_GPU_BLOCKS}, got {num_gpu_blocks}")
    if gpu_memory_utilization is not None and not (0 < gpu_memory_utilization <= 1):  # also refuses NaN
        raise SimOptionError("gpu_memory_utilization", f"must be a fraction in (0, 1], got {gpu_memory_utilization}")
    if gpu_memory_utilization is not None and num_gpu_blocks is not None:  # the fraction was silently ignored
        raise SimOptionError(
            "gpu_memory_utilization", f"sizes the KV pool, which num_gpu_blocks ({num_gpu_blocks}) already sets: give one, not both"
        )
    if queue_full_status not in (429, 503):
        raise SimOptionError("queue_full_status", f"must be 429 or 503, got {queue_full_status}")
    if load_shape not in LOAD_SHAPES:
        raise SimOptionError("load_shape", f"must be one of {', '.join(LOAD_SHAPES)}, got {load_shape!r}")


def _check_lora(
    modules: Sequence[str], model: str, max_loras: int, max_cpu_loras: int, rank: int, scale: float, metrics: str
) -> LoraLoadModel:
    """`SimServer`'s LoRA arguments, checked; the load-time model they give.

    Raises:
        SimOptionError: a blank or repeated adapter name, one equal to the model's, a negative
            slot count, `max_cpu_loras` below `max_loras`, a rank or scale out of range, or an
            unknown metric generation.
    """
    names = list(modules)
    if any(not n or n != n.strip() or "," in n for n in names):
        raise SimOptionError("lora_modules", f"adapter names must be non-blank, without commas or surrounding spaces, got {names!r}")
    if len(set(names)) != len(names) or (model and model in names):
        raise SimOptionError("lora_modules", "an adapter is named twice, or like the model")
    if max_loras < 0 or max_cpu_loras < 0:
        raise SimOptionError("max_loras", "slot counts must be ≥ 0")
    if max_cpu_loras and max_cpu_loras < max(1, max_loras):
        raise SimOptionError("max_cpu_loras", f"must be ≥ max_loras ({max(1, max_loras)}), got {max_cpu_loras}")
    if not (1 <= rank <= 512):
        raise SimOptionError("lora_rank", f"must be in 1..512, got {rank}")
    if not (0 < scale <= 1000):
        raise SimOptionError("lora_load_scale", f"must be in (0, 1000], got {scale}")
    if metrics not in ("residency", "activity"):
        raise SimOptionError("lora_metrics", f"must be residency or activity, got {metrics!r}")
    return LoraLoadModel(rank=rank, scale=scale)


def _prompt_tokens(reqs: list[SimRequest], n: int) -> int:
    """Usage's prompt tokens: each prompt once, however many (`n`) choices it has."""
    return sum(r.prompt_len for r in reqs[::n])


class SimServer:
    """A simulated vLLM server.

    Args:
        host, port: where to listen (port 0 = any free port; see `.port` after `start`).
        profile: a profile name (`extproc.sim.profiles.PROFILES`) or a `Profile`.
        model: served model name (default: the profile's model).
        speed: simulated seconds per wall second (10 = ten times faster than real).
        stream_interval: output tokens per streamed chunk (vLLM's `--stream-interval`).
        num_gpu_blocks: KV pool size override (blocks); default derived from the profile.
        max_num_seqs, max_num_batched_tokens, block_size, max_model_len: scheduler overrides
            (defaults: the profile's, i.e. vLLM's per-GPU defaults). `max_model_len` is lowered
            to the pool's capacity when the pool is smaller, as vLLM refuses to start otherwise.
        gpu_memory_utilization: vLLM's memory fraction (sizes the pool when not overridden).
        max_waiting: reject new requests while this many wait (None: unbounded).
        queue_full_status: 429 or 503 for those rejections.
        legacy_metrics: emit the pre-V1 metric names (see `extproc.sim.metrics`).
        load_shape: `/get_load` body: `sglang` or `vllm-router`.
        faults: faults active from the start.
        seed: seeds output-length draws and fault coin flips.
        registry: the Prometheus registry to register on (a fresh one if None).
        tokenizer: a token counter (default: the shared Qwen3 one).
        kv_events_endpoint: bind a KV-event PUB socket here (`tcp://127.0.0.1:5557`), or None.
        kv_events_replay: bind vLLM's replay ROUTER socket here, or None.
        role: P/D role (`prefill`, `decode`, `both`): a prefill-role engine refuses to pull KV
            (`do_remote_prefill`), a decode-role one to hold it for others (`do_remote_decode`);
            `both` does either (`extproc.sim.pd`).
        kv_link_gbytes_per_s: the KV transfer bandwidth a pull is charged at (GB/s; default 25,
            NIXL over one 400 Gb/s RDMA NIC: decision 0330).
        kv_hold_timeout_s: how long finished prefills hold their blocks for a pull (simulated
            seconds; vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`, 480).
        lora_modules: LoRA adapter names served on the model (vLLM `--lora-modules`): a request
            whose `model` names one runs with it (`extproc.sim.lora`); `/v1/models` lists each
            with the model as `parent`.
        max_loras / max_cpu_loras: GPU slots / host-cached adapters (vLLM's flags; `max_loras`
            defaults to 1 with adapters, `max_cpu_loras` to `max_loras`).
        lora_rank / lora_load_scale: the adapters' rank and a factor on their load time
            (`extproc.sim.lora.LoraLoadModel`).
        lora_metrics: the LoRA metric generation exported: `residency` (new and old) or
            `activity` (only `vllm:lora_requests_info`).

    Raises:
        SimOptionError: (a ValueError) an unknown profile, an empty model or host, or a size or
            setting out of range, naming the argument.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        profile: str | Profile = DEFAULT_PROFILE,
        model: str | None = None,
        speed: float = 1.0,
        stream_interval: int = 1,
        num_gpu_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_waiting: int | None = None,
        queue_full_status: int = 429,
        legacy_metrics: bool = False,
        load_shape: str = "sglang",
        faults: Faults | None = None,
        seed: int = 0,
        registry: CollectorRegistry | None = None,
        tokenizer: TokenCounter | None = None,
        kv_events_endpoint: str | None = None,
        kv_events_replay: str | None = None,
        role: str = "both",
        kv_link_gbytes_per_s: float = 25.0,
        kv_hold_timeout_s: float = 480.0,
        lora_modules: Sequence[str] = (),
        max_loras: int = 0,
        max_cpu_loras: int = 0,
        lora_rank: int = 16,
        lora_load_scale: float = 1.0,
        lora_metrics: str = "residency",
    ) -> None:
        if role not in ("prefill", "decode", "both"):
            raise SimOptionError("role", f"must be prefill, decode or both, got {role!r}")
        if not kv_link_gbytes_per_s > 0 or kv_link_gbytes_per_s == float("inf"):
            raise SimOptionError("kv_link_gbytes_per_s", f"must be a finite number > 0, got {kv_link_gbytes_per_s}")
        if not kv_hold_timeout_s > 0:
            raise SimOptionError("kv_hold_timeout_s", f"must be > 0, got {kv_hold_timeout_s}")
        self.role = role
        self.kv_link_bytes_per_s = kv_link_gbytes_per_s * 1e9
        self.kv_hold_timeout_s = kv_hold_timeout_s
        self.nixl = NixlStats()
        self._http: aiohttp.ClientSession | None = None
        try:
            self.profile = profile if isinstance(profile, Profile) else get_profile(profile)
        except KeyError as exc:
            raise SimOptionError("profile", f"names an {exc.args[0]}") from None
        _check_options(
            host=host, model=model, speed=speed, stream_interval=stream_interval, num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization, max_waiting=max_waiting,
            queue_full_status=queue_full_status, load_shape=load_shape,
        )
        if kv_events_replay is not None and kv_events_endpoint is None:
            raise SimOptionError("kv_events_replay", "needs kv_events_endpoint")
        lora_load = _check_lora(lora_modules, model or "", max_loras, max_cpu_loras, lora_rank, lora_load_scale, lora_metrics)
        p = self.profile
        bs = block_size or p.block_size
        try:
            capacity = p.kv_capacity_tokens(gpu_memory_utilization)
        except ValueError as exc:  # the weights do not fit
            raise SimOptionError("gpu_memory_utilization", f"{gpu_memory_utilization or p.gpu_memory_utilization} leaves no KV cache: {exc}") from None
        blocks = num_gpu_blocks or capacity // bs
        if blocks < 1:
            raise SimOptionError("block_size", f"must be at most the KV pool's {capacity} tokens, got {bs}")
        if blocks > MAX_GPU_BLOCKS:
            raise SimOptionError("block_size", f"{bs} makes {blocks} KV blocks, more than the {MAX_GPU_BLOCKS} the simulator holds")
        self.config = EngineConfig(
            num_gpu_blocks=blocks,
            block_size=bs,
            max_num_seqs=max_num_seqs or p.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or p.max_num_batched_tokens,
            max_model_len=min(max_model_len or p.max_model_len, blocks * bs),
            enable_kv_cache_events=kv_events_endpoint is not None,
            max_loras=(max_loras or 1) if lora_modules else 0,
            max_cpu_loras=max_cpu_loras if lora_modules else 0,
            lora_load=lora_load,
        )
        self.host = host
        self.port = port
        self.model = model or p.model
        self.lora_modules: tuple[str, ...] = tuple(lora_modules)
        self.lora_metrics = lora_metrics
        self.adapter_requests: dict[str, int] = {}
        """Engine requests per adapter name received (count): what the router sent as `model`."""
        self.speed = float(speed)
        self.stream_interval = stream_interval
        self.max_waiting = max_waiting
        self.queue_full_status = queue_full_status
        self.legacy_metrics = legacy_metrics
        self.load_shape = load_shape
        self._faults = faults or Faults()
        self._seed = seed
        self.registry = registry
        self._tokenizer = tokenizer
        self.engine: Engine | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._task: asyncio.Task[None] | None = None
        self._events: dict[int, asyncio.Event] = {}
        self._dropped: set[int] = set()
        self._waiter: asyncio.Future[str] | None = None
        self._wake_on_arrival = False
        self._fault_changed = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._wall0 = 0.0
        self._sim0 = 0.0
        self._started_unix = int(time.time())
        self.kv_events = KVEventPublisher(kv_events_endpoint, kv_events_replay) if kv_events_endpoint else None

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Load the tokenizer (once per process), build the engine, listen, start stepping."""
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(shared_token_counter)
        self.engine = Engine(self.config, self.profile.coefficients)
        self.engine.kv_hold_timeout_s = self.kv_hold_timeout_s
        if self.kv_events is not None:
            self.kv_events.start()
        if self.registry is None:
            self.registry = CollectorRegistry()
        register_metrics(self.registry, lambda: self._engine, self.model, legacy=self.legacy_metrics, nixl=self.nixl, lora_metrics=self.lora_metrics)
        self._rng = random.Random(self._seed)
        loop = asyncio.get_running_loop()
        self._wall0 = loop.time()
        self._sim0 = self.engine.now
        self._fault_changed = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_fastapi_errors])
        app.on_response_prepare.append(self._add_speed_header)
        self._routes(app)
        # handler_cancellation: a client that disconnects cancels its handler, whose `finally`
        # aborts the engine request (vLLM aborts on disconnect too, freeing the KV blocks).
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        await self._listen()
        self._task = asyncio.create_task(self._engine_loop(), name=f"sim-engine-{self.port}")

    async def aclose(self) -> None:
        """Stop stepping, end open streams, stop listening. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._fault_changed.set()
        for task in list(self._background):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for uid, ev in self._events.items():
            self._dropped.add(uid)
            ev.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()
        if self.kv_events is not None:
            await self.kv_events.aclose()

    async def _listen(self) -> None:
        assert self._runner is not None
        self._site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await self._site.start()
        server = self._site._server
        if self.port == 0 and server is not None and getattr(server, "sockets", None):
            self.port = server.sockets[0].getsockname()[1]

    @property
    def _engine(self) -> Engine:
        assert self.engine is not None, "SimServer.start() has not run"
        return self.engine

    # -- time -------------------------------------------------------------------------------
    def sim_now(self) -> float:
        """Current simulated time (seconds)."""
        return self._sim0 + (asyncio.get_running_loop().time() - self._wall0) * self.speed

    def _wall_of(self, sim_t: float) -> float:
        return self._wall0 + (sim_t - self._sim0) / self.speed

    # -- engine task ------------------------------------------------------------------------
    def _max_plan_steps(self) -> int:
        floor_step = max(self.profile.coefficients.a, 1e-6)
        by_tick = int(_MIN_TICK_S * self.speed / floor_step)
        return max(1, min(_MAX_PLAN_STEPS, max(self.stream_interval, by_tick)))

    def _wake(self, reason: Literal["arrival", "restart"]) -> None:
        """Wake the engine task: arrivals only while it is idle or in a multi-step plan."""
        w = self._waiter
        if w is not None and not w.done() and (reason != "arrival" or self._wake_on_arrival):
            w.set_result(reason)

    async def _sleep_until(self, deadline: float | None, *, wake_on_arrival: bool) -> str:
        loop = asyncio.get_running_loop()
        if deadline is not None and deadline <= loop.time():
            await asyncio.sleep(0)  # behind schedule: still let handlers run
            return "time"
        fut: asyncio.Future[str] = loop.create_future()
        handle = None
        if deadline is not None:
            handle = loop.call_at(deadline, lambda: fut.done() or fut.set_result("time"))
        self._waiter, self._wake_on_arrival = fut, wake_on_arrival or deadline is None
        try:
            return await fut
        finally:
            if handle is not None:
                handle.cancel()
            self._waiter = None

    async def _engine_loop(self) -> None:
        eng = self._engine
        while not self._closing:
            plan = eng.plan(self._max_plan_steps())
            if plan is None:
                nxt = eng.next_arrival()
                if nxt is not None:
                    eng.now = max(eng.now, nxt)
                    continue
                await self._sleep_until(None, wake_on_arrival=True)
                eng.now = max(eng.now, self.sim_now())
                continue
            await self._wait_for_plan(plan)
            eng.commit(plan)
            if self.kv_events is not None:
                self.kv_events.publish(eng.take_kv_events())

    async def _wait_for_plan(self, plan: StepPlan) -> None:
        multi = plan.steps > 1
        reason = await self._sleep_until(self._wall_of(plan.end), wake_on_arrival=multi)
        if reason == "arrival":
            # A request arrived during a multi-step decode: finish the step in progress, then
            # let the scheduler see it (as vLLM would at its next step).
            k = min(plan.steps, bisect_right(plan.ends, self.sim_now()) + 1)
            del plan.ends[k:]
            await self._sleep_until(self._wall_of(plan.end), wake_on_arrival=False)

    def _notify(self, req: SimRequest) -> None:
        ev = self._events.get(req.uid)
        if ev is not None:
            ev.set()

    # -- faults -----------------------------------------------------------------------------
    @property
    def faults(self) -> Faults:
        return self._faults

    async def update_faults(self, update: FaultUpdate | dict[str, Any]) -> Faults:
        """Merge a fault update (see `extproc.sim.faults`); returns the new fault set.

        Raises:
            ValueError: an invalid update.
        """
        upd = update if isinstance(update, FaultUpdate) else parse_fault_update(update)
        previous = self._faults
        await self._set_faults(previous.merged(upd))
        if upd.restart:
            self._restart()
        if upd.for_s is not None:
            changed = upd.model_dump(exclude_unset=True, exclude={"restart", "for_s"})
            revert = FaultUpdate.model_validate({k: getattr(previous, k) for k in changed})
            loop = asyncio.get_running_loop()
            loop.call_later(upd.for_s, self._spawn, self._set_faults_from(revert))
        return self._faults

    async def clear_faults(self) -> Faults:
        """Remove every fault."""
        await self._set_faults(Faults())
        return self._faults

    async def _set_faults_from(self, update: FaultUpdate) -> None:
        await self._set_faults(self._faults.merged(update))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _set_faults(self, new: Faults) -> None:
        old, self._faults = self._faults, new
        if new.refuse_connections != old.refuse_connections and not self._closing:
            if new.refuse_connections and self._site is not None:
                await self._site.stop()
                self._site = None
            elif not new.refuse_connections and self._site is None:
                await self._listen()
        self._fault_changed.set()
        self._fault_changed = asyncio.Event()

    def _restart(self) -> None:
        for req in self._engine.restart():
            self._dropped.add(req.uid)
            self._notify(req)
        if self.kv_events is not None:
            self.kv_events.restart()
        self._wake("restart")

    # -- HTTP -------------------------------------------------------------------------------
    async def _add_speed_header(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-sim-speed"] = repr(self.speed)

    def _routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/chat/completions", functools.partial(self._generate, kind="chat"))
        r.add_post("/v1/completions", functools.partial(self._generate, kind="completion"))
        r.add_post("/v1/responses", self._responses)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self._health)
        r.add_get("/metrics", self._metrics)
        r.add_get("/version", self._version)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        r.add_get("/get_load", self._get_load)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self._server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self._model_info)
        r.add_get("/sim/faults", self._faults_get)
        r.add_post("/sim/faults", self._faults_post)
        r.add_delete("/sim/faults", self._faults_delete)
        r.add_get("/sim/gpu", self._gpu)
        r.add_get("/sim/state", self._state)
        r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        r.add_post("/sim/kv/pull", self._kv_pull)

    @staticmethod
    def _json(data: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")

    @staticmethod
    def _error(err: SimAPIError) -> web.Response:
        if err.bare:
            return web.Response(status=err.status)
        return web.Response(body=err.body(), status=err.status, content_type="application/json")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model and model not in self.lora_modules:
            raise model_not_found(model)

    async def _prompts(self, params: Any, kind: str) -> list[list[int]]:
        """The token ids of each prompt: one for chat; one per prompt of a completions batch."""
        counter = self._tokenizer
        assert counter is not None
        try:
            if kind == "chat":
                return [counter.count_chat(
                    params.messages, tools=params.tools, chat_template_kwargs=params.chat_template_kwargs
                ).token_ids]  # fmt: skip
            prompt = params.prompt
            batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
            out = []
            for p in batch:
                ids = counter.count_text(p).token_ids if isinstance(p, str) else list(p)
                if not ids or any(not isinstance(t, int) or t < 0 for t in ids):
                    raise SimAPIError(400, "prompt: token ids must be non-negative integers, at least one", param="prompt")
                out.append(ids)
            return out
        except BadRequestError as exc:
            raise SimAPIError(400, exc.message, param=exc.param) from None

    async def _generate(self, request: web.Request, *, kind: Literal["chat", "completion"]) -> web.StreamResponse:
        try:
            raw = await request.read()
            params = parse_generation(raw, kind)
            transfer = self._transfer_of(params.model_extra)
            external = await self._pull_kv(transfer) if transfer is not None and transfer.role == "decode" else 0
            reqs = await self._enqueue(params, kind, hold_kv=transfer is not None and transfer.role == "prefill", external_tokens=external)
        except SimAPIError as err:
            return self._error(err)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        async with self._tracked(reqs) as event:
            if params.stream:
                try:
                    return await self._stream(request, reqs, params.n, event, kind, rid, created, params.include_usage)
                except ConnectionResetError:  # the client went away mid-stream
                    return web.Response(status=499)
            if not await self._wait_all(reqs, event):
                return self._die(request)
            choices = [(output_text(r.uid, 0, r.num_output), r.finish_reason or "stop") for r in reqs]
            # Both P/D sides report cached tokens (vLLM with --enable-prompt-tokens-details); a
            # decode side counts the pulled KV as cached, as vLLM does (the sidecar rewrites it).
            cached = reqs[0].cached_tokens if transfer is not None else None
            body = completion_body(kind, rid, created, reqs[0].lora or self.model, choices, _prompt_tokens(reqs, params.n), sum(r.num_output for r in reqs), cached)
            if transfer is not None and transfer.role == "prefill":
                body = self._with_transfer_params(body, reqs[0])
            return web.Response(body=body, content_type="application/json")

    def _transfer_of(self, extra: dict[str, Any] | None) -> TransferRequest | None:
        """The request's P/D part (`extproc.sim.pd.parse_kv_transfer` over the body's fields the
        generation parameters do not declare, `kv_transfer_params` among them), checked against
        the role.

        Raises:
            SimAPIError: 400 for malformed `kv_transfer_params` or a side this role does not take.
        """
        try:
            transfer = parse_kv_transfer(extra)
        except ValueError as exc:
            raise SimAPIError(400, str(exc), param="kv_transfer_params") from None
        if transfer is not None and self.role not in (transfer.role, "both"):
            raise SimAPIError(400, f"this engine's P/D role is {self.role}: it does not take the {transfer.role} side", param="kv_transfer_params")
        return transfer

    def _with_transfer_params(self, body: bytes, req: SimRequest) -> bytes:
        """A prefill response body with the `kv_transfer_params` pointing at its held blocks."""
        held = self._engine.kv_holds.get(req.request_id)
        out = orjson.loads(body)
        # None: nothing held (an aborted request), as vLLM returns no params then.
        out["kv_transfer_params"] = None if held is None else prefill_params(req.request_id, list(held[0]), f"sim-{self.port}", self.host, self.port)
        return orjson.dumps(out)

    async def _pull_kv(self, transfer: TransferRequest) -> int:
        """Pull a prompt's KV from the prefill engine and wait its transfer time; returns its
        prompt tokens (now computed here).

        Raises:
            SimAPIError: 500 when the prefill engine no longer holds the blocks, cannot be
                reached or answers no token count in 1..max_model_len
                (`kv_load_failure_policy=fail`: never recomputed here).
        """
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        url = f"http://{transfer.remote_host}:{transfer.remote_port}/sim/kv/pull"
        try:
            async with self._http.post(url, json={"request_id": transfer.remote_request_id}) as resp:
                answer = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            answer = None
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        # A count no prompt here could have (a bool, ≤ 0, past the context) is a failed pull: it
        # would be charged as a transfer of that size (a huge one never ends).
        if type(tokens) is not int or not 0 < tokens <= self.config.max_model_len:
            self.nixl.failed_transfers += 1
            raise SimAPIError(
                500,
                f"KV transfer failed: {transfer.remote_host}:{transfer.remote_port} no longer holds request "
                f"{transfer.remote_request_id}'s blocks (kv_load_failure_policy=fail)",
            )
        nbytes = tokens * self.profile.kv_bytes_per_token()
        seconds = nbytes / self.kv_link_bytes_per_s
        self.nixl.bytes_transferred.observe(nbytes)
        self.nixl.xfer_time.observe(seconds)
        await asyncio.sleep(seconds / self.speed)
        return tokens

    async def _kv_pull(self, request: web.Request) -> web.Response:
        """`POST /sim/kv/pull {"request_id"}` (prefill side): hand a held prompt's blocks over
        and free them here; 404 when none is held under that id (pulled, expired, restarted)."""
        body = await self._read_json(request)
        rid = body.get("request_id") if isinstance(body, dict) else None
        tokens = self._engine.release_kv_hold(rid, self.sim_now()) if isinstance(rid, str) else None
        if tokens is None:
            return self._json({"error": f"no KV held for request {rid!r}"}, status=404)
        self._wake("arrival")  # freed blocks may admit a waiting request
        return self._json({"tokens": tokens})

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/responses`: one generation over the request's chat messages."""
        try:
            params, req_in = parse_responses(await request.read())
            reqs = await self._enqueue(params, "chat")
        except SimAPIError as err:
            return self._error(err)
        (req,) = reqs
        rid, mid, created = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex, int(time.time())

        def final(text: str) -> dict[str, Any]:
            status = "incomplete" if req.finish_reason == "length" and params.max_tokens is not None else "completed"
            return responses_body(
                req_in, rid, created, req.lora or self.model, status=status, text=text, message_id=mid,
                prompt_tokens=req.prompt_len, completion_tokens=req.num_output,
            )  # fmt: skip

        async with self._tracked(reqs) as event:
            if not params.stream:
                if not await self._wait_all(reqs, event):
                    return self._die(request)
                return self._json(final(output_text(req.uid, 0, req.num_output)))
            try:
                return await self._stream_responses(request, req, event, req_in, rid, mid, created, final)
            except ConnectionResetError:
                return web.Response(status=499)

    async def _enqueue(self, params: Any, kind: str, *, hold_kv: bool = False, external_tokens: int = 0) -> list[SimRequest]:
        """Check a parsed request as vLLM does and enqueue its `n` engine requests (one per
        choice, sharing the prompt; vLLM V1 fans parallel sampling out the same way).

        Raises:
            SimAPIError: unknown model, injected error, context too long, queue full, or a
                request larger than the KV pool.
        """
        self._check_model(params.model)
        if self._faults.error_rate and self._rng.random() < self._faults.error_rate:
            raise SimAPIError(500, "Simulated internal server error (fault injection: error_rate)", bare=not self._faults.error_body)
        prompts = await self._prompts(params, kind)
        max_len = self.config.max_model_len
        for ids in prompts:
            if len(ids) >= max_len or (params.max_tokens is not None and len(ids) + params.max_tokens > max_len):
                raise context_length_error(max_len, len(ids), params.max_tokens)
        eng = self._engine
        if self.max_waiting is not None and eng.num_waiting >= self.max_waiting:
            raise SimAPIError(
                self.queue_full_status,
                f"The server is overloaded: {eng.num_waiting} requests are waiting (max_waiting={self.max_waiting})",
            )
        rng = random.Random(params.seed if params.seed is not None else self._rng.getrandbits(64))
        lora = params.model if params.model is not None and params.model in self.lora_modules else None
        if lora is not None:
            self.adapter_requests[lora] = self.adapter_requests.get(lora, 0) + len(prompts) * params.n
        reqs = []
        for ids in prompts:
            for _ in range(params.n):
                n_out, reason = choose_output_len(
                    rng,
                    cap=params.max_tokens if params.max_tokens is not None else max_len - len(ids),
                    max_tokens=params.max_tokens,
                    min_tokens=params.min_tokens,
                    ignore_eos=params.ignore_eos,
                )
                reqs.append(SimRequest(
                    ids, n_out, self.sim_now(), finish_reason=reason, notify=self._notify,
                    notify_every=self.stream_interval if params.stream else _NEVER,
                    hold_kv=hold_kv, external_tokens=external_tokens, lora=lora,
                ))  # fmt: skip
        added: list[SimRequest] = []
        try:
            for req in reqs:
                eng.add_request(req)
                added.append(req)
        except RequestTooLargeError as exc:
            for req in added:
                eng.abort(req)
            raise SimAPIError(400, str(exc)) from None
        return reqs

    @contextlib.asynccontextmanager
    async def _tracked(self, reqs: list[SimRequest]) -> AsyncIterator[asyncio.Event]:
        """One wake-up event for all of a response's engine requests; on the way out (done,
        client gone, server closing) the unfinished ones are aborted, freeing their KV blocks."""
        event = asyncio.Event()
        for req in reqs:
            self._events[req.uid] = event
        self._wake("arrival")
        try:
            yield event
        finally:
            for req in reqs:
                self._events.pop(req.uid, None)
                self._dropped.discard(req.uid)
                if not req.finished:
                    self._engine.abort(req)

    async def _wait_all(self, reqs: list[SimRequest], event: asyncio.Event) -> bool:
        """Wait until every request finished; False when the server dropped them (crash fault)."""
        while not all(r.finished for r in reqs):
            await event.wait()
            event.clear()
            if any(r.uid in self._dropped for r in reqs):
                return False
        return not any(r.uid in self._dropped for r in reqs)

    @staticmethod
    def _die(request: web.Request) -> web.StreamResponse:
        """Drop the connection without an answer (a crashed server)."""
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=500)

    def _chunk_writer(self, request: web.Request, resp: web.StreamResponse) -> Callable[[bytes], Awaitable[bool]]:
        """`send(data) -> False` once the `die_after_chunks` fault says the server crashes;
        writes `data` otherwise, after the `jitter_ms` fault's delay."""
        chunks = 0

        async def send(data: bytes) -> bool:
            nonlocal chunks
            faults = self._faults
            if faults.die_after_chunks is not None and chunks >= faults.die_after_chunks:
                return False
            if faults.jitter_ms:
                await asyncio.sleep(self._rng.uniform(0.0, faults.jitter_ms) / 1000.0 / self.speed)
            await resp.write(data)
            chunks += 1
            return True

        return send

    async def _tokens(self, reqs: list[SimRequest], event: asyncio.Event) -> AsyncIterator[list[tuple[int, int, int]] | None]:
        """The output as it comes: per wake-up, `(choice, start, end)` token ranges of each
        request (the first token of each goes alone, then `stream_interval` at a time); None
        when the server dropped the requests (crash fault). Yields nothing before the first
        token: vLLM answers a stream's headers only then."""
        sent = [0] * len(reqs)
        interval = self.stream_interval
        while True:
            await event.wait()
            event.clear()
            if any(r.uid in self._dropped for r in reqs):
                yield None
                return
            ranges = []
            for i, r in enumerate(reqs):
                n = r.num_output
                while sent[i] < n:
                    upto = min(n, sent[i] + (1 if sent[i] == 0 else interval))
                    ranges.append((i, sent[i], upto))
                    sent[i] = upto
            done = all(r.finished for r in reqs)
            if ranges or done:
                yield ranges
            if done:
                return

    async def _stream(
        self,
        request: web.Request,
        reqs: list[SimRequest],
        n: int,
        event: asyncio.Event,
        kind: Literal["chat", "completion"],
        rid: str,
        created: int,
        include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        send = self._chunk_writer(request, resp)
        started = False
        async for ranges in self._tokens(reqs, event):
            if ranges is None:
                return self._die(request)
            if not started:
                # vLLM answers a stream's headers and its role chunks only once the engine has
                # produced the first token (its generator yields nothing before that), so a
                # balancer that sees response headers sees the end of prefill.
                started = True
                await resp.prepare(request)
                if kind == "chat":
                    for i in range(len(reqs)):
                        if not await send(stream_chunk(kind, rid, created, reqs[0].lora or self.model, "", role=True, index=i)):
                            return self._die(request)
            for i, start, end in ranges:
                r = reqs[i]
                fin = (r.finish_reason or "stop") if r.finished and end == r.num_output else None
                chunk = stream_chunk(kind, rid, created, reqs[0].lora or self.model, output_text(r.uid, start, end), fin, index=i)
                if not await send(chunk):
                    return self._die(request)
        usage = usage_chunk(kind, rid, created, reqs[0].lora or self.model, _prompt_tokens(reqs, n), sum(r.num_output for r in reqs))
        if include_usage and not await send(usage):
            return self._die(request)
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _stream_responses(
        self,
        request: web.Request,
        req: SimRequest,
        event: asyncio.Event,
        req_in: Any,
        rid: str,
        mid: str,
        created: int,
        final: Callable[[str], dict[str, Any]],
    ) -> web.StreamResponse:
        """A Responses API stream, vLLM's events in vLLM's order: created, in_progress,
        output_item.added, content_part.added, output_text.delta per chunk, output_text.done,
        content_part.done, output_item.done, completed (with usage)."""
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        send = self._chunk_writer(request, resp)
        seq = itertools.count()
        pos = {"item_id": mid, "output_index": 0}
        part = {**pos, "content_index": 0}
        started = False
        async for ranges in self._tokens([req], event):
            if ranges is None:
                return self._die(request)
            if not started:
                started = True
                await resp.prepare(request)
                pending = responses_body(req_in, rid, created, req.lora or self.model, status="in_progress")
                item = {"id": mid, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
                for data in (
                    responses_event("response.created", next(seq), response=pending),
                    responses_event("response.in_progress", next(seq), response=pending),
                    responses_event("response.output_item.added", next(seq), output_index=0, item=item),
                    responses_event("response.content_part.added", next(seq), **part,
                                    part={"type": "output_text", "text": "", "annotations": []}),  # fmt: skip
                ):
                    if not await send(data):
                        return self._die(request)
            for _, start, end in ranges:
                delta = output_text(req.uid, start, end)
                if not await send(responses_event("response.output_text.delta", next(seq), **part, delta=delta, logprobs=[])):
                    return self._die(request)
        done = final(output_text(req.uid, 0, req.num_output))
        message = done["output"][0]
        text_part = message["content"][0]
        for data in (
            responses_event("response.output_text.done", next(seq), **part, text=text_part["text"], logprobs=[]),
            responses_event("response.content_part.done", next(seq), **part, part=text_part),
            responses_event("response.output_item.done", next(seq), output_index=0, item=message),
            responses_event("response.completed", next(seq), response=done),
        ):
            if not await send(data):
                return self._die(request)
        await resp.write_eof()
        return resp

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        eng = self._engine
        if not eng.pool.reset_prefix_cache():
            return self._error(SimAPIError(503, "cannot reset the prefix cache while requests hold KV blocks"))
        if self.kv_events is not None:
            self.kv_events.publish(eng.take_kv_events())
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return self._json(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model, "object": "model", "created": self._started_unix, "owned_by": "vllm",
                        "root": self.model, "parent": None, "max_model_len": self.config.max_model_len,
                    },
                    *(
                        {
                            "id": name, "object": "model", "created": self._started_unix, "owned_by": "vllm",
                            "root": name, "parent": self.model, "max_model_len": self.config.max_model_len,
                        }
                        for name in self.lora_modules
                    ),
                ],
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        if self._faults.health_fail:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return self._json({"version": "0.0.0+sim"})

    async def _metrics(self, request: web.Request) -> web.Response:
        while self._faults.metrics_hang and not self._closing:
            await self._fault_changed.wait()
        assert self.registry is not None
        return web.Response(body=generate_latest(self.registry), headers={"content-type": CONTENT_TYPE_LATEST})

    async def _read_json(self, request: web.Request) -> Any:
        try:
            return orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError as exc:
            raise SimAPIError(400, f"Invalid JSON body: {exc}") from None

    async def _tokenize(self, request: web.Request) -> web.Response:
        counter = self._tokenizer
        assert counter is not None
        try:
            data = await self._read_json(request)
            if not isinstance(data, dict):
                raise SimAPIError(400, "The request body must be a JSON object")
            self._check_model(data.get("model"))
            if isinstance(data.get("messages"), list):
                try:
                    text = counter.render_chat(
                        chat_messages(data["messages"]), tools=data.get("tools"),
                        chat_template_kwargs=data.get("chat_template_kwargs"),
                        add_generation_prompt=bool(data.get("add_generation_prompt", True)),
                    )
                except BadRequestError as exc:
                    raise SimAPIError(400, exc.message, param="messages") from None
                ids = counter.encode(text, add_special_tokens=bool(data.get("add_special_tokens", False)))
            elif isinstance(data.get("prompt"), str):
                ids = counter.encode(data["prompt"], add_special_tokens=bool(data.get("add_special_tokens", True)))
            else:
                raise SimAPIError(400, "prompt (a string) or messages (a list) is required", param="prompt")
        except SimAPIError as err:
            return self._error(err)
        strs = counter.tokenizer.convert_ids_to_tokens(ids) if data.get("return_token_strs") else None
        return self._json({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": strs})

    async def _detokenize(self, request: web.Request) -> web.Response:
        counter = self._tokenizer
        assert counter is not None
        try:
            data = await self._read_json(request)
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if not isinstance(tokens, list) or any(not isinstance(t, int) or t < 0 for t in tokens):
                raise SimAPIError(400, "tokens: a list of non-negative integers is required", param="tokens")
            self._check_model(data.get("model"))
        except SimAPIError as err:
            return self._error(err)
        return self._json({"prompt": counter.tokenizer.decode(tokens)})

    async def _get_load(self, request: web.Request) -> web.Response:
        eng = self._engine
        running, waiting = len(eng.running), eng.num_waiting
        if self.load_shape == "vllm-router":
            return self._json({"load": running + waiting})
        tokens = sum(r.num_tokens for r in eng.running)
        return self._json([{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens}])

    async def _server_info(self, request: web.Request) -> web.Response:
        cfg = self.config
        return self._json(
            {
                "model_path": self.model,
                "tokenizer_path": self.model,
                "served_model_name": self.model,
                "dp_size": 1,
                "tp_size": self.profile.tensor_parallel,
                "max_total_num_tokens": cfg.num_gpu_blocks * cfg.block_size,
                "max_running_requests": cfg.max_num_seqs,
                "max_batch_size": cfg.max_num_seqs,
                "max_prefill_tokens": cfg.max_num_batched_tokens,
                "context_length": cfg.max_model_len,
                "page_size": cfg.block_size,
                "disaggregation_mode": "null",
                "version": "0.0.0+sim",
                "sim_profile": self.profile.name,
            }
        )

    async def _model_info(self, request: web.Request) -> web.Response:
        model_type, arch_class = next(
            (v for k, v in _ARCH_CLASSES.items() if self.profile.arch_name.startswith(k)), ("", "")
        )
        return self._json(
            {
                "model_path": self.model,
                "tokenizer_path": self.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "model_type": model_type,
                "architectures": [arch_class] if arch_class else [],
            }
        )

    async def _faults_get(self, request: web.Request) -> web.Response:
        return self._json(self._faults.model_dump())

    async def _faults_post(self, request: web.Request) -> web.Response:
        try:
            data = await self._read_json(request)
            if data == {}:
                return self._json((await self.clear_faults()).model_dump())
            try:
                faults = await self.update_faults(data)
            except ValueError as exc:
                raise SimAPIError(400, str(exc)) from None
        except SimAPIError as err:
            return self._error(err)
        return self._json(faults.model_dump())

    async def _faults_delete(self, request: web.Request) -> web.Response:
        return self._json((await self.clear_faults()).model_dump())

    def gpu_view(self) -> dict[str, Any]:
        """Simulated per-GPU memory (bytes) and utilisation (busy fraction of the last
        simulated second): weights + activations (the profile's reserve, scaled by how full
        the last step's token budget was) + KV blocks in use."""
        eng = self._engine
        p = self.profile
        block_bytes = p.kv_bytes_per_token() * self.config.block_size
        plan_tokens = eng.stats.last_batch_tokens
        activations = int(p.reserve_bytes * min(1.0, plan_tokens / self.config.max_num_batched_tokens))
        used = p.weight_bytes() + activations + eng.pool.num_used * block_bytes
        return {
            "memory_used_bytes": int(min(used, p.gpu.memory_bytes)),
            "memory_total_bytes": int(p.gpu.memory_bytes),
            "utilization": round(eng.stats.utilization(max(eng.now, self.sim_now())), 4),
        }

    async def _gpu(self, request: web.Request) -> web.Response:
        return self._json(self.gpu_view())

    async def _state(self, request: web.Request) -> web.Response:
        eng = self._engine
        s = eng.stats
        return self._json(
            {
                "profile": self.profile.name,
                "model": self.model,
                "role": self.role,
                "kv_holds": len(eng.kv_holds),
                "kv_held_blocks": sum(len(b) for b, _, _ in eng.kv_holds.values()),
                "speed": self.speed,
                "sim_now": self.sim_now(),
                "engine_now": eng.now,
                "running": len(eng.running),
                "waiting": eng.num_waiting,
                "kv_cache_usage": eng.pool.usage,
                "num_gpu_blocks": self.config.num_gpu_blocks,
                "num_free_blocks": eng.pool.num_free,
                "num_cached_blocks": eng.pool.num_cached,
                "block_size": self.config.block_size,
                "max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "max_model_len": self.config.max_model_len,
                "prompt_tokens": s.prompt_tokens,
                "generation_tokens": s.generation_tokens,
                "preemptions": s.preemptions,
                "finished": s.finished,
                "steps": s.steps,
                "lora": self.lora_view(),
            }
        )

    def lora_view(self) -> dict[str, Any] | None:
        """The LoRA state (`/state`'s `lora`): slots, loaded adapters, loads and evictions so
        far, requests per adapter; None with LoRA off."""
        slots = self._engine.lora
        if slots is None:
            return None
        return {
            "max_loras": slots.max_loras,
            "max_cpu_loras": slots.max_cpu_loras,
            "gpu": list(slots.gpu),
            "cpu": slots.host_only(),
            "loads": slots.loads,
            "loads_from_disk": slots.loads_from_disk,
            "loads_from_host": slots.loads_from_host,
            "evictions": slots.evictions,
            "load_seconds": slots.load_seconds,
            "requests": dict(self.adapter_requests),
        }
