"""A stand-in for the Kubernetes API server: serves the responses in tests/testdata/kubernetes
(lists, watch event streams, a dropped watch, 410 Gone) in the order a test scripts, and
records every request. No API server runs in this project's test environment."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from aiohttp import web

DATA = Path(__file__).resolve().parents[1] / "testdata" / "kubernetes"


def data(name: str) -> bytes:
    return (DATA / name).read_bytes()


GONE = orjson.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "too old resource version", "reason": "Expired", "code": 410})


@dataclass
class Seen:
    """One request: path, query, whether it carried the expected bearer token."""

    path: str
    query: dict[str, str]
    authorized: bool

    @property
    def watch(self) -> bool:
        return self.query.get("watch") == "1"


Watch = Callable[[web.Request], Awaitable[web.StreamResponse]]


def stream(lines: bytes, *, drop: bool = False, gate: asyncio.Event | None = None) -> Watch:
    """A watch answer: the event lines, then a clean end — or, with `drop`, the connection cut
    mid-stream (no terminating chunk), as a restarting API server or an idle proxy does."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if gate is not None:
            await gate.wait()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for line in lines.splitlines(keepends=True):
            await resp.write(line)
        if drop:
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write_eof()
        return resp

    return handler


def gone() -> Watch:
    """A watch refused with 410 Gone (the version was compacted before the watch began)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(status=410, body=GONE, content_type="application/json")

    return handler


def hold(until: asyncio.Event, max_s: float | None = None) -> Watch:
    """A watch with no events: open until `until` is set, or its own timeoutSeconds (when
    `max_s` is None) or `max_s` pass, then ended cleanly."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        limit = max_s if max_s is not None else float(request.query.get("timeoutSeconds", "30"))
        try:
            await asyncio.wait_for(until.wait(), limit)
        except TimeoutError:
            pass
        await resp.write_eof()
        return resp

    return handler


@dataclass
class FakeApiServer:
    """Serves `lists` (one body per list request; the last repeats) and `watches` (one handler
    per watch request; the last repeats) for `path`, and `objects` (path → body) for GETs.

    Attributes:
        seen: every request, in order.
    """

    token: str
    path: str
    lists: list[bytes]
    watches: list[Watch]
    objects: dict[str, bytes] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    _runner: web.AppRunner | None = None
    _n_lists: int = 0
    _n_watches: int = 0

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def watch_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.watch]

    def list_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path == self.path and not s.watch]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.path, dict(request.query), request.headers.get("Authorization") == f"Bearer {self.token}")
        self.seen.append(seen)
        if not seen.authorized:
            return web.Response(status=401, body=b'{"kind":"Status","code":401,"reason":"Unauthorized"}', content_type="application/json")
        if request.path in self.objects:
            return web.Response(body=self.objects[request.path], content_type="application/json")
        if request.path != self.path:
            return web.Response(status=404, body=b'{"kind":"Status","code":404}', content_type="application/json")
        if seen.watch:
            handler = self.watches[min(self._n_watches, len(self.watches) - 1)]
            self._n_watches += 1
            return await handler(request)
        body = self.lists[min(self._n_lists, len(self.lists) - 1)]
        self._n_lists += 1
        return web.Response(body=body, content_type="application/json")
