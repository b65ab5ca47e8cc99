"""`StreamObserver`: one per response, fed from the ext_proc response phases.

What it measures (all times from the monotonic `now_ns` the caller passes, converted to seconds):

* TTFT: request start (the ext_proc stream saw the request headers) → the body chunk carrying the
  first content event (an SSE chunk with non-empty `choices[].delta.content`,
  `.reasoning_content`/`.reasoning`, `.tool_calls`, or `choices[].text`; for the Responses API
  an `response.output_text.delta` event, or a reasoning / function-call-arguments delta);
* inter-token latency: the gap between consecutive body chunks that carry content, divided by
  the tokens they carried. Events arriving in one body chunk share its arrival time. Tokens per
  chunk: exact when every content event carries `usage` (vLLM `continuous_usage_stats`);
  otherwise, at the end, the final `usage.completion_tokens` spread evenly over the content
  events (vLLM's `--stream-interval` packs several tokens into one event); without any usage,
  each content event counts as the endpoint's learned `tokens_per_event` (from its earlier
  responses that reported usage; 1.0 — one event, one token — before any). `tokens_source`
  says which. The live gaps fed to `EndpointStreamStats` use the exact count when known, else
  the learned `tokens_per_event`;
* E2E: request start → `on_end`;
* the decomposition: queue+prefill = TTFT; decode = last content − first content;
  post-processing = end of the response body − last content; network = E2E − the three
  (≥ 0). At the proxy the only time left for "network" is the tail after the last upstream byte
  (client download, stream teardown); upstream network time sits inside queue+prefill and
  cannot be separated there — `headers_s` (request start → response headers) bounds it;
* `usage` from the last SSE event that carried one (chat and completions; the Responses API's
  `response.completed` event, `input_tokens`/`output_tokens`) or from a
  non-streaming JSON body (parsed at end of stream, buffered up to `max_json_body_bytes`).

Bodies: only `text/event-stream` is parsed for events. Any other body is passed byte for byte
(`on_body_chunk` returns None); a JSON body is only copied aside for `usage`. A compressed body
(`content-encoding` other than identity) is passed and not parsed.

Markers (opt-in, `ObserverOptions.markers`): before each event of an SSE body the comment line
`: x-chunk-id=N x-sent-at-us=T[ x-route-weight=W]\\n` (N counts events from 0; T is the wall
clock in Unix microseconds when the proxy handled the chunk; W the caller's route weight), only
at event boundaries, never inside an event. SSE clients ignore comment lines. Markers change the
body length, so when the upstream SSE response carries `content-length` the observer asks the
caller to remove that header (`response_headers_to_remove()`); Envoy also drops it itself for
a STREAMED body mutation unless `allow_content_length_header` is set. Non-SSE bodies never get
markers. With markers on, `response_headers_to_add()` gives `x-sent-at-us` (and
`x-route-weight`) for any response.

Outcome (`StreamResult.outcome`), judged from what was seen, never from the gRPC status:
the caller's reason when it is not `complete`; else `client_error` for a 4xx the engine answers
to the client's own request (not 408 or 429: `engine_errors.is_client_error`), which the
endpoint's stats never see; `backend_error` for another status ≥ 400 or an
error event in the stream (vLLM writes `data: {"error": ...}` mid-stream); `stream_error` when
no response headers came, the body never reached end of stream, or it ended inside an event;
else `complete`. A response cut mid-stream keeps what was seen (events, tokens, partial usage).

At `on_end` the observer records: into the endpoint's stats the TTFT (any outcome that had a
first content event), the mean time per output token and tokens per event (completed responses);
into the metrics the TTFT likewise, the duration, time per output token, decomposition and token
usage (completed responses; output tokens only when counted by `usage`, never estimated), one
error count per other outcome (plus `sse_limit` when parsing gave up), and the endpoint's
backpressure level.

Cost: a few microseconds per chunk (see `scripts/bench_sse.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from extproc.protocol.sse import Event, SSELimitError, SSEParser
from extproc.server.engine_errors import is_client_error
from extproc.telemetry.metrics import TelemetryMetrics
from extproc.telemetry.stats import EndpointStreamStats

__all__ = [
    "END_REASONS",
    "LatencyBreakdown",
    "ObserverOptions",
    "StreamObserver",
    "StreamResult",
    "Usage",
]

END_REASONS = ("complete", "client_abort", "backend_error", "stream_error")
_MAX_ERROR_CHARS = 300


class ObserverOptions(BaseModel):
    """Per-deployment observer settings (shared by all observers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    markers: bool = Field(False, description="inject x-chunk-id/x-sent-at-us comment lines into SSE bodies")
    max_json_body_bytes: int = Field(4 << 20, ge=0, description="largest non-streaming body parsed for usage (bytes)")
    max_sse_line_bytes: int = Field(1 << 20, ge=1, description="longest SSE line before telemetry gives up (bytes)")
    max_sse_event_bytes: int = Field(4 << 20, ge=1, description="largest SSE event data before telemetry gives up (bytes)")


@dataclass(slots=True, frozen=True)
class Usage:
    """OpenAI `usage` (tokens); None where the body did not say."""

    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    cached_tokens: int | None = None

    @classmethod
    def from_json(cls, obj: Any) -> Usage | None:
        """From a decoded `usage` object (chat/completions names, or the Responses API's
        `input_tokens`/`output_tokens`); None when it is not an object. Non-integer counts → None."""
        if not isinstance(obj, dict):
            return None
        if "input_tokens" in obj or "output_tokens" in obj:  # the Responses API's names
            details = obj.get("input_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            return cls(_int(obj.get("input_tokens")), _int(obj.get("output_tokens")), _int(obj.get("total_tokens")), _int(cached))
        details = obj.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(_int(obj.get("prompt_tokens")), _int(obj.get("completion_tokens")), _int(obj.get("total_tokens")), _int(cached))


@dataclass(slots=True, frozen=True)
class LatencyBreakdown:
    """The four-layer latency decomposition (seconds); the four add up to E2E."""

    queue_prefill_s: float
    decode_s: float
    post_processing_s: float
    network_s: float

    def items(self) -> tuple[tuple[str, float], ...]:
        """(component, seconds) pairs named as the `component` metric label."""
        return (
            ("queue_prefill", self.queue_prefill_s),
            ("decode", self.decode_s),
            ("post_processing", self.post_processing_s),
            ("network", self.network_s),
        )


@dataclass(slots=True, frozen=True)
class StreamResult:
    """What one response looked like. Times in seconds.

    Attributes:
        endpoint / model: as given to the observer.
        outcome: one of `END_REASONS` (see the module docstring for how it is judged).
        error: a short human-readable reason when the outcome is not `complete`.
        status: the response's HTTP status, or None when no headers came.
        streaming: the body was parsed as SSE.
        headers_s: request start → response headers.
        ttft_s: request start → first content event (streaming only).
        e2e_s: request start → `on_end`.
        breakdown: the decomposition, when a content event was seen.
        events: SSE data events, `[DONE]` excluded (count).
        content_events: events that carried output (count).
        output_tokens: `usage.completion_tokens`, else an estimate from `content_events`.
        tokens_source: `usage_continuous`, `usage`, `events` (content events × the endpoint's
            learned tokens per event, an estimate) or `none`.
        tpot_s: mean time per output token after the first content chunk.
        usage: the last `usage` seen.
        done: the SSE `[DONE]` sentinel was seen.
        end_of_stream: the response body reached its end.
        markers: marker lines injected (count).
        bytes_in / bytes_out: body bytes received / forwarded (bytes).
        parse_error: why SSE parsing stopped early (bytes still passed through), or None.
    """

    endpoint: str
    model: str
    outcome: str
    error: str | None
    status: int | None
    streaming: bool
    headers_s: float | None
    ttft_s: float | None
    e2e_s: float
    breakdown: LatencyBreakdown | None
    events: int
    content_events: int
    output_tokens: int | None
    tokens_source: str
    tpot_s: float | None
    usage: Usage | None
    done: bool
    end_of_stream: bool
    markers: int
    bytes_in: int
    bytes_out: int
    parse_error: str | None


_RESPONSES_CONTENT = frozenset(
    ("response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta")
)
"""Responses API stream events that carry output tokens."""


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _has_content(choices: Any) -> bool:
    """True when any choice carries output: delta content/reasoning/tool calls, or completion text."""
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            continue
        d = c.get("delta")
        if isinstance(d, dict):
            if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"):
                return True
        elif c.get("text"):
            return True
    return False


def _error_message(obj: dict[str, Any]) -> str | None:
    """The message of an OpenAI-style (`{"error": {...}}`) or older vLLM (`{"object": "error"}`) error."""
    err = obj.get("error")
    if isinstance(err, dict):
        msg = err.get("message")
        return str(msg)[:_MAX_ERROR_CHARS] if msg is not None else "error"
    if isinstance(err, str):
        return err[:_MAX_ERROR_CHARS]
    if obj.get("object") == "error":
        return str(obj.get("message", "error"))[:_MAX_ERROR_CHARS]
    return None


def _s(ns: int) -> float:
    return max(ns, 0) / 1e9


_SSE, _JSON, _PASS = "sse", "json", "pass"


class StreamObserver:
    """Watches one response. Create it when the request's route is decided; no side effects.

    Args:
        endpoint: the endpoint address (a bounded metric label).
        model: the canonical served model name (a bounded metric label).
        request_start_ns: monotonic time (ns) when the ext_proc stream saw the request headers.
        stats: the endpoint's `EndpointStreamStats` to feed, or None.
        metrics: the telemetry metrics to record into, or None.
        options: shared settings (markers, bounds).
        route_weight: the routing weight to stamp into markers (`x-route-weight`), or None.
        prompt_tokens: our own prompt token count, used for input-token metrics when the
            response carries no `usage` (tokens).
        clock_ns: monotonic clock for `on_end` without a time (ns).
        wall_clock_ns: wall clock (Unix ns) for `x-sent-at-us`.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        model: str,
        request_start_ns: int,
        stats: EndpointStreamStats | None = None,
        metrics: TelemetryMetrics | None = None,
        options: ObserverOptions | None = None,
        route_weight: float | None = None,
        prompt_tokens: int | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.endpoint = endpoint
        self.model = model
        self.start_ns = request_start_ns
        self._stats = stats
        self._metrics = metrics
        self._opts = options or ObserverOptions()
        self._weight_str = None if route_weight is None else f"{route_weight:.4g}"
        self._weight = b"" if route_weight is None else f" x-route-weight={self._weight_str}".encode()
        self._prompt_tokens = prompt_tokens
        self._clock = clock_ns
        self._wall = wall_clock_ns
        self._mode: str | None = None
        self._parser: SSEParser | None = None
        self._markers_on = False
        self._add: dict[str, str] = {}
        self._remove: tuple[str, ...] = ()
        self.status: int | None = None
        self._headers_ns: int | None = None
        self._json: list[bytes] = []
        self._json_len = 0
        self._json_skip = False
        self._eos_ns: int | None = None
        self._truncated = False
        self._parse_error: str | None = None
        self._error: str | None = None
        self._bytes_in = 0
        self._bytes_out = 0
        self._markers = 0
        self._events = 0
        self._content_events = 0
        self._done = False
        self._usage: Usage | None = None
        self._continuous = True  # every content event so far carried usage
        self._usage_in_content = False
        self._last_completion = 0
        self._first_ns: int | None = None
        self._last_ns: int | None = None
        self._first_events = 0
        self._first_tokens: int | None = None
        self.result: StreamResult | None = None
        """Set by `on_end`."""

    # -- response headers --------------------------------------------------------------------

    def on_response_headers(
        self,
        status: int,
        content_type: str,
        content_length: int | None,
        now_ns: int,
        *,
        content_encoding: str | None = None,
    ) -> None:
        """The response headers arrived. Then ask `response_headers_to_add()` /
        `response_headers_to_remove()` for the header mutation to answer with.

        Args:
            status: HTTP status.
            content_type: the `content-type` value ("" when absent).
            content_length: the `content-length` value, or None when absent.
            now_ns: monotonic time (ns).
            content_encoding: the `content-encoding` value, if any (a compressed body is not parsed).
        """
        self.status = status
        self._headers_ns = now_ns
        mime = content_type.partition(";")[0].strip().lower()
        encoded = content_encoding is not None and content_encoding.strip().lower() not in ("", "identity")
        if encoded:
            self._mode = _PASS
        elif mime == "text/event-stream":
            self._mode = _SSE
            self._markers_on = self._opts.markers
            self._parser = SSEParser(
                max_line_bytes=self._opts.max_sse_line_bytes,
                max_event_bytes=self._opts.max_sse_event_bytes,
                track_starts=self._markers_on,
            )
        elif mime == "application/json" or mime.endswith("+json"):
            self._mode = _JSON
            self._json_skip = content_length is not None and content_length > self._opts.max_json_body_bytes
        else:
            self._mode = _PASS
        if self._opts.markers:
            self._add = {"x-sent-at-us": str(self._wall() // 1000)}
            if self._weight_str is not None:
                self._add["x-route-weight"] = self._weight_str
        if self._markers_on and content_length is not None:
            self._remove = ("content-length",)

    @property
    def first_content_ns(self) -> int | None:
        """Monotonic time (ns) of the body chunk with the first content event (prefill is over),
        or None so far."""
        return self._first_ns

    def response_headers_to_add(self) -> dict[str, str]:
        """Headers to set on the response (empty unless markers are on)."""
        return dict(self._add)

    def response_headers_to_remove(self) -> tuple[str, ...]:
        """Headers to remove: `content-length` when markers will change an SSE body's length."""
        return self._remove

    # -- response body -----------------------------------------------------------------------

    def on_body_chunk(self, data: bytes, end_of_stream: bool, now_ns: int) -> bytes | None:
        """One response body chunk, as Envoy streams it.

        Returns:
            The bytes to forward instead (markers injected), or None to forward `data` unchanged
            (always None for non-SSE bodies and when markers are off).
        """
        self._bytes_in += len(data)
        out: bytes | None = None
        if self.result is None:
            if self._mode == _SSE:
                out = self._sse(data, now_ns)
            elif self._mode == _JSON and not self._json_skip:
                self._json_len += len(data)
                if self._json_len > self._opts.max_json_body_bytes:
                    self._json_skip = True
                    self._json = []
                else:
                    self._json.append(data)
            if end_of_stream and self._eos_ns is None:
                self._eos_ns = now_ns
                self._finish_body()
        self._bytes_out += len(data) if out is None else len(out)
        return out

    def _sse(self, data: bytes, now_ns: int) -> bytes | None:
        parser = self._parser
        if parser is None:
            return None
        try:
            events = parser.feed(data)
        except SSELimitError as exc:
            self._parse_error = str(exc)
            self._parser = None
            return None
        if events:
            self._consume(events, now_ns)
        if self._markers_on and parser.starts:
            return self._mark(data, parser.starts)
        return None

    def _consume(self, events: list[Event], now_ns: int) -> None:
        arrival_events = 0
        arrival_tokens = 0
        tokens_known = True
        for ev in events:
            data = ev.data
            if data == "[DONE]":
                self._done = True
                continue
            self._events += 1
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            etype = obj.get("type")
            if etype is None:
                content = _has_content(obj.get("choices"))
                usage = Usage.from_json(obj.get("usage"))
            else:  # a Responses API event: text deltas; usage in the final `response.completed`
                content = etype in _RESPONSES_CONTENT and bool(obj.get("delta"))
                inner = obj.get("response")
                usage = Usage.from_json(inner.get("usage")) if isinstance(inner, dict) else None
            if usage is not None:
                self._usage = usage
            if content:
                arrival_events += 1
                if usage is not None and usage.completion_tokens is not None:
                    arrival_tokens += usage.completion_tokens - self._last_completion
                    self._usage_in_content = True
                else:
                    tokens_known = False
            if usage is not None and usage.completion_tokens is not None:
                self._last_completion = usage.completion_tokens
            if self._error is None and ("error" in obj or obj.get("object") == "error"):
                self._error = _error_message(obj)
        if not arrival_events:
            return
        if not tokens_known:
            self._continuous = False
        self._content_events += arrival_events
        if self._first_ns is None:
            self._first_ns = now_ns
            self._first_events = arrival_events
            self._first_tokens = arrival_tokens if tokens_known else None
        elif self._stats is not None and self._last_ns is not None:
            if tokens_known and arrival_tokens > 0:
                per = float(arrival_tokens)
            else:
                per = arrival_events * self._tokens_per_event()
            self._stats.record_gap(_s(now_ns - self._last_ns) / per, now_ns)
        self._last_ns = now_ns

    def _mark(self, data: bytes, starts: list[int]) -> bytes:
        stamp = f" x-sent-at-us={self._wall() // 1000}".encode() + self._weight + b"\n"
        parts: list[bytes] = []
        prev = 0
        for pos in starts:
            parts.append(data[prev:pos])
            parts.append(b": x-chunk-id=%d" % self._markers + stamp)
            self._markers += 1
            prev = pos
        parts.append(data[prev:])
        return b"".join(parts)

    def _finish_body(self) -> None:
        if self._parser is not None:
            self._truncated = self._parser.in_event
            self._parser.flush()
        elif self._mode == _JSON and not self._json_skip and self._json:
            body = b"".join(self._json)
            self._json = []
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                return
            if isinstance(obj, dict):
                self._usage = Usage.from_json(obj.get("usage")) or self._usage
                self._error = _error_message(obj)

    # -- end ---------------------------------------------------------------------------------

    def on_end(self, reason: str, now_ns: int | None = None) -> StreamResult:
        """The exchange is over (however the ext_proc stream ended); record and return the result.
        Idempotent: later calls return the first result.

        Args:
            reason: what the caller saw: `complete`, `client_abort`, `backend_error` or `stream_error`.
            now_ns: monotonic time (ns); default: now.

        Raises:
            ValueError: an unknown reason.
        """
        if reason not in END_REASONS:
            raise ValueError(f"unknown end reason {reason!r}; expected one of {END_REASONS}")
        if self.result is not None:
            return self.result
        end_ns = self._clock() if now_ns is None else now_ns
        outcome, error = self._judge(reason)
        result = self._result(outcome, error, end_ns)
        self.result = result
        self._record(result, end_ns)
        return result

    def _judge(self, reason: str) -> tuple[str, str | None]:
        if reason != "complete":
            return reason, self._error or f"ended by {reason.replace('_', ' ')}"
        if self.status is None:
            return "stream_error", "no response headers"
        if self.status >= 400:
            # A 4xx to the client's own request is the client's error, not the endpoint's.
            outcome = "client_error" if is_client_error(self.status) else "backend_error"
            return outcome, self._error or f"HTTP {self.status}"
        if self._eos_ns is None:
            return "stream_error", "response ended before the end of its body"
        if self._error is not None:
            return "backend_error", self._error
        if self._truncated:
            return "stream_error", "response body ended inside an SSE event"
        return "complete", None

    def _result(self, outcome: str, error: str | None, end_ns: int) -> StreamResult:
        start = self.start_ns
        ttft_s = breakdown = tpot_s = None
        output_tokens: int | None = None
        source = "none"
        usage = self._usage
        if self._mode == _SSE:
            if usage is not None and usage.completion_tokens is not None:
                output_tokens = usage.completion_tokens
                source = "usage_continuous" if self._continuous and self._usage_in_content else "usage"
            elif self._content_events:
                output_tokens, source = round(self._content_events * self._tokens_per_event()), "events"
        elif usage is not None and usage.completion_tokens is not None:
            output_tokens, source = usage.completion_tokens, "usage"
        if self._first_ns is not None and self._last_ns is not None:
            first, last = self._first_ns, self._last_ns
            body_end = self._eos_ns if self._eos_ns is not None else end_ns
            ttft_s = _s(first - start)
            decode_s = _s(last - first)
            post_s = _s(body_end - last)
            network_s = max(0.0, _s(end_ns - start) - ttft_s - decode_s - post_s)
            breakdown = LatencyBreakdown(ttft_s, decode_s, post_s, network_s)
            tpot_s = self._tpot(decode_s, output_tokens, source)
        return StreamResult(
            endpoint=self.endpoint,
            model=self.model,
            outcome=outcome,
            error=error,
            status=self.status,
            streaming=self._mode == _SSE,
            headers_s=None if self._headers_ns is None else _s(self._headers_ns - start),
            ttft_s=ttft_s,
            e2e_s=_s(end_ns - start),
            breakdown=breakdown,
            events=self._events,
            content_events=self._content_events,
            output_tokens=output_tokens,
            tokens_source=source,
            tpot_s=tpot_s,
            usage=usage,
            done=self._done,
            end_of_stream=self._eos_ns is not None,
            markers=self._markers,
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            parse_error=self._parse_error,
        )

    def _tpot(self, decode_s: float, tokens: int | None, source: str) -> float | None:
        """Mean seconds per token after the first content chunk; None with one chunk or no tokens."""
        if tokens is None or self._last_ns == self._first_ns:
            return None
        if source == "usage_continuous" and self._first_tokens is not None:
            after_first = tokens - self._first_tokens
        elif source == "usage":
            after_first = tokens - self._first_events * tokens / self._content_events
        else:
            after_first = (self._content_events - self._first_events) * self._tokens_per_event()
        return decode_s / after_first if after_first > 0 else None

    def _tokens_per_event(self) -> float:
        return self._stats.tokens_per_event if self._stats is not None else 1.0

    def _record(self, r: StreamResult, end_ns: int) -> None:
        ok = r.outcome == "complete"
        if self._stats is not None and r.outcome != "client_error":  # says nothing about the endpoint
            tpe = None
            if ok and r.content_events and r.tokens_source in ("usage", "usage_continuous") and r.output_tokens:
                tpe = r.output_tokens / r.content_events
            self._stats.record_end(ok=ok, ttft_s=r.ttft_s, itl_s=r.tpot_s if ok else None, tokens_per_event=tpe, now_ns=end_ns)
        m = self._metrics
        if m is None:
            return
        labels = (self.model, self.endpoint)
        if r.ttft_s is not None:
            m.ttft.labels(*labels).observe(r.ttft_s)
        if r.parse_error is not None:
            m.stream_errors.labels("sse_limit").inc()
        if self._stats is not None:
            m.backpressure.labels(self.endpoint).set(int(self._stats.snapshot(end_ns).pressure))
        if not ok:
            m.stream_errors.labels(r.outcome).inc()
            return
        m.duration.labels(*labels).observe(r.e2e_s)
        if r.tpot_s is not None:
            m.tpot.labels(*labels).observe(r.tpot_s)
        if r.breakdown is not None:
            for component, seconds in r.breakdown.items():
                m.stream_latency.labels(component).observe(seconds)
        prompt = r.usage.prompt_tokens if r.usage is not None else None
        if prompt is None:
            prompt = self._prompt_tokens
        if prompt is not None:
            m.token_usage.labels("input", *labels).observe(prompt)
        if r.output_tokens is not None and r.tokens_source != "events":  # counted, not estimated
            m.token_usage.labels("output", *labels).observe(r.output_tokens)
