"""The router's token counts and max_model_len checked against each engine's own (simulators
serving `/tokenize` and `/v1/models` with the tokenizer and context limit they were given)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.config.loader import config_from_mapping
from extproc.config.schema import EndpointConfig
from extproc.datastore.engine_check import OVERRIDE_SOURCE, USER_AGENT
from extproc.pipeline.request import ModelRuntime
from extproc.pipeline.tokens import TokenCounter
from extproc.server.app import ExtProcApp
from extproc.sim.server import SimServer
from tests.conftest import altered_qwen_tokenizer, drop_merge

MODEL = "Qwen/Qwen3-8B"
CONTEXT = 32768


@pytest.fixture(scope="module")
def other_counter(tmp_path_factory) -> TokenCounter:
    """Another tokenizer: Qwen3's without the merge `i` + `n` (every "in" counts otherwise)."""
    return TokenCounter.from_source(str(altered_qwen_tokenizer(tmp_path_factory.mktemp("other"), drop_merge("i", "n"))), encoder="tokenizers")


@pytest.fixture
async def stack(qwen_counter):
    """Factory: simulators (kwargs each) behind a started ExtProcApp configured for MODEL at
    CONTEXT tokens; `models` entries override the model's config."""
    started: list = []

    async def factory(*sims_kwargs, endpoints=(), **model_fields):
        sims = []
        for kw in sims_kwargs:
            sim = SimServer(**{"tokenizer": qwen_counter, "max_model_len": CONTEXT, "num_gpu_blocks": 4096, **kw})
            await sim.start()
            started.append(sim)
            sims.append(sim)
        raw = {
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "models": [{"name": MODEL, "max_model_len": CONTEXT, **model_fields}],
            "endpoints": [*({"address": f"127.0.0.1:{s.port}", "models": [MODEL]} for s in sims), *endpoints],
        }
        cfg = config_from_mapping(raw, env={})
        app = ExtProcApp(cfg, registry=CollectorRegistry(), models={MODEL: ModelRuntime(cfg.models[0], qwen_counter)})
        await app.start()
        started.append(app)
        return app, sims

    yield factory
    for obj in reversed(started):
        await (obj.aclose(grace_s=0) if isinstance(obj, ExtProcApp) else obj.aclose())


async def _outcome(app: ExtProcApp, address: str, *, within_s: float = 10.0):
    """The endpoint's first engine check of MODEL (polled, bounded)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        ep = app.store.get(address)
        if ep is not None and ep.engine_check and MODEL in ep.engine_check:
            return ep.engine_check[MODEL]
        await asyncio.sleep(0.02)
    raise AssertionError(f"{address} was not checked within {within_s} s")


def _gauge(app: ExtProcApp, outcome: str) -> float:
    return app.metrics.registry.get_sample_value("llm_extproc_engine_check_endpoints", {"model": MODEL, "outcome": outcome})


async def _admin_check(app: ExtProcApp, address: str) -> dict:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://127.0.0.1:{app.admin_port}/api/v1/endpoints")
    (row,) = [e for e in r.json()["endpoints"] if e["address"] == address]
    return row["engine_check"][MODEL]


async def test_an_engine_counting_as_the_router_does_matches(stack):
    app, (sim,) = await stack({})
    check = await _outcome(app, f"127.0.0.1:{sim.port}")
    assert check.outcome == "match", check.detail
    assert check.engine_max_model_len == CONTEXT
    assert set(check.counts) == {"prompt[0]", "prompt[1]", "prompt[2]", "chat"}
    assert all(mine == theirs for mine, theirs in check.counts.values())
    assert _gauge(app, "match") == 1 and _gauge(app, "mismatch") == 0
    assert (await _admin_check(app, f"127.0.0.1:{sim.port}"))["outcome"] == "match"


async def test_an_engine_with_another_tokenizer_is_a_loud_mismatch(stack, other_counter, caplog):
    """The issue's case: the router counts with one tokenizer, the engine with another. It was
    silent; now an ERROR line, the metric and the admin page name it, and the endpoint keeps
    its traffic (engine_check: warn, the default)."""
    with caplog.at_level(logging.ERROR, logger="extproc.datastore.engine_check"):
        app, (sim,) = await stack({"tokenizer": other_counter})
        address = f"127.0.0.1:{sim.port}"
        check = await _outcome(app, address)
    assert check.outcome == "mismatch"
    assert "prompt[1]: the router counts" in check.detail and "chat: the router counts" in check.detail
    assert _gauge(app, "mismatch") == 1
    assert app.metrics.registry.get_sample_value("llm_extproc_engine_check_mismatches_total", {"model": MODEL}) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert address in line and MODEL in line and "engine_check: warn" in line
    page = await _admin_check(app, address)
    assert page["outcome"] == "mismatch" and page["detail"] == check.detail
    assert app.store.get(address).override is None  # warn: still routed


async def test_an_engine_with_another_max_model_len_is_a_mismatch(stack):
    app, (sim,) = await stack({"max_model_len": 8192})
    check = await _outcome(app, f"127.0.0.1:{sim.port}")
    assert check.outcome == "mismatch" and check.engine_max_model_len == 8192
    assert check.detail == f"max_model_len: the router's config says {CONTEXT}, the engine 8192"


async def test_drain_keeps_a_mismatched_engine_out_and_the_matching_one_in(stack, other_counter):
    app, (good, bad) = await stack({}, {"tokenizer": other_counter}, engine_check="drain")
    assert (await _outcome(app, f"127.0.0.1:{bad.port}")).outcome == "mismatch"
    assert (await _outcome(app, f"127.0.0.1:{good.port}")).outcome == "match"
    override = app.store.get(f"127.0.0.1:{bad.port}").override
    assert override is not None and override.factor == 0.0 and override.source == OVERRIDE_SOURCE
    assert app.store.get(f"127.0.0.1:{good.port}").override is None


async def test_an_endpoint_that_joins_later_is_checked(stack, other_counter):
    """Discovery or a reload adds an endpoint: it is checked then, not only at start."""
    app, (sim,) = await stack({})
    await _outcome(app, f"127.0.0.1:{sim.port}")
    late = SimServer(tokenizer=other_counter, max_model_len=CONTEXT, num_gpu_blocks=4096)
    await late.start()
    try:
        app.store.add_endpoint(EndpointConfig(address=f"127.0.0.1:{late.port}", models=[MODEL]))
        assert (await _outcome(app, f"127.0.0.1:{late.port}")).outcome == "mismatch"
        assert _gauge(app, "mismatch") == 1 and _gauge(app, "match") == 1
        app.store.remove_endpoint(f"127.0.0.1:{late.port}")
        assert _gauge(app, "mismatch") == 0  # a departed endpoint leaves the gauge
    finally:
        await late.aclose()


async def test_an_engine_without_tokenize_is_unverified_and_asked_rarely(stack):
    """An engine with no /tokenize (another server, an older vLLM) is no error, and is not asked
    again and again; one that cannot be reached is retried with backoff, not in a loop."""
    hits: list[str] = []

    def record(request: web.Request) -> None:
        if request.headers.get("user-agent") == USER_AGENT:  # not the health probes and scrapes
            hits.append(request.path)

    async def models(request: web.Request) -> web.Response:
        record(request)
        return web.json_response({"data": [{"id": MODEL, "max_model_len": CONTEXT}]})

    async def other(request: web.Request) -> web.Response:
        record(request)
        return web.json_response({"detail": "Not Found"}, status=404)

    failing: list[str] = []

    async def unavailable(request: web.Request) -> web.Response:
        if request.headers.get("user-agent") == USER_AGENT:
            failing.append(request.path)
        return web.json_response({"detail": "loading"}, status=503)

    engine, sick = web.Application(), web.Application()
    engine.router.add_get("/v1/models", models)
    engine.router.add_route("*", "/{tail:.*}", other)
    sick.router.add_route("*", "/{tail:.*}", unavailable)
    runners, ports = [], []
    for app_ in (engine, sick):
        runner = web.AppRunner(app_)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    with socket_free_port() as dead:
        try:
            app, _ = await stack(
                endpoints=[{"address": f"127.0.0.1:{p}", "models": [MODEL]} for p in ports] + [{"address": dead, "models": [MODEL]}]
            )
            check = await _outcome(app, f"127.0.0.1:{ports[0]}")
            assert check.outcome == "unverified" and "serves no /tokenize (HTTP 404)" in check.detail
            unreachable = await _outcome(app, dead)
            assert unreachable.outcome == "unverified" and unreachable.detail.startswith("engine unreachable")
            assert (await _outcome(app, f"127.0.0.1:{ports[1]}")).detail.startswith("engine unreachable: HTTP 503")
            await asyncio.sleep(2.5)  # retries after 1 s and 2 s at most; none of the one without /tokenize
            assert hits == ["/v1/models", "/tokenize"]
            assert 1 <= len(failing) <= 3, failing  # backoff, not a loop
            assert _gauge(app, "unverified") == 3 and _gauge(app, "mismatch") == 0
        finally:
            for runner in runners:
                await runner.cleanup()


class socket_free_port:
    """A `127.0.0.1:port` nothing listens on (bound, not listening, for the test's length)."""

    def __enter__(self) -> str:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self._sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self._sock.close()


async def _serve(handler) -> tuple[web.AppRunner, int]:
    app_ = web.Application()
    app_.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app_)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_hostile_engine_answers_are_unverified_not_fatal(stack):
    """A deeply nested JSON answer, or one far larger than any real /tokenize answer, leaves the
    endpoint `unverified` with a reason (the checker's task lives on: it is asked again), and the
    huge one is not read into memory whole."""
    asked: dict[int, int] = {}

    async def deep(request: web.Request) -> web.Response:
        asked[request.url.port] = asked.get(request.url.port, 0) + 1
        return web.Response(body=b"[" * 200_000 + b"]" * 200_000, content_type="application/json")

    async def huge(request: web.Request) -> web.StreamResponse:
        asked[request.url.port] = asked.get(request.url.port, 0) + 1
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"count": 1, "pad": "')
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(256):  # 256 MiB, unless the reader stops first
                await resp.write(chunk)
        except (ConnectionError, RuntimeError):  # the reader stopped
            pass
        return resp

    runners, ports = [], []
    for handler in (deep, huge):
        runner, port = await _serve(handler)
        runners.append(runner)
        ports.append(port)
    try:
        app, _ = await stack(endpoints=[{"address": f"127.0.0.1:{p}", "models": [MODEL]} for p in ports])
        deep_check, huge_check = [await _outcome(app, f"127.0.0.1:{p}") for p in ports]
        assert deep_check.outcome == "unverified" and "without a count" in deep_check.detail, deep_check
        assert huge_check.outcome == "unverified" and "answered more than 1048576 bytes" in huge_check.detail, huge_check
        tasks = app.engine_check._tasks  # type: ignore[union-attr]
        assert all(not t.done() for t in tasks.values()), "a hostile answer ended the endpoint's check task"
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_start_returns_before_the_router_counts_its_texts():
    """Counting the check texts (a chat template's first use: tens of ms per model) happens in
    the background: start-up, and so serving, does not wait for it."""
    import threading

    from extproc.datastore.engine_check import EngineChecker

    release = threading.Event()

    class SlowCounter:
        has_chat_template = False

        def count_text(self, text):
            release.wait(5)
            return type("Counted", (), {"count": 1})()

    checker = EngineChecker({MODEL: (CONTEXT, "warn")}, CollectorRegistry())
    try:
        await asyncio.wait_for(checker.start({MODEL: SlowCounter()}), timeout=1.0)
    finally:
        release.set()
        await checker.aclose()
