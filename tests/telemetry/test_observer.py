"""StreamObserver on recorded vLLM-shaped streams: TTFT, ITL, usage, the decomposition, outcomes,
markers (checked with an independent SSE client decoder), and pass-through of everything else."""

from __future__ import annotations

import re

import orjson
import pytest
from httpx_sse._decoders import SSEDecoder, SSELineDecoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.telemetry.observer import ObserverOptions, Usage
from tests.telemetry.telemetry_helpers import MS, START, WALL, events_of, play, recorded

MARKER = re.compile(rb": x-chunk-id=(\d+) x-sent-at-us=(\d+)(?: x-route-weight=([0-9.e+-]+))?\n")


def client_events(raw: bytes) -> list[tuple[str, str, str]]:
    """Decode a body the way an SSE client library (httpx-sse) does: (event, data, id) per event."""
    lines = SSELineDecoder().decode(raw.decode("utf-8"))
    decoder = SSEDecoder()
    out = []
    for line in [*lines, ""]:
        sse = decoder.decode(line)
        if sse is not None:
            out.append((sse.event, sse.data, sse.id))
    return out


def ticks(n: int, first_ms: float = 40, step_ms: float = 10) -> list[float]:
    return [first_ms + i * step_ms for i in range(n)]


def strip_usage(raw: bytes, keep_last: bool) -> bytes:
    """Drop `usage` from every event (but the usage-only one when `keep_last`)."""
    out = []
    for ev in events_of(raw):
        body = ev[len(b"data: ") : -2]
        if body == b"[DONE]":
            out.append(ev)
            continue
        obj = orjson.loads(body)
        if obj.get("choices") == [] and "usage" in obj:
            if keep_last:
                out.append(ev)
            continue
        obj.pop("usage", None)
        out.append(b"data: " + orjson.dumps(obj) + b"\n\n")
    return b"".join(out)


# -- recorded streams, one event per chunk every 10 ms ---------------------------------------


@pytest.mark.parametrize(
    ("name", "events", "content_events", "usage", "source"),
    [
        # role chunk + 8 reasoning + 15 content + finish chunk + usage chunk
        ("chat_reasoning.sse", 26, 23, Usage(24, 23, 47), "usage"),
        # 16 text chunks + usage chunk; older vLLM writes "usage": null in each (ignored)
        ("completion.sse", 17, 16, Usage(7, 16, 23), "usage"),
        # role + tool-call header + 6 argument deltas + finish + usage; the finish chunk's
        # empty content is not output
        ("chat_tools.sse", 10, 7, Usage(151, 19, 170), "usage"),
        # --stream-interval 4 with continuous usage: 5 content chunks carrying 16 tokens
        ("chat_interval_usage.sse", 8, 5, Usage(12, 16, 28), "usage_continuous"),
    ],
    ids=["chat-reasoning", "completion", "tool-calls", "interval-continuous-usage"],
)
def test_recorded_stream(make_observer, name, events, content_events, usage, source):
    chunks = events_of(recorded(name))
    played = play(make_observer(), chunks, ticks(len(chunks)))
    r = played.observer.on_end("complete", START + int((40 + 10 * len(chunks)) * MS))
    assert (r.outcome, r.error, r.status, r.streaming, r.done, r.end_of_stream) == ("complete", None, 200, True, True, True)
    assert (r.events, r.content_events, r.usage, r.tokens_source) == (events, content_events, usage, source)
    assert r.output_tokens == usage.completion_tokens
    assert played.out == recorded(name) and played.replaced == 0  # markers off: untouched
    assert r.bytes_in == r.bytes_out == len(recorded(name))


def test_ttft_itl_and_decomposition(make_observer):
    # Chunk 0 (role) at 40 ms, chunk 1 (first reasoning token) at 50 ms, ..., chunk 23 (last
    # content) at 270 ms, finish/usage/[DONE] at 280..300 ms, end of stream at 300 ms, and the
    # exchange closes 4 ms later.
    chunks = events_of(recorded("chat_reasoning.sse"))
    played = play(make_observer(), chunks, ticks(len(chunks)), headers_ms=12)
    assert played.observer.first_content_ns == START + 50 * MS
    r = played.observer.on_end("complete", START + 304 * MS)
    assert r.headers_s == pytest.approx(0.012)
    assert r.ttft_s == pytest.approx(0.050)
    b = r.breakdown
    assert (b.queue_prefill_s, b.decode_s, b.post_processing_s, b.network_s) == pytest.approx((0.050, 0.220, 0.030, 0.004))
    assert sum(s for _, s in b.items()) == pytest.approx(r.e2e_s) == pytest.approx(0.304)
    # 23 tokens in 23 one-token events: 22 gaps of 10 ms after the first.
    assert r.tpot_s == pytest.approx(0.010)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gaps=st.lists(st.integers(0, 500), min_size=8, max_size=8), tail=st.integers(0, 50), abort=st.booleans())
def test_decomposition_adds_up(make_observer, gaps, tail, abort):
    # Any arrival times: the four components are ≥ 0 and sum to E2E (network absorbs the rest).
    chunks = events_of(recorded("completion.sse"))[:8]
    times, t = [], 5.0
    for g in gaps:
        t += g
        times.append(t)
    played = play(make_observer(), chunks, times, eos=not abort)
    r = played.observer.on_end("client_abort" if abort else "complete", START + int((t + tail) * MS))
    b = r.breakdown
    assert min(s for _, s in b.items()) >= 0
    assert sum(s for _, s in b.items()) == pytest.approx(r.e2e_s, abs=1e-9)
    # After the body ended, the rest is network; a stream cut before its end has no such tail.
    assert b.network_s == pytest.approx(0 if abort else tail / 1e3)


def test_stream_interval_with_continuous_usage_divides_gaps_by_tokens(make_observer, stats):
    # Content chunks carry 1, 4, 4, 4, 3 tokens, 40/40/40/30 ms apart: 10 ms per token each.
    chunks = events_of(recorded("chat_interval_usage.sse"))
    times = [40, 50, 90, 130, 170, 200, 200, 200, 200]
    played = play(make_observer(), chunks, times)
    r = played.observer.on_end("complete", START + 200 * MS)
    assert r.tokens_source == "usage_continuous"
    assert r.tpot_s == pytest.approx(0.150 / 15)  # decode 150 ms over the 15 tokens after the first
    snap = stats.snapshot(START + 200 * MS)
    assert snap.gap_samples == 4 and snap.gap_mean_s == pytest.approx(0.010)
    assert snap.gap_stddev_s == pytest.approx(0.0, abs=1e-12)


def test_stream_interval_with_final_usage_only_spreads_tokens_evenly(make_observer, stats):
    # Same stream without per-chunk usage: 16 tokens over 5 content events = 3.2 per event; the
    # first event counts as 3.2, so 150 ms of decode cover 12.8 tokens. Live gaps cannot know the
    # tokens yet: one event is one token (40, 40, 40, 30 ms).
    chunks = events_of(strip_usage(recorded("chat_interval_usage.sse"), keep_last=True))
    times = [40, 50, 90, 130, 170, 200, 200, 200, 200]
    r = play(make_observer(), chunks, times).observer.on_end("complete", START + 200 * MS)
    assert (r.tokens_source, r.output_tokens) == ("usage", 16)
    assert r.tpot_s == pytest.approx(0.150 / 12.8)
    assert stats.snapshot(START + 200 * MS).gap_mean_s == pytest.approx(0.0375)


def test_live_gaps_use_the_endpoint_learned_tokens_per_event(make_observer, stats):
    # A first response with usage teaches the endpoint 16 tokens / 5 events = 3.2 per event; a
    # later one without usage then has its 40 ms event gaps counted as 40 / 3.2 = 12.5 ms per token.
    times = [40, 50, 90, 130, 170, 200, 200, 200, 200]
    taught = events_of(strip_usage(recorded("chat_interval_usage.sse"), keep_last=True))
    play(make_observer(), taught, times).observer.on_end("complete", START + 200 * MS)
    assert stats.tokens_per_event == pytest.approx(3.2)
    plain = events_of(strip_usage(recorded("chat_interval_usage.sse"), keep_last=False))
    before = stats.snapshot(START).gap_samples
    r = play(make_observer(), plain, [t + 1000 for t in times[: len(plain)]]).observer.on_end("complete")
    # Its tokens are an estimate too: 5 events × 3.2 = 16, the 4 events after the first 12.8.
    assert (r.tokens_source, r.output_tokens, r.tpot_s) == ("events", 16, pytest.approx(0.150 / 12.8))
    snap = stats.snapshot(START)
    assert snap.gap_samples == before + 4
    assert snap.gap_mean_s == pytest.approx((0.0375 * 4 + (0.040 * 3 + 0.030) / 3.2) / 8)


def test_without_usage_one_event_counts_as_one_token(make_observer):
    chunks = events_of(strip_usage(recorded("chat_reasoning.sse"), keep_last=False))
    played = play(make_observer(), chunks, ticks(len(chunks)))
    r = played.observer.on_end("complete")
    assert (r.usage, r.tokens_source, r.output_tokens, r.content_events) == (None, "events", 23, 23)
    assert r.tpot_s == pytest.approx(0.010)


def test_events_in_one_chunk_share_one_arrival(make_observer, stats):
    raw = recorded("chat_reasoning.sse")
    r = play(make_observer(), [raw], [80]).observer.on_end("complete")
    assert r.ttft_s == pytest.approx(0.080)
    assert r.breakdown.decode_s == 0 and r.tpot_s is None  # one arrival: no inter-token gap
    assert r.content_events == 23
    assert stats.snapshot(START).gap_samples == 0


# -- outcomes --------------------------------------------------------------------------------


def test_backend_dies_mid_stream(make_observer, stats, registry):
    # The upstream connection breaks inside an event: no end of stream ever arrives.
    raw = recorded("chat_interval_usage.sse")
    cut = raw.index(b"data:", raw.index(b"naps")) + 30  # inside the 5th content chunk
    chunks = events_of(raw[:cut])
    played = play(make_observer(), chunks, ticks(len(chunks)), eos=False)
    r = played.observer.on_end("complete", START + 500 * MS)
    assert (r.outcome, r.end_of_stream, r.done) == ("stream_error", False, False)
    assert r.error == "response ended before the end of its body"
    # What was seen: role + 4 content chunks (1+4+4+4 tokens) and their running usage.
    assert (r.events, r.content_events) == (5, 4)
    assert r.usage == Usage(12, 13, 25) and r.output_tokens == 13
    assert r.ttft_s == pytest.approx(0.050)
    assert registry.get_sample_value("llm_extproc_stream_errors_total", {"reason": "stream_error"}) == 1
    assert registry.get_sample_value(
        "gen_ai_server_request_duration_seconds_count", {"gen_ai_request_model": "Qwen/Qwen3-8B", "server_address": "10.0.0.1:8000"}
    ) is None
    assert stats.snapshot(START).failed == 1


def test_caller_reported_backend_error_keeps_partial_view(make_observer):
    chunks = events_of(recorded("chat_reasoning.sse"))[:6]
    r = play(make_observer(), chunks, ticks(6), eos=False).observer.on_end("backend_error")
    assert (r.outcome, r.content_events, r.usage) == ("backend_error", 5, None)


def test_error_event_in_stream_is_a_backend_error(make_observer):
    chunks = events_of(recorded("chat_error_event.sse"))
    r = play(make_observer(), chunks, ticks(len(chunks))).observer.on_end("complete")
    assert r.outcome == "backend_error" and "EngineDeadError" in r.error
    assert (r.content_events, r.done) == (3, True)


def test_body_ending_inside_an_event_is_a_stream_error(make_observer):
    raw = recorded("chat_reasoning.sse")
    r = play(make_observer(), [raw[:-5]], [50]).observer.on_end("complete")
    assert (r.outcome, r.end_of_stream) == ("stream_error", True)


def test_client_abort(make_observer, registry):
    chunks = events_of(recorded("chat_reasoning.sse"))[:4]
    r = play(make_observer(), chunks, ticks(4), eos=False).observer.on_end("client_abort", START + 90 * MS)
    assert r.outcome == "client_abort" and r.e2e_s == pytest.approx(0.090)
    assert registry.get_sample_value("llm_extproc_stream_errors_total", {"reason": "client_abort"}) == 1


def test_no_response_headers_is_a_stream_error(make_observer):
    r = make_observer().on_end("complete")
    assert (r.outcome, r.status, r.error) == ("stream_error", None, "no response headers")


def test_http_error_with_json_body(make_observer):
    body = b'{"error": {"message": "model is overloaded", "type": "ServiceUnavailable", "param": null, "code": 503}}'
    played = play(make_observer(), [body], [20], status=503, content_type="application/json")
    r = played.observer.on_end("complete")
    assert (r.outcome, r.error, r.status) == ("backend_error", "model is overloaded", 503)
    assert played.out == body


def test_on_end_is_idempotent_and_checks_its_reason(make_observer):
    obs = make_observer()
    with pytest.raises(ValueError):
        obs.on_end("finished")
    first = obs.on_end("client_abort")
    assert obs.on_end("complete") is first


def test_sse_line_over_the_limit_stops_telemetry_not_traffic(make_observer, registry):
    obs = make_observer(options=ObserverOptions(markers=True, max_sse_line_bytes=64))
    chunks = events_of(recorded("chat_reasoning.sse"))
    played = play(obs, chunks, ticks(len(chunks)))
    r = obs.on_end("complete")
    assert played.out == recorded("chat_reasoning.sse") and played.replaced == 0
    assert "exceeds the limit of 64 bytes" in r.parse_error
    assert registry.get_sample_value("llm_extproc_stream_errors_total", {"reason": "sse_limit"}) == 1


# -- non-SSE bodies --------------------------------------------------------------------------


@pytest.mark.parametrize("markers", [False, True], ids=["plain", "markers-on"])
def test_json_body_is_never_modified_and_gives_usage(make_observer, markers):
    body = recorded("chat_nonstream.json")
    pieces = [body[:7], body[7:100], body[100:]]
    obs = make_observer(markers=markers)
    played = play(obs, pieces, [300, 301, 302], content_type="application/json", content_length=len(body))
    r = obs.on_end("complete", START + 303 * MS)
    assert played.out == body and played.replaced == 0
    assert obs.response_headers_to_remove() == ()
    assert r.usage == Usage(15, 8, 23, 0) and (r.output_tokens, r.tokens_source) == (8, "usage")
    assert (r.outcome, r.streaming, r.ttft_s, r.breakdown, r.markers) == ("complete", False, None, None, 0)
    assert r.e2e_s == pytest.approx(0.303)


def test_json_body_over_the_bound_is_passed_without_usage(make_observer):
    body = recorded("chat_nonstream.json")
    obs = make_observer(options=ObserverOptions(max_json_body_bytes=100))
    played = play(obs, [body[:60], body[60:]], [10, 11], content_type="application/json")
    assert played.out == body and obs.on_end("complete").usage is None


@pytest.mark.parametrize(
    ("content_type", "encoding"),
    [("text/plain", None), ("application/octet-stream", None), ("text/event-stream", "gzip")],
    ids=["text", "binary", "compressed-sse"],
)
def test_other_bodies_pass_untouched(make_observer, content_type, encoding):
    raw = recorded("completion.sse")
    obs = make_observer(markers=True)
    obs.on_response_headers(200, content_type, None, START, content_encoding=encoding)
    assert all(obs.on_body_chunk(c, False, START) is None for c in events_of(raw))
    r = obs.on_end("complete")
    assert (r.streaming, r.events, r.markers) == (False, 0, 0)


# -- markers ---------------------------------------------------------------------------------


def test_markers_precede_each_event_and_clients_ignore_them(make_observer):
    raw = recorded("chat_reasoning.sse")
    chunks = events_of(raw)
    obs = make_observer(markers=True, route_weight=0.5)
    played = play(obs, chunks, ticks(len(chunks)))
    r = obs.on_end("complete")
    assert played.replaced == len(chunks) == r.markers == 27
    found = MARKER.findall(played.out)
    assert [int(n) for n, _, _ in found] == list(range(27))
    assert {(int(t), w) for _, t, w in found} == {(WALL // 1000, b"0.5")}
    assert MARKER.sub(b"", played.out) == raw  # nothing else changed
    assert client_events(played.out) == client_events(raw)
    assert r.bytes_out == len(played.out) > r.bytes_in == len(raw)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_markers_at_any_split_keep_events_unchanged(make_observer, ending, data):
    raw = recorded(data.draw(st.sampled_from(["chat_reasoning.sse", "chat_tools.sse"]))).replace(b"\n", ending)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(raw) - 1), max_size=30))))
    bounds = [0, *cuts, len(raw)]
    chunks = [raw[a:b] for a, b in zip(bounds, bounds[1:])]
    obs = make_observer(markers=True)
    played = play(obs, chunks, ticks(len(chunks)))
    assert MARKER.sub(b"", played.out) == raw
    assert client_events(played.out) == client_events(raw)
    # Each marker sits at an event boundary: the stream start or right after a blank line.
    for m in MARKER.finditer(played.out):
        before = played.out[: m.start()]
        assert before == b"" or before.endswith(ending * 2) or before.endswith(b"\n")  # previous marker
    assert obs.on_end("complete").markers == raw.count(b"data:")


def test_marker_headers(make_observer):
    obs = make_observer(markers=True, route_weight=0.25)
    obs.on_response_headers(200, "text/event-stream; charset=utf-8", None, START)
    assert obs.response_headers_to_add() == {"x-sent-at-us": str(WALL // 1000), "x-route-weight": "0.25"}
    assert obs.response_headers_to_remove() == ()
    assert make_observer().response_headers_to_add() == {}


@pytest.mark.parametrize(
    ("markers", "content_length", "removed"),
    [(True, 5946, ("content-length",)), (False, 5946, ()), (True, None, ())],
    ids=["markers-with-length", "no-markers", "markers-chunked"],
)
def test_sse_with_content_length(make_observer, markers, content_length, removed):
    # Markers lengthen the body, so a declared length must go; without markers it stays.
    raw = recorded("chat_reasoning.sse")
    obs = make_observer(markers=markers)
    played = play(obs, events_of(raw), ticks(27), content_length=content_length)
    assert obs.response_headers_to_remove() == removed
    assert (played.out == raw) is not markers
    assert obs.on_end("complete").outcome == "complete"


def _responses_event(kind: str, **fields) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def test_responses_api_stream_ttft_from_text_deltas_and_usage_from_completed(make_observer):
    """A Responses API stream: content is `response.output_text.delta`; usage arrives inside the
    `response.completed` event, in the Responses API's names (input_tokens / output_tokens)."""
    usage = {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3, "total_tokens": 23}
    chunks = [
        _responses_event("response.created", response={"status": "in_progress", "usage": None})
        + _responses_event("response.output_item.added", output_index=0, item={}),
        _responses_event("response.output_text.delta", delta=" the"),
        _responses_event("response.output_text.delta", delta=" of and"),
        _responses_event("response.output_text.done", text=" the of and")
        + _responses_event("response.completed", response={"status": "completed", "usage": usage}),
    ]
    played = play(make_observer(), chunks, [10, 40, 60, 70])
    result = played.observer.on_end("complete")
    assert result.outcome == "complete" and result.ttft_s == pytest.approx(0.040)
    assert result.content_events == 2 and result.output_tokens == 3 and result.tokens_source == "usage"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_tokens) == (20, 3, 4)


def test_responses_api_json_body_usage(make_observer):
    body = orjson.dumps({"object": "response", "status": "completed", "usage": {"input_tokens": 9, "output_tokens": 5, "total_tokens": 14}})
    played = play(make_observer(), [body], [30], content_type="application/json")
    result = played.observer.on_end("complete")
    assert result.output_tokens == 5 and result.usage.prompt_tokens == 9


def test_an_engine_4xx_is_a_client_error_the_endpoint_stats_never_see(make_observer, stats):
    body = orjson.dumps({"object": "error", "message": "bad min_tokens", "type": "BadRequestError", "code": 400})
    result = play(make_observer(), [body], [5], status=400, content_type="application/json").observer.on_end("complete")
    assert result.outcome == "client_error" and result.error == "bad min_tokens"
    assert stats.snapshot(START + 10**12).failed == 0
