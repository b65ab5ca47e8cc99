"""Tiny OpenAI-ish engines for the end-to-end tests: record every request, answer fixed bytes.

Each `Backend` is an aiohttp app on 127.0.0.1 (port picked by the kernel) that records the raw
method, path, headers and body of every API request (health probes are answered, not recorded)
and answers:

- POST /v1/chat/completions, /v1/completions: `JSON_BODY` byte for byte, or, when the request
  JSON has `"stream": true`, `SSE_BODY` written in awkward pieces (`SSE_CHUNK` bytes each, so
  events split mid-JSON and between the two newlines) — what a client receives must still be
  exactly `SSE_BODY`;
- GET /v1/models: a model list; GET /health: 200.

Every response carries `x-backend: <name>` so a test can tell who answered.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson
from aiohttp import web

from extproc.datastore.engine_check import USER_AGENT as ENGINE_CHECK_AGENT

__all__ = ["Backend", "JSON_BODY", "SSE_BODY", "SSE_CHUNK", "Received"]

# Deliberately not what a JSON library would re-emit (key order, spacing, escapes, trailing
# newline), so any re-encoding on the way back shows.
JSON_BODY = (
    b'{"id":"cmpl-e2e",  "object":"chat.completion","created":1700000000,"model":"Qwen/Qwen3-8B",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"caf\\u00e9 \xe2\x9c\x93 <ok>"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}\n'
)

SSE_BODY = b"".join(
    b'data: {"id":"cmpl-e2e","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok%d "}}]}\n\n'
    % i
    for i in range(40)
) + b"data: [DONE]\n\n"

SSE_CHUNK = 7
"""Bytes per write of the SSE body: small and odd, so chunk and event boundaries never align."""

_API_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True, slots=True)
class Received:
    """One recorded request: method, path, raw header pairs (bytes, as received), body (bytes)."""

    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def header(self, name: str) -> bytes | None:
        """The first value of header `name` (case-insensitive), raw bytes; None when absent."""
        key = name.lower().encode()
        for k, v in self.headers:
            if k.lower() == key:
                return v
        return None


class Backend:
    """One recording engine. `start()` binds 127.0.0.1:0; `aclose()` stops it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[Received] = []
        self.failing_health = False
        self.health_delay_s = 0.0  # GET /health answers after this long (a slow, starved engine)
        self.waiting = 0  # vllm:num_requests_waiting its /metrics reports (a saturated engine)
        self.stream_gate: asyncio.Event | None = None  # streamed answers wait here after their first chunk
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """`ip:port`, as written into x-gateway-destination-endpoint."""
        return f"127.0.0.1:{self.port}"

    def clear(self) -> None:
        self.received.clear()

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        app.router.add_get("/healthz", self._healthz)  # what a node agent answers Envoy's checks with
        app.router.add_get("/metrics", self._metrics)  # scraped by the server; not recorded
        app.router.add_get("/v1/models", self._models)
        for path in _API_PATHS:
            app.router.add_post(path, self._generate)
        app.router.add_route("*", "/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _headers(self) -> dict[str, str]:
        return {"x-backend": self.name}

    async def _record(self, request: web.Request) -> bytes:
        body = await request.read()
        if request.headers.get("user-agent") == ENGINE_CHECK_AGENT:
            return body  # the server's own check of this engine (/v1/models, /tokenize): not a client's request
        self.received.append(Received(request.method, request.path_qs, tuple(request.raw_headers), body))
        return body

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.Response(text="ok", headers=self._headers())

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.failing_health else 200, text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        body = b'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="Qwen/Qwen3-8B"} %d\n' % self.waiting
        return web.Response(body=body, content_type="text/plain", headers=self._headers())

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        body = orjson.dumps({"object": "list", "data": [{"id": "Qwen/Qwen3-8B", "object": "model"}]})
        return web.Response(body=body, content_type="application/json", headers=self._headers())

    async def _other(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.Response(status=404, body=b'{"error":"not here"}', content_type="application/json", headers=self._headers())

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        try:
            stream = orjson.loads(body).get("stream") is True
        except (orjson.JSONDecodeError, AttributeError):
            stream = False
        if not stream:
            return web.Response(body=JSON_BODY, content_type="application/json", headers=self._headers())
        resp = web.StreamResponse(headers={**self._headers(), "content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        for i in range(0, len(SSE_BODY), SSE_CHUNK):
            await resp.write(SSE_BODY[i : i + SSE_CHUNK])
            if i == 0 and self.stream_gate is not None:
                await self.stream_gate.wait()  # a request held in flight until the test lets it go
            if i % (SSE_CHUNK * 20) == 0:
                await asyncio.sleep(0.001)  # let some pieces leave as separate TCP writes
        await resp.write_eof()
        return resp
