"""Small asyncio/aiohttp helpers shared by the servers and background loops."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp
from aiohttp import web

__all__ = ["cancel_and_wait", "listener_at", "read_at_most", "start_site"]


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | None]) -> None:
    """Cancel background tasks and wait until each has finished (their CancelledError is absorbed)."""
    pending = [t for t in tasks if t is not None]
    for t in pending:
        t.cancel()
    for t in pending:
        try:
            await t
        except asyncio.CancelledError:
            pass


async def read_at_most(stream: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole of `stream` (an HTTP answer's body), or None once it passes `limit` bytes: not
    read past that, what was read dropped.

    Raises:
        aiohttp.ClientError, TimeoutError: as reading the stream raises them.
    """
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def start_site(
    app: web.Application, host: str, port: int, *, reuse_port: bool = False, handler_cancellation: bool = False
) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (port 0: any free port); returns the runner and the bound port.
    `reuse_port` sets SO_REUSEPORT (another process of the same user may listen there too);
    `handler_cancellation` cancels a handler whose client went away (aiohttp's option).

    Raises:
        OSError: the address cannot be bound (the runner is cleaned up first).
    """
    runner = web.AppRunner(app, access_log=None, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server = site._server  # noqa: SLF001 - aiohttp has no public accessor for the bound port
    if server is not None and server.sockets:
        port = server.sockets[0].getsockname()[1]
    return runner, port


async def listener_at(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """Whether something accepts a TCP connection at host:port within `timeout_s` seconds (a
    wildcard host, 0.0.0.0 or ::, is tried on both loopbacks: a dual-stack bind shares an IPv4
    listener's port too). False for port 0, on any error, and on a timeout (a listener whose
    accept queue is full reads as none)."""
    if port == 0:
        return False
    targets = ["127.0.0.1", "::1"] if host in ("0.0.0.0", "", "::", "*") else [host]
    for target in targets:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(target, port), timeout_s)
        except (OSError, TimeoutError):
            continue
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return True
    return False
