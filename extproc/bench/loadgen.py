"""Open-loop load generator: replay a workload against an OpenAI-compatible base URL.

Every request is sent at its arrival time whether or not earlier ones have finished (open loop,
as production traffic arrives), unless `closed_loop_sessions` is set: then a turn of a session
waits for the session's previous turn to end (answer or error) plus `think_time_s`, as a user
reads an answer before typing the next message (a closed loop per conversation, open across
conversations). Each request is sent as a streaming chat completion with the output length pinned:
`max_tokens = min_tokens = output_tokens`, `ignore_eos: true`, `stream_options.include_usage`.
All streams share one event loop and one aiohttp session (no connection limit).

Time: wall-clock inter-arrival gaps are trace gaps / `speed`. Latencies are reported in the
run's time unit: wall seconds × scale, where scale is the response header `x-sim-speed` when
the backend sends it (the simulator compresses time by that factor) and `speed` otherwise; the
unit is "simulated" when either is in play, else "wall". `speed` is meant for the simulator;
to compress a trace against real engines, use the readers' `rate_scale` instead.

Per request we record: HTTP status; an error reason (`"429 rate_limit_exceeded"`: status plus
the JSON error's `code`, else its `type`; or `timeout`, `connection_error`, `stream_truncated`,
`stream_error <code>`, `bad_stream`, `cancelled`); TTFT (send → first event with content);
each gap between content events and the tokens each carried (exact when the backend sends
cumulative usage per chunk, vLLM's `continuous_usage_stats`, else spread evenly over the events
from the final usage); E2E (send → end of stream); output tokens from `usage`; the endpoint
that served it (first response header present among `endpoint_headers`); and how late the send
was against the schedule (a send more than `lag_threshold_s` late counts as behind schedule).

Refusals: with `LoadGenConfig.retry` a refused request (429 or 503) is sent again, as a new
attempt with its own `RequestResult` (same `index`, `attempt` 1, 2, ...): at once (`immediate`, a
client that ignores `retry-after`) or after the response's `retry-after` seconds (`retry-after`,
wall seconds: the gateway's clock, not the simulator's), at most `max_attempts` sends in all.
A later attempt records `waited_s`, the time since the first attempt was sent, so a client's
own TTFT is `waited_s + ttft_s`.

Ctrl-C: `stop()` (or `run(..., handle_signals=True)`) stops sending and cancels in-flight
requests, which are recorded as `cancelled`; `run` still returns what was measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from extproc.models import DEFAULT_MODEL
from extproc.protocol.sse import SSEError, SSEParser

if TYPE_CHECKING:
    from extproc.bench.prompts import PromptSynthesizer
    from extproc.bench.traces import TraceRequest

__all__ = [
    "LoadGenConfig", "LoadGenerator", "Progress", "RequestResult", "RetryPolicy", "RunRecord", "error_reason",
    "parse_retry_after",
]

_ERROR_BODY_LIMIT = 64 * 1024
_RETRY_STATUSES = (429, 503)
_RETRY_AFTER_MAX_S = 3600.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """What a client does with a refusal (HTTP 429 or 503).

    Attributes:
        mode: `never` (give up), `immediate` (send again at once, ignoring `retry-after`: a
            flooding client), `retry-after` (wait the response's `retry-after`, else
            `default_wait_s`, then send again).
        max_attempts: sends of one request in all, the first included (>= 1).
        default_wait_s: the wait when `retry-after` is absent or unreadable (wall seconds).
        give_up_after_s: no resend starts later than this after the request's first send
            (wall seconds), as a client gives up at last (a `retry-after` of a minute would
            otherwise outlast a short run).
    """

    mode: str = "never"
    max_attempts: int = 1
    default_wait_s: float = 1.0
    give_up_after_s: float = math.inf

    def __post_init__(self) -> None:
        if self.mode not in ("never", "immediate", "retry-after"):
            raise ValueError(f"retry mode must be never, immediate or retry-after, got {self.mode!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not (self.default_wait_s >= 0 and math.isfinite(self.default_wait_s)):
            raise ValueError(f"default_wait_s must be a finite number >= 0, got {self.default_wait_s}")
        if not self.give_up_after_s >= 0:
            raise ValueError(f"give_up_after_s must be >= 0, got {self.give_up_after_s}")

    def wait_s(self, result: RequestResult, attempts: int, waited_s: float = 0.0) -> float | None:
        """Wall seconds to wait before sending `result`'s request again, after `attempts` sends
        and `waited_s` wall seconds since its first; None: do not send it again (not a refusal,
        mode `never`, attempts used up, or the resend would start past `give_up_after_s`)."""
        if self.mode == "never" or attempts >= self.max_attempts or result.status not in _RETRY_STATUSES:
            return None
        wait = 0.0 if self.mode == "immediate" else (
            self.default_wait_s if result.retry_after_s is None else result.retry_after_s
        )  # fmt: skip
        return None if waited_s + wait > self.give_up_after_s else wait


def parse_retry_after(value: str | None) -> float | None:
    """`retry-after` as seconds (RFC 9110 delay-seconds; an HTTP date is not read): None when
    absent or not a number >= 0; capped at an hour."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not (seconds >= 0 and math.isfinite(seconds)):
        return None
    return min(seconds, _RETRY_AFTER_MAX_S)


@dataclass(frozen=True, slots=True)
class LoadGenConfig:
    """How to replay a workload.

    Attributes:
        base_url: e.g. `http://127.0.0.1:8080` (Envoy, a router, or an engine).
        model: the `model` field sent.
        path: request path appended to `base_url`.
        speed: time compression: wall gaps = trace gaps / speed; latencies × speed unless the
            backend sends `x-sim-speed` (> 0).
        max_requests: send at most this many (None: all).
        duration_s: send only requests arriving within this many trace seconds of the first.
        request_timeout_s: per-request limit, connect to end of stream (wall seconds; finite).
        endpoint_headers: response headers naming the endpoint that served, first found wins.
        headers: extra request headers.
        debug_header: when set, keep this response header's value (llm-extproc's
            `x-llm-route-debug`: why the endpoint was chosen) in `RequestResult.route_debug`.
        session_header: when set, send each request's `session` in this header.
        lag_threshold_s: a send later than this behind schedule counts as behind (wall seconds).
        continuous_usage_stats: ask for usage in every chunk (vLLM), for exact tokens per chunk.
        closed_loop_sessions: send a request with a `session` only after the previous request of
            that session (in arrival order) ended, and not before its own arrival time.
        think_time_s: with `closed_loop_sessions`, the wait after the previous turn ended
            (trace seconds; wall = this / speed).
        max_tokens: when set, every request asks for this `max_tokens` (tokens; at least its
            output length) with `min_tokens` its output length and no `ignore_eos`, as clients
            that send a huge `max_tokens` do: an engine (the simulator: its log-normal draw,
            median 150 tokens) then stops at the output length or later, at its own end of
            sequence. None: `max_tokens = min_tokens = output length` with `ignore_eos`.
        retry: what to do with a 429 / 503 (`RetryPolicy`; default: give up).
    """

    base_url: str
    model: str = DEFAULT_MODEL
    path: str = "/v1/chat/completions"
    speed: float = 1.0
    max_requests: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 300.0
    endpoint_headers: tuple[str, ...] = ("x-llm-endpoint", "x-served-by")
    headers: Mapping[str, str] = field(default_factory=dict)
    debug_header: str | None = None
    session_header: str | None = None
    lag_threshold_s: float = 0.050
    continuous_usage_stats: bool = False
    closed_loop_sessions: bool = False
    think_time_s: float = 0.0
    max_tokens: int | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not (self.speed > 0 and math.isfinite(self.speed)):
            raise ValueError(f"speed must be a positive number, got {self.speed}")
        if not (0 < self.request_timeout_s < math.inf):  # aiohttp raised OverflowError on every request at inf
            raise ValueError(f"request_timeout_s must be a finite number > 0, got {self.request_timeout_s}")
        if self.max_requests is not None and self.max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {self.max_requests}")
        if self.duration_s is not None and self.duration_s < 0:
            raise ValueError(f"duration_s must be >= 0, got {self.duration_s}")
        if not (self.think_time_s >= 0 and math.isfinite(self.think_time_s)):
            raise ValueError(f"think_time_s must be a finite number >= 0, got {self.think_time_s}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(slots=True)
class RequestResult:
    """What one request did. Latencies are in the run's time unit (seconds); see the module doc.

    Attributes:
        index: position in the replayed workload.
        scheduled_s: arrival time in the trace (trace seconds).
        lag_s: how late it was sent against the schedule (wall seconds, >= 0 when late).
        input_tokens: the trace's prompt length (tokens).
        max_tokens: output length asked for (tokens).
        session: the trace's session id, if any.
        sent_wall_s / done_wall_s: send and end times since the run started (wall seconds).
        status: HTTP status, None when no response came.
        error: error reason, None on success.
        error_detail: the error message, shortened, for diagnostics.
        endpoint: the endpoint that served it, when a header said so.
        route_debug: the router's explanation of the choice (`LoadGenConfig.debug_header`).
        time_scale: wall → reported time factor used for this request.
        ttft_s: time to the first content event.
        e2e_s: time to the end of the stream.
        chunk_gaps_s: gaps between consecutive content events (len = events − 1).
        chunk_tokens: tokens carried by each content event.
        chunk_tokens_exact: whether `chunk_tokens` came from per-chunk usage (else estimated).
        output_tokens / prompt_tokens: from the response's `usage`, when sent.
        attempt: 0 for the first send of a request, n for its n-th resend (`RetryPolicy`).
        waited_s: time from the request's first send to this attempt's send (run's unit).
        retry_after_s: the response's `retry-after` (seconds), when it sent one.
    """

    index: int
    scheduled_s: float
    lag_s: float
    input_tokens: int
    max_tokens: int
    session: str | None = None
    sent_wall_s: float = 0.0
    done_wall_s: float | None = None
    status: int | None = None
    error: str | None = None
    error_detail: str | None = None
    endpoint: str | None = None
    route_debug: str | None = None
    time_scale: float = 1.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    chunk_tokens: list[float] = field(default_factory=list)
    chunk_tokens_exact: bool = False
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    attempt: int = 0
    waited_s: float = 0.0
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        """Completed: HTTP 200, a full stream, no error."""
        return self.error is None and self.status == 200

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency: (E2E − TTFT) / (output tokens − 1); None below 2 tokens."""
        if self.e2e_s is None or self.ttft_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class RunRecord:
    """One replay's raw results.

    Attributes:
        results: one per request sent, in send order.
        time_unit: "simulated" (latencies scaled) or "wall".
        time_scale: wall → reported time factor of the run.
        wall_duration_s: first send to last end (wall seconds).
        planned: requests the run meant to send (after `max_requests` / `duration_s`).
        interrupted: stopped early by `stop()`.
        warnings: notes for the reader (e.g. the backend's speed differs from ours).
        lag_threshold_s: sends later than this counted as behind schedule (wall seconds).
    """

    results: list[RequestResult]
    time_unit: str
    time_scale: float
    wall_duration_s: float
    planned: int
    interrupted: bool = False
    warnings: list[str] = field(default_factory=list)
    lag_threshold_s: float = 0.050

    @property
    def duration_s(self) -> float:
        """First send to last end, in the run's time unit (seconds)."""
        return self.wall_duration_s * self.time_scale

    @property
    def offered_span_s(self) -> float:
        """Trace time between the first and the last request sent (seconds)."""
        if not self.results:
            return 0.0
        times = [r.scheduled_s for r in self.results]
        return max(times) - min(times)


@dataclass(frozen=True, slots=True)
class Progress:
    """A snapshot for progress displays (counts of requests)."""

    planned: int
    sent: int
    completed: int
    failed: int
    in_flight: int
    behind: int


def _error_fields(body: bytes) -> tuple[str | None, str | None]:
    """`(code, message)` of an error body: OpenAI's `{"error": {...}}` or vLLM's flat shape.

    The code is the error's string `code`, else its `type` (vLLM puts the HTTP status, an int, in
    `code`); the message falls back to the body's first 200 characters.
    """
    code: Any = None
    message = None
    with contextlib.suppress(orjson.JSONDecodeError, TypeError):
        obj = orjson.loads(body)
        if isinstance(obj, dict):
            err = obj["error"] if isinstance(obj.get("error"), dict) else obj
            code = err.get("code") if isinstance(err.get("code"), str) and err.get("code") else err.get("type")
            message = err.get("message") if isinstance(err.get("message"), str) else None
    if message is None and body:
        message = body[:200].decode("utf-8", errors="replace")
    return (code if isinstance(code, str) and code else None), message


def error_reason(status: int, body: bytes) -> tuple[str, str | None]:
    """`("429 rate_limit_exceeded", message)` from an HTTP error response (status, then code)."""
    code, message = _error_fields(body)
    return (f"{status} {code}" if code else str(status)), message


class LoadGenerator:
    """Replays `TraceRequest`s open-loop against `config.base_url`.

    Args:
        config: the replay settings.
        prompts: builds messages for requests without text (token-length traces); may be None
            when every request carries `messages`.
        on_progress: called with a `Progress` after every send and every completion.
    """

    def __init__(
        self,
        config: LoadGenConfig,
        prompts: PromptSynthesizer | None = None,
        *,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.config = config
        self.prompts = prompts
        self.on_progress = on_progress
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._counts = {"sent": 0, "completed": 0, "failed": 0, "behind": 0}
        self._planned = 0
        self._header_scales: set[float] = set()

    def stop(self) -> None:
        """Stop sending and cancel in-flight requests (call from the event loop's thread). A stop
        that comes before `run()` (a signal while the replay is being set up) makes it return at
        once."""
        self._stop_requested = True
        if self._stop is not None:
            self._stop.set()

    def plan(self, requests: Iterable[TraceRequest]) -> list[TraceRequest]:
        """The requests a run will send: sorted by arrival, cut by `max_requests` and `duration_s`."""
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        if ordered and self.config.duration_s is not None:
            end = ordered[0].arrival_s + self.config.duration_s
            ordered = [r for r in ordered if r.arrival_s <= end]
        if self.config.max_requests is not None:
            ordered = ordered[: self.config.max_requests]
        return ordered

    def max_tokens(self, request: TraceRequest) -> int:
        """The `max_tokens` sent for `request` (tokens): its output length, or the configured
        budget (`LoadGenConfig.max_tokens`) when that is larger."""
        return request.output_tokens if self.config.max_tokens is None else max(self.config.max_tokens, request.output_tokens)

    def body(self, request: TraceRequest, index: int) -> bytes:
        """The JSON body sent for `request` (bytes)."""
        if request.messages is not None:
            messages = request.messages
        elif self.prompts is not None:
            messages = self.prompts.messages_for(request, key=str(index))
        else:
            raise ValueError("requests without messages need a PromptSynthesizer (prompts=...)")
        stream_options: dict[str, bool] = {"include_usage": True}
        if self.config.continuous_usage_stats:
            stream_options["continuous_usage_stats"] = True
        body: dict[str, object] = {
            "model": request.model or self.config.model,
            "messages": messages,
            "stream": True,
            "stream_options": stream_options,
            "max_tokens": self.max_tokens(request),
            "min_tokens": request.output_tokens,
        }
        if self.config.max_tokens is None:  # else a client's huge budget: the engine stops by itself
            body["ignore_eos"] = True
        return orjson.dumps(body)

    async def run(self, requests: Iterable[TraceRequest], *, handle_signals: bool = False) -> RunRecord:
        """Replay `requests`; returns when all sent requests ended (or were cancelled by `stop()`).

        Args:
            requests: the workload (any order; sent by `arrival_s`).
            handle_signals: install SIGINT/SIGTERM handlers that call `stop()` for the run's
                duration (main thread only; ignored elsewhere).
        """
        loop = asyncio.get_running_loop()
        planned = self.plan(requests)
        if self.prompts is None and any(r.messages is None for r in planned):
            raise ValueError("requests without messages need a PromptSynthesizer (prompts=...)")
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        self._planned = len(planned)
        self._counts = dict.fromkeys(self._counts, 0)
        self._header_scales = set()
        installed = self._install_signals(loop) if handle_signals else []
        results: list[RequestResult] = []
        tasks: set[asyncio.Task[None]] = set()
        stop_waiter = asyncio.ensure_future(self._stop.wait())
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                try:
                    await self._send_all(session, planned, results, tasks, stop_waiter)
                    while tasks and not self._stop.is_set():
                        await asyncio.wait({*tasks, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:  # stopped, or the run itself cancelled: nothing outlives the session
                    for task in list(tasks):
                        task.cancel()
                    if tasks:
                        await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            stop_waiter.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)
        return self._record(results, interrupted=self._stop.is_set())

    async def _send_all(
        self,
        session: aiohttp.ClientSession,
        planned: list[TraceRequest],
        results: list[RequestResult],
        tasks: set[asyncio.Task[None]],
        stop_waiter: asyncio.Future[bool],
    ) -> None:
        """The schedule: start each request at its wall time (trace gap / speed) until stopped;
        with `closed_loop_sessions`, a later turn of a session is handed to a task that waits for
        the turn before it (`_send_after`)."""
        assert self._stop is not None
        loop = asyncio.get_running_loop()
        url = self.config.base_url.rstrip("/") + self.config.path
        t0 = loop.time()
        first = planned[0].arrival_s if planned else 0.0
        last_turn: dict[str, asyncio.Task[None]] = {}
        for index, request in enumerate(planned):
            body = self.body(request, index)  # built while waiting for the send time
            target = t0 + (request.arrival_s - first) / self.config.speed
            previous = last_turn.get(request.session) if request.session is not None else None
            if previous is not None:
                task = asyncio.create_task(
                    self._send_after(previous, session, url, body, request, index, target, results, t0)
                )
            else:
                delay = target - loop.time()
                if delay > 0:
                    await asyncio.wait({stop_waiter}, timeout=delay)
                if self._stop.is_set():
                    return
                task = asyncio.create_task(self._attempts(session, url, body, request, index, target, results, t0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if self.config.closed_loop_sessions and request.session is not None:
                last_turn[request.session] = task

    async def _send_after(
        self,
        previous: asyncio.Task[None],
        session: aiohttp.ClientSession,
        url: str,
        body: bytes,
        request: TraceRequest,
        index: int,
        target: float,
        results: list[RequestResult],
        t0: float,
    ) -> None:
        """Send a later turn once the session's previous turn ended and the think time passed
        (never before its own arrival time `target`, a loop time); its lag counts from then."""
        loop = asyncio.get_running_loop()
        await asyncio.wait({previous})  # its outcome is its own; this turn goes either way
        target = max(target, loop.time() + self.config.think_time_s / self.config.speed)
        delay = target - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await self._attempts(session, url, body, request, index, target, results, t0)

    async def _attempts(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: bytes,
        request: TraceRequest,
        index: int,
        target: float,
        results: list[RequestResult],
        t0: float,
    ) -> None:
        """Send `request` now, and again after each refusal as `config.retry` says (a resend is
        a new attempt, due at once: its lag is 0 unless the loop is late)."""
        assert self._stop is not None
        loop = asyncio.get_running_loop()
        headers, result = self._start(request, index, target, results, t0)
        first = result.sent_wall_s
        await self._send(session, url, body, headers, result, t0)
        attempts = 1
        while not self._stop.is_set():
            wait = self.config.retry.wait_s(result, attempts, loop.time() - t0 - first)
            if wait is None:
                break
            if wait > 0:
                await asyncio.sleep(wait)
            headers, result = self._start(request, index, loop.time(), results, t0)
            result.attempt = attempts
            result.waited_s = (result.sent_wall_s - first) * self.config.speed
            attempts += 1
            await self._send(session, url, body, headers, result, t0)

    def _start(
        self, request: TraceRequest, index: int, target: float, results: list[RequestResult], t0: float
    ) -> tuple[dict[str, str], RequestResult]:
        """Record a send now (its result, lag, counts): `(headers, result)` for `_send`."""
        now = asyncio.get_running_loop().time()
        result = RequestResult(
            index=index,
            scheduled_s=request.arrival_s,
            lag_s=now - target,
            input_tokens=request.input_tokens,
            max_tokens=self.max_tokens(request),
            session=request.session,
            sent_wall_s=now - t0,
            time_scale=self.config.speed,
        )
        results.append(result)
        self._counts["sent"] += 1
        self._counts["behind"] += result.lag_s > self.config.lag_threshold_s
        headers = {"content-type": "application/json", **self.config.headers}
        if self.config.session_header and request.session:
            headers[self.config.session_header] = request.session
        self._report()
        return headers, result

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> list[int]:
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.stop)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        return installed

    def _report(self) -> None:
        if self.on_progress is not None:
            c = self._counts
            in_flight = c["sent"] - c["completed"] - c["failed"]
            self.on_progress(Progress(self._planned, c["sent"], c["completed"], c["failed"], in_flight, c["behind"]))

    def _record(self, results: list[RequestResult], *, interrupted: bool) -> RunRecord:
        ends = [r.done_wall_s for r in results if r.done_wall_s is not None]
        wall = (max(ends) - min(r.sent_wall_s for r in results)) if ends else 0.0
        scale, warnings = self.config.speed, []
        if self._header_scales:
            scale = min(self._header_scales)
            if self._header_scales != {self.config.speed}:
                warnings.append(
                    f"backend reports x-sim-speed {sorted(self._header_scales)} but arrivals were sent at "
                    f"speed {self.config.speed}: latencies use the backend's factor"
                )
        unit = "simulated" if (self._header_scales or scale != 1.0) else "wall"
        return RunRecord(
            results, unit, scale, wall, self._planned, interrupted, warnings, self.config.lag_threshold_s
        )

    def _scale(self, response: aiohttp.ClientResponse) -> float:
        """Wall → reported time factor: the backend's `x-sim-speed` if valid, else our speed."""
        raw = response.headers.get("x-sim-speed")
        if raw is not None:
            with contextlib.suppress(ValueError):
                value = float(raw)
                if value > 0 and math.isfinite(value):
                    self._header_scales.add(value)
                    return value
        return self.config.speed

    async def _send(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: bytes,
        headers: dict[str, str],
        result: RequestResult,
        t0: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        event_times: list[float] = []
        cumulative: list[int | None] = []
        done = False
        got_response = False
        try:
            async with session.post(url, data=body, headers=headers) as response:
                got_response = True
                result.status = response.status
                result.time_scale = self._scale(response)
                result.endpoint = next(
                    (response.headers[h] for h in self.config.endpoint_headers if h in response.headers), None
                )
                if self.config.debug_header is not None:
                    result.route_debug = response.headers.get(self.config.debug_header)
                if response.status != 200:
                    result.retry_after_s = parse_retry_after(response.headers.get("retry-after"))
                    result.error, result.error_detail = error_reason(
                        response.status, await response.content.read(_ERROR_BODY_LIMIT)
                    )
                    return
                if not response.content_type.startswith("text/event-stream"):
                    result.error = "bad_stream"
                    result.error_detail = f"content-type {response.content_type!r}, expected text/event-stream"
                    return
                parser = SSEParser()
                async for chunk in response.content.iter_any():
                    now = loop.time()
                    for event in parser.feed(chunk):
                        if event.data.strip() == "[DONE]":
                            done = True
                            continue
                        if not self._event(event.data, now, event_times, cumulative, result):
                            return
                if not done:
                    result.error = "stream_truncated"
                    result.error_detail = "the stream ended without data: [DONE]"
        except asyncio.CancelledError:
            result.error = "cancelled"
            raise
        except TimeoutError:
            result.error = "timeout"
            result.error_detail = f"no complete answer within {self.config.request_timeout_s} s"
        except SSEError as exc:  # a line or event beyond the parser's bounds: not an engine's stream
            result.error = "bad_stream"
            result.error_detail = str(exc)[:200]
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            result.error = "stream_truncated" if got_response else "connection_error"
            result.error_detail = str(exc)[:200] or type(exc).__name__
        except aiohttp.ClientError as exc:
            result.error = "connection_error"
            result.error_detail = str(exc)[:200] or type(exc).__name__
        finally:
            end = loop.time()
            result.done_wall_s = end - t0
            self._finish(result, start, end, event_times, cumulative)
            self._counts["completed" if result.ok else "failed"] += 1
            self._report()

    @staticmethod
    def _event(
        data: str, now: float, event_times: list[float], cumulative: list[int | None], result: RequestResult
    ) -> bool:
        """Take one SSE payload; False (with `result.error` set) when the stream reports an error."""
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            result.error, result.error_detail = "bad_stream", f"event is not JSON: {data[:120]!r}"
            return False
        if not isinstance(obj, dict):
            result.error, result.error_detail = "bad_stream", f"event is not a JSON object: {data[:120]!r}"
            return False
        if "error" in obj or obj.get("object") == "error":  # OpenAI's and vLLM's in-stream errors
            code, result.error_detail = _error_fields(data.encode())
            result.error = f"stream_error {code}" if code else "stream_error"
            return False
        usage = obj.get("usage")
        completion = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(usage, dict):
            if isinstance(completion, int):
                result.output_tokens = completion
            if isinstance(usage.get("prompt_tokens"), int):
                result.prompt_tokens = usage["prompt_tokens"]
        choices = obj.get("choices") or []
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        if delta.get("content") or delta.get("reasoning_content") or choice.get("text"):
            event_times.append(now)
            cumulative.append(completion if isinstance(completion, int) else None)
        return True

    @staticmethod
    def _finish(
        result: RequestResult, start: float, end: float, event_times: list[float], cumulative: list[int | None]
    ) -> None:
        """Turn raw loop times into the result's latencies (scaled) and per-chunk token counts."""
        scale = result.time_scale
        if event_times:
            result.ttft_s = (event_times[0] - start) * scale
            result.chunk_gaps_s = [(b - a) * scale for a, b in zip(event_times, event_times[1:])]
            if all(c is not None for c in cumulative):
                counts = [float(c) for c in cumulative]  # type: ignore[arg-type]
                result.chunk_tokens = [counts[0]] + [b - a for a, b in zip(counts, counts[1:])]
                result.chunk_tokens_exact = True
            else:
                per = (result.output_tokens / len(event_times)) if result.output_tokens else 1.0
                result.chunk_tokens = [per] * len(event_times)
        if result.ok:
            result.e2e_s = (end - start) * scale
