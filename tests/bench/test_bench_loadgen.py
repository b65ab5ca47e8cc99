"""The load generator against a tiny local SSE server written here.

The server picks its behaviour from the request's `max_tokens` (so one run can mix them):
    429 → OpenAI-style 429 JSON error     400 → vLLM-style 400 JSON error
    13  → two content events, then the connection is dropped
    77  → one content event, then a vLLM-style error event (and [DONE])
    999 → waits 30 s before answering (timeouts, Ctrl-C)
    any other n → a normal stream of n tokens; events are cut across network writes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from extproc.bench.loadgen import LoadGenConfig, LoadGenerator, Progress, error_reason
from extproc.bench.prompts import PromptSynthesizer
from extproc.bench.traces import TraceRequest
from extproc.pipeline.tokens import TokenCounter

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_GAP_S = 0.01
BODIES = web.AppKey("bodies", list)
HEADERS = web.AppKey("headers", list)
EXTRA_HEADERS = web.AppKey("extra_headers", dict)


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _write_split(response: web.StreamResponse, data: bytes) -> None:
    """Write an event in two pieces (mid-JSON), flushed apart."""
    cut = len(data) // 2
    await response.write(data[:cut])
    await asyncio.sleep(0.001)
    await response.write(data[cut:])


async def _chat(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = orjson.loads(await request.read())
    app[BODIES].append(body)
    app[HEADERS].append(dict(request.headers))
    n = body["max_tokens"]
    headers = {"x-served-by": "10.0.0.1:8000", **app[EXTRA_HEADERS]}
    if n == 429:
        err = {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}}
        return web.json_response(err, status=429, headers=headers)
    if n == 400:
        err = {"object": "error", "message": "too long", "type": "BadRequestError", "param": None, "code": 400}
        return web.json_response(err, status=400, headers=headers)
    if n == 999:
        await asyncio.sleep(30)
    response = web.StreamResponse(headers={"content-type": "text/event-stream", **headers})
    await response.prepare(request)
    await response.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    await asyncio.sleep(FIRST_TOKEN_DELAY_S)
    continuous = body["stream_options"].get("continuous_usage_stats", False)
    per_chunk = 2 if continuous else 1
    sent = 0
    while sent < n:
        if n == 13 and sent == 2:
            request.transport.close()  # the engine died mid-stream
            return response
        if n == 77 and sent == 1:
            err = {"object": "error", "message": "engine overloaded", "type": "InternalServerError", "code": 500}
            await response.write(_event(err) + b"data: [DONE]\n\n")
            return response
        step = min(per_chunk, n - sent)
        sent += step
        chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": " tok" * step}}]}
        if continuous:
            chunk["usage"] = {"prompt_tokens": 11, "completion_tokens": sent}
        await _write_split(response, _event(chunk))
        await asyncio.sleep(TOKEN_GAP_S)
    await _write_split(response, _event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n}}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _serve(extra_headers: dict[str, str]) -> tuple[web.AppRunner, web.Application, int]:
    app = web.Application()
    app[BODIES], app[HEADERS], app[EXTRA_HEADERS] = [], [], extra_headers
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, app, port


@pytest.fixture
async def server() -> AsyncIterator[tuple[web.Application, str]]:
    runner, app, port = await _serve({})
    yield app, f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.fixture
async def sim_server() -> AsyncIterator[tuple[web.Application, str]]:
    """Like a simulator running 10× faster than wall time: it says so in `x-sim-speed`."""
    runner, app, port = await _serve({"x-sim-speed": "10", "x-llm-endpoint": "10.0.0.2:8000"})
    yield app, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _req(arrival: float, output: int, **kw: Any) -> TraceRequest:
    return TraceRequest(arrival, 20, output, messages=[{"role": "user", "content": "hi"}], **kw)


async def test_stream_metrics(server: tuple[web.Application, str]) -> None:
    app, url = server
    run = await LoadGenerator(LoadGenConfig(url)).run([_req(0.0, 5)])
    (r,) = run.results
    assert r.ok and r.status == 200 and r.error is None
    assert run.time_unit == "wall" and run.time_scale == 1.0
    assert r.endpoint == "10.0.0.1:8000"
    # The role-only first event does not count: TTFT waits for the first content.
    assert FIRST_TOKEN_DELAY_S <= r.ttft_s < FIRST_TOKEN_DELAY_S + 2.0
    assert len(r.chunk_gaps_s) == 4 and all(g >= TOKEN_GAP_S * 0.9 for g in r.chunk_gaps_s)
    assert r.output_tokens == 5 and r.prompt_tokens == 11
    assert r.chunk_tokens == [1.0] * 5 and not r.chunk_tokens_exact
    assert r.e2e_s > r.ttft_s + sum(r.chunk_gaps_s) * 0.99
    assert r.itl_s == pytest.approx((r.e2e_s - r.ttft_s) / 4)
    body = app[BODIES][0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == body["min_tokens"] == 5 and body["ignore_eos"] is True


async def test_continuous_usage_gives_exact_tokens_per_chunk(server: tuple[web.Application, str]) -> None:
    _, url = server
    run = await LoadGenerator(LoadGenConfig(url, continuous_usage_stats=True)).run([_req(0.0, 5)])
    (r,) = run.results
    assert r.ok
    assert r.chunk_tokens == [2.0, 2.0, 1.0] and r.chunk_tokens_exact
    assert len(r.chunk_gaps_s) == 2


async def test_error_reasons(server: tuple[web.Application, str]) -> None:
    _, url = server
    requests = [_req(0.0, 429), _req(0.0, 400), _req(0.0, 13), _req(0.0, 77)]
    run = await LoadGenerator(LoadGenConfig(url)).run(requests)
    by_status = {r.max_tokens: r for r in run.results}
    assert by_status[429].status == 429 and by_status[429].error == "429 rate_limit_exceeded"
    assert by_status[429].error_detail == "slow down"
    assert by_status[400].error == "400 BadRequestError"  # vLLM's integer code: fall back to type
    dropped = by_status[13]
    assert dropped.status == 200 and dropped.error == "stream_truncated"
    assert dropped.ttft_s is not None and dropped.e2e_s is None  # it started, it never finished
    assert by_status[77].error == "stream_error InternalServerError"
    assert by_status[77].error_detail == "engine overloaded"
    assert not any(r.ok for r in run.results)


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (429, b'{"error": {"message": "m", "type": "t", "code": "rate_limit_exceeded"}}', "429 rate_limit_exceeded"),
        (503, b'{"error": {"message": "m", "type": "service_unavailable", "code": null}}', "503 service_unavailable"),
        (500, b"upstream connect error", "500"),
        (413, b"", "413"),
    ],
    ids=["openai-code", "type-when-no-code", "plain-text", "empty"],
)
def test_error_reason(status: int, body: bytes, reason: str) -> None:
    assert error_reason(status, body)[0] == reason


async def test_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = await LoadGenerator(LoadGenConfig(f"http://127.0.0.1:{port}")).run([_req(0.0, 3)])
    assert run.results[0].error == "connection_error" and run.results[0].status is None


async def test_timeout(server: tuple[web.Application, str]) -> None:
    _, url = server
    run = await LoadGenerator(LoadGenConfig(url, request_timeout_s=0.3)).run([_req(0.0, 999)])
    assert run.results[0].error == "timeout"


async def test_sim_speed_header_scales_latencies(sim_server: tuple[web.Application, str]) -> None:
    _, url = sim_server
    run = await LoadGenerator(LoadGenConfig(url, speed=10.0)).run([_req(0.0, 3)])
    (r,) = run.results
    assert run.time_unit == "simulated" and run.time_scale == 10.0 and not run.warnings
    assert r.ttft_s >= 10 * FIRST_TOKEN_DELAY_S  # wall delay × 10
    assert r.endpoint == "10.0.0.2:8000"  # x-llm-endpoint wins over x-served-by


async def test_speed_mismatch_is_reported(sim_server: tuple[web.Application, str]) -> None:
    _, url = sim_server
    run = await LoadGenerator(LoadGenConfig(url)).run([_req(0.0, 2)])
    assert run.time_scale == 10.0 and run.warnings


async def test_speed_compresses_arrivals(server: tuple[web.Application, str]) -> None:
    _, url = server
    run = await LoadGenerator(LoadGenConfig(url, speed=10.0)).run([_req(0.0, 2), _req(2.0, 2)])
    gap = run.results[1].sent_wall_s - run.results[0].sent_wall_s
    assert 0.2 * 0.9 <= gap < 1.5  # 2 trace seconds at speed 10; generous upper margin
    assert run.time_unit == "simulated"  # no header: our own speed scales latencies


async def test_falling_behind_is_counted(server: tuple[web.Application, str]) -> None:
    _, url = server
    stalled = []

    def on_progress(p: Progress) -> None:
        if p.sent == 1 and not stalled:
            stalled.append(p)
            time.sleep(0.2)  # a blocked event loop: the next send is late

    run = await LoadGenerator(LoadGenConfig(url), on_progress=on_progress).run([_req(0.0, 2), _req(0.01, 2)])
    first, second = run.results
    assert first.lag_s < 0.1  # on time, give or take a busy CI machine
    assert second.lag_s >= 0.15


async def test_progress_reports_every_send_and_end(server: tuple[web.Application, str]) -> None:
    _, url = server
    seen: list[Progress] = []
    await LoadGenerator(LoadGenConfig(url), on_progress=seen.append).run([_req(0.0, 2), _req(0.0, 429)])
    assert len(seen) == 4
    assert seen[-1] == Progress(planned=2, sent=2, completed=1, failed=1, in_flight=0, behind=0)


async def test_stop_cancels_in_flight_and_stops_sending(server: tuple[web.Application, str]) -> None:
    _, url = server
    gen = LoadGenerator(LoadGenConfig(url))
    requests = [_req(0.0, 999), _req(0.0, 999), _req(60.0, 2)]
    asyncio.get_running_loop().call_later(0.3, gen.stop)
    started = time.monotonic()
    run = await gen.run(requests)
    assert time.monotonic() - started < 10  # not the 30 s the server would take
    assert run.interrupted and run.planned == 3
    assert [r.error for r in run.results] == ["cancelled", "cancelled"]  # the third was never sent


async def test_stop_before_run_sends_nothing(server: tuple[web.Application, str]) -> None:
    """A signal while a replay is being set up (before `run()`) must still stop it."""
    _, url = server
    gen = LoadGenerator(LoadGenConfig(url))
    gen.stop()
    started = time.monotonic()
    run = await gen.run([_req(0.0, 5), _req(1.0, 5)])
    assert time.monotonic() - started < 1
    assert run.interrupted and run.planned == 2 and run.results == []


async def test_session_header_and_extra_headers(server: tuple[web.Application, str]) -> None:
    app, url = server
    config = LoadGenConfig(url, session_header="x-session-id", headers={"x-tenant": "team-a"})
    await LoadGenerator(config).run([_req(0.0, 2, session="abc"), _req(0.0, 2)])
    sessions = sorted(h.get("x-session-id", "-") for h in app[HEADERS])
    assert sessions == ["-", "abc"]
    assert all(h["x-tenant"] == "team-a" for h in app[HEADERS])


async def test_closed_loop_sessions_wait_for_the_previous_answer(server: tuple[web.Application, str]) -> None:
    """Turns of one conversation all "arrive" at 0 but go one after the other, each after the
    previous answer plus the think time (even after an error); other sessions run alongside."""
    _, url = server
    think = 0.1
    config = LoadGenConfig(url, closed_loop_sessions=True, think_time_s=think)
    requests = [_req(0.0, 5, session="a"), _req(0.0, 429, session="a"), _req(0.0, 5, session="a"), _req(0.0, 5, session="b")]
    run = await LoadGenerator(config).run(requests)
    by_index = {r.index: r for r in run.results}
    assert len(by_index) == 4 and [by_index[i].status for i in range(4)] == [200, 429, 200, 200]
    for before, after in ((0, 1), (1, 2)):
        ended = by_index[before].done_wall_s
        assert ended is not None and by_index[after].sent_wall_s >= ended + think * 0.9
        assert by_index[after].lag_s < 0.05  # late against the closed loop's own schedule: no
    assert by_index[3].sent_wall_s < by_index[0].done_wall_s  # session b does not wait for a
    # open loop (the default): every turn at its arrival time
    open_run = await LoadGenerator(LoadGenConfig(url)).run(requests[:3])
    assert max(r.sent_wall_s for r in open_run.results) < min(r.done_wall_s or 0 for r in open_run.results)


def test_plan_applies_limits() -> None:
    requests = [_req(t, 2) for t in (5.0, 0.0, 1.0, 2.5, 9.0)]
    assert [r.arrival_s for r in LoadGenerator(LoadGenConfig("http://x", max_requests=2)).plan(requests)] == [0.0, 1.0]
    assert [r.arrival_s for r in LoadGenerator(LoadGenConfig("http://x", duration_s=2.5)).plan(requests)] == [
        0.0,
        1.0,
        2.5,
    ]


def test_body_for_a_length_only_request(synth: PromptSynthesizer, qwen_counter: TokenCounter) -> None:
    gen = LoadGenerator(LoadGenConfig("http://x", model="m"), synth)
    body = orjson.loads(gen.body(TraceRequest(0.0, 700, 9, prefix_blocks=(0, 1)), 0))
    assert body["model"] == "m"
    assert qwen_counter.count_chat(body["messages"]).count == 700
    with pytest.raises(ValueError, match="PromptSynthesizer"):
        LoadGenerator(LoadGenConfig("http://x")).body(TraceRequest(0.0, 700, 9), 0)


def test_a_huge_max_tokens_budget_leaves_the_end_to_the_engine() -> None:
    """`max_tokens` set: every request asks for that budget (never below its own length), as
    clients with a huge budget do; `min_tokens` keeps its length and the engine ends it."""
    gen = LoadGenerator(LoadGenConfig("http://x", max_tokens=16384))
    body = orjson.loads(gen.body(_req(0.0, 300), 0))
    assert (body["max_tokens"], body["min_tokens"]) == (16384, 300) and "ignore_eos" not in body
    assert orjson.loads(gen.body(_req(0.0, 20000), 1))["max_tokens"] == 20000
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        LoadGenConfig("http://x", max_tokens=0)


@pytest.mark.parametrize(
    "kwargs",
    [{"base_url": "localhost:80"}, {"speed": 0.0}, {"request_timeout_s": 0}, {"max_requests": -1}, {"think_time_s": -1}],
    ids=["no-scheme", "zero-speed", "zero-timeout", "negative-max", "negative-think"],
)
def test_bad_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LoadGenConfig(**{"base_url": "http://127.0.0.1:1", **kwargs})


async def test_ctrl_c_stops_the_run_cleanly(server: tuple[web.Application, str]) -> None:
    _, url = server
    loop = asyncio.get_running_loop()
    loop.call_later(0.3, os.kill, os.getpid(), signal.SIGINT)
    run = await LoadGenerator(LoadGenConfig(url)).run([_req(0.0, 999), _req(60.0, 2)], handle_signals=True)
    assert run.interrupted and [r.error for r in run.results] == ["cancelled"]
    # The handler is gone again: Ctrl-C means KeyboardInterrupt outside a run.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


async def test_the_route_debug_header_is_kept_only_when_asked_for() -> None:
    """`debug_header` keeps the router's explanation of each choice for the per-request lines
    (`bench_prefix.py --route-debug`); without it nothing is kept."""
    from extproc.bench.results import LabeledRun, request_rows

    runner, _, port = await _serve({"x-llm-route-debug": "chose 10.0.0.1:8000 total=16.500"})
    try:
        url = f"http://127.0.0.1:{port}"
        kept = await LoadGenerator(LoadGenConfig(url, debug_header="x-llm-route-debug")).run([_req(0.0, 2)])
        plain = await LoadGenerator(LoadGenConfig(url)).run([_req(0.0, 2)])
    finally:
        await runner.cleanup()
    assert kept.results[0].route_debug == "chose 10.0.0.1:8000 total=16.500"
    assert plain.results[0].route_debug is None
    rows = list(request_rows([LabeledRun("p", "t", kept), LabeledRun("q", "t", plain)]))
    assert rows[0]["route_debug"] == "chose 10.0.0.1:8000 total=16.500" and "route_debug" not in rows[1]
