"""Active health probes of endpoints: `GET http://<address><path>` on a fixed period.

The first probe sets an endpoint's health outright; after that it flips to unhealthy after
`unhealthy_threshold` consecutive failures (connection error or a non-2xx status) and back
after `healthy_threshold` successes. A probe that times out says the engine (or this host) is
slow, not that it is down: a streak made only of timeouts flips it after `timeout_threshold`
probes instead, and `healthy-filter` still routes to it in panic (`last_probe_error` is
`PROBE_TIMEOUT`).
"""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp

from extproc.aio import cancel_and_wait
from extproc.config.schema import HealthCheckConfig
from extproc.datastore.endpoints import Datastore, Endpoint
from extproc.types import PROBE_TIMEOUT

__all__ = ["HealthChecker"]

log = logging.getLogger(__name__)


def probe_error(exc: aiohttp.ClientError) -> str:
    """A failed probe in words an operator can act on: the exception's type and, for a failed
    connection, the operating system's reason ("ClientConnectorError: Connection refused")."""
    errno = exc.os_error.errno if isinstance(exc, aiohttp.ClientConnectorError) else None
    return f"{type(exc).__name__}: {os.strerror(errno)}" if errno else type(exc).__name__


class HealthChecker:
    """Probes every endpoint of a datastore.

    Args:
        store: the datastore whose endpoints' `healthy` flags this maintains.
        cfg: probe settings.
    """

    def __init__(self, store: Datastore, cfg: HealthCheckConfig) -> None:
        self._store = store
        self._cfg = cfg
        self._task: asyncio.Task[None] | None = None
        self._timeouts: dict[str, int] = {}  # consecutive timed-out probes per address
        self._session: aiohttp.ClientSession | None = None
        self._first: set[asyncio.Task[None]] = set()  # first probes of endpoints added later

    async def start(self) -> None:
        """Probe once (so the first decisions see real health), then keep probing in the background."""
        if not self._cfg.enabled:
            return
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._cfg.timeout_s),
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )
        await self.probe_all()
        self._task = asyncio.create_task(self._loop(), name="health-checker")

    def add(self, ep: Endpoint) -> None:
        """An endpoint joined after `start`: out of routing (unhealthy) until its first probe,
        which runs now and decides outright, as at start. No-op when probing is off or not
        started (then `start` probes it)."""
        if self._session is None or ep.probed:
            return
        ep.healthy = False
        task = asyncio.create_task(self._probe(ep), name=f"health-first-{ep.address}")
        self._first.add(task)
        task.add_done_callback(self._first.discard)

    def forget(self, ep: Endpoint) -> None:
        """An endpoint left the fleet: drop its probe streak."""
        self._timeouts.pop(ep.address, None)

    async def aclose(self) -> None:
        await cancel_and_wait([self._task, *self._first])
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._cfg.interval_s)
            try:
                await self.probe_all()
            except Exception:  # never let the loop die
                log.exception("health probe round failed")

    async def probe_all(self) -> None:
        """Probe every endpoint concurrently and update their health."""
        await asyncio.gather(*(self._probe(ep) for ep in self._store.all()))

    async def _probe(self, ep: Endpoint) -> None:
        if self._session is None:  # closed while this round ran
            return
        error: str | None = None
        try:
            async with self._session.get(f"http://{ep.address}{self._cfg.path}") as resp:
                await resp.read()
                if not 200 <= resp.status < 300:
                    error = f"status {resp.status}"
        except TimeoutError:
            error = PROBE_TIMEOUT
        except aiohttp.ClientError as exc:
            error = probe_error(exc)
        if not ep.probed:
            # The first probe decides outright: no reason to route to an endpoint that never answered.
            ep.probed = True
            ep.healthy = error is None
            if error is not None:
                log.warning("endpoint %s unhealthy at start: %s", ep.address, error)
        if self._store.get(ep.address) is not ep:
            return  # removed while the probe ran: keep no state under its address
        if error is None:
            self._timeouts[ep.address] = 0
            ep.consecutive_failures = 0
            ep.consecutive_successes += 1
            if not ep.healthy and ep.consecutive_successes >= self._cfg.healthy_threshold:
                ep.healthy = True
                log.info("endpoint %s healthy again", ep.address)
        else:
            ep.consecutive_successes = 0
            ep.consecutive_failures += 1
            ep.last_probe_error = error
            timeouts = self._timeouts[ep.address] = self._timeouts.get(ep.address, 0) + 1 if error == PROBE_TIMEOUT else 0
            slow_only = timeouts >= ep.consecutive_failures
            threshold = max(self._cfg.timeout_threshold, self._cfg.unhealthy_threshold) if slow_only else self._cfg.unhealthy_threshold
            if ep.healthy and ep.consecutive_failures >= threshold:
                ep.healthy = False
                log.warning("endpoint %s unhealthy: %s", ep.address, error)
