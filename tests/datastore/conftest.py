"""Shared pieces of the datastore tests: a throwaway aiohttp server on a free port."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web


async def serve_get(path: str, handler: Callable[[web.Request], Awaitable[web.Response]]) -> tuple[web.AppRunner, int]:
    """Serve `GET path` with `handler` on 127.0.0.1; return the runner (clean it up) and the port."""
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
