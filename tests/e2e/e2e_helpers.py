"""Shared pieces of the end-to-end tests: model names, the engines trio, request bodies, Envoy
start-up with our configs, and the OpenAI error-shape assertion."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from extproc.pipeline.tokens import TokenCounter
from extproc.sim.server import SimServer
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.fleet import SimProcess
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.fake_engines import Backend

__all__ = ["ALIAS", "DEAD_MODEL", "MODEL", "Engines", "assert_openai_error", "chat", "in_process_sims", "start_envoy", "start_server", "stream_chat"]

MODEL = "Qwen/Qwen3-8B"
ALIAS = "qwen3-8b"
DEAD_MODEL = "dead-model"
"""Served only by an address nothing listens on: llm-extproc answers it with its own 503."""


@dataclass(frozen=True, slots=True)
class Engines:
    """`a` and `b` serve MODEL; `intruder` is configured nowhere: nothing may ever reach it."""

    a: Backend
    b: Backend
    intruder: Backend

    @property
    def serving(self) -> tuple[Backend, Backend]:
        return (self.a, self.b)

    def by_name(self, name: str | None) -> Backend:
        (found,) = [e for e in (self.a, self.b, self.intruder) if e.name == name]
        return found

    def clear(self) -> None:
        for e in (self.a, self.b, self.intruder):
            e.clear()


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    """A minimal chat request body for MODEL (by its alias)."""
    return {"model": ALIAS, "messages": [{"role": "user", "content": content}], **extra}


async def start_envoy(
    name: str,
    *,
    workdir: Path,
    server: ExtProcServerProcess,
    engines: Engines,
    message_timeout: str | None = None,
) -> EnvoyProcess:
    """A started Envoy on config `name`, pointed at `server` and (fallback) at engines a and b.

    `message_timeout` overrides the ext_proc filter's, to provoke timeouts on purpose.
    """
    cfg = rewrite_config(
        load_envoy_config(name),
        RunSettings(extproc=server.grpc_address, endpoints=[("127.0.0.1", e.port) for e in engines.serving]),
    )
    if message_timeout is not None:
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
        ext_proc["typed_config"]["message_timeout"] = message_timeout
    label = name if message_timeout is None else f"{name}-impatient"
    envoy = EnvoyProcess(cfg, workdir=workdir, name=label)
    await envoy.start()
    return envoy


@asynccontextmanager
async def in_process_sims(counter: TokenCounter, n: int, speed: float, sim_class: type[SimServer] = SimServer, **kw: Any) -> AsyncIterator[list[SimServer]]:
    """`n` simulators (`sim_class`, default profile, `speed` simulated seconds per wall second,
    `kw` to its constructor) on free ports in this event loop; closed on exit."""
    started: list[SimServer] = []
    try:
        for _ in range(n):
            sim = sim_class(tokenizer=counter, speed=speed, **kw)
            await sim.start()
            started.append(sim)
        yield started
    finally:
        for sim in started:
            await sim.aclose()


async def start_beside(server: ExtProcServerProcess, sims: Sequence[SimProcess], timeout_s: float = 30.0) -> None:
    """Start `server` and `sims` side by side (each a few seconds of tokenizer loading), the
    simulators on the ports `server`'s config lists (fixed when they were made: `port=`), then
    wait until the server has probed every endpoint healthy: its first probes may have come
    before a simulator listened.

    Raises:
        ProcessError: one of them did not start.
        AssertionError: not every endpoint healthy within `timeout_s` seconds.
        Either way every one of them is stopped first.
    """
    try:
        results = await asyncio.gather(server.start(), *(s.start() for s in sims), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(trust_env=False, timeout=5) as c:
            while True:
                health = (await c.get(f"{server.admin_url}/healthz")).json()
                if health["endpoints_healthy"] == health["endpoints"]:
                    return
                assert time.monotonic() < deadline, f"endpoints healthy after {timeout_s:g} s: {health}"
                await asyncio.sleep(0.05)
    except BaseException:
        await asyncio.gather(server.aclose(), *(s.aclose() for s in sims), return_exceptions=True)
        raise


async def start_server(workdir: Path, config: dict[str, Any], name: str, **kw: Any) -> ExtProcServerProcess:
    """A started `llm-extproc serve` on `config` (written to `<workdir>/<name>.yaml`); `kw` goes
    to `ExtProcServerProcess` (fixed ports, log level). Stop it with `aclose()`."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    server = ExtProcServerProcess(path, workdir=workdir, name=name, **kw)
    await server.start()
    return server


async def stream_chat(c: httpx.AsyncClient, model: str, max_tokens: int) -> str:
    """One streamed chat completion of `max_tokens` tokens (ignore_eos): 'ok' when it ends with
    [DONE], else what went wrong (status, transport error, or a cut stream)."""
    body = {"model": model, "messages": [{"role": "user", "content": "tell me"}], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"status {r.status_code}: {(await r.aread())[:200]!r}"
            text = b"".join([chunk async for chunk in r.aiter_raw()])
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok" if text.rstrip().endswith(b"data: [DONE]") else f"cut after {len(text)} bytes"


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """Assert `response` is our JSON error with `status`; return its `error` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]
