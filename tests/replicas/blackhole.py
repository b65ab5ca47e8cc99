"""A TCP proxy on 127.0.0.1 that can drop its open connections' path silently: after
`blackhole()`, the bytes of the connections open then go nowhere, in either direction, and
neither side is closed — what a lost NAT or conntrack entry, or a peer host gone without a
FIN or RST, looks like from each end. Connections made after it are forwarded again, unless
asked otherwise."""

from __future__ import annotations

import asyncio
import contextlib


class BlackholeProxy:
    """Forwards `127.0.0.1:port` to `target_host:target_port`.

    Args:
        target_host, target_port: where to forward (a redis-server).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._conns: list[tuple[dict[str, bool], asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.accepted = 0
        """Connections accepted (count)."""
        self._new_dead = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def blackhole(self, *, spare: int | None = None, new_too: bool = False) -> None:
        """From now on, the connections open now forward nothing and are never closed.

        Args:
            spare: the index (in order of acceptance, from 0) of one connection left working.
            new_too: connections accepted later are black holes from the start.
        """
        for i, (state, _, _) in enumerate(self._conns):
            state["dead"] = i != spare
        self._new_dead = new_too

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        state = {"dead": self._new_dead}
        self._conns.append((state, writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer, state), self._pipe(up_reader, writer, state))

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, state: dict[str, bool]) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(65536):
                if not state["dead"]:  # dead: read and drop, so nothing backs up and nothing closes
                    dst.write(data)
                    await dst.drain()
            if not state["dead"]:
                dst.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for _, a, b in self._conns:
            a.close()
            b.close()
        if self._server is not None:
            await self._server.wait_closed()
