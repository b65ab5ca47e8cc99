"""Merge what the discovery sources see and apply it to the datastore.

Every publish recomputes the wanted set — the union of each source's latest report, an address
two sources report taken from the first in configuration order — and applies the difference:

* a ready endpoint not in the datastore is added (`Datastore.add_endpoint`); one whose models
  or labels changed is updated in place; a draining one that is back takes requests again;
* an endpoint in the datastore that no source reports as ready is drained
  (`Datastore.drain_endpoint`): no new picks at once, removal when its last in-flight request
  ends, or after `drain_timeout_s` at the latest (`Datastore.remove_endpoint`).

A source that cannot reach its backend publishes nothing, so what it published last stays:
a DNS server or API server outage never empties the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence

from extproc.aio import cancel_and_wait
from extproc.datastore.agent_client import backoff_delay
from extproc.datastore.endpoints import Datastore
from extproc.discovery.base import Discovered, DiscoverySource
from extproc.logthrottle import WarnEvery

__all__ = ["Discovery"]

log = logging.getLogger(__name__)


RESTART_INITIAL_S = 1.0
"""First wait before a failed source runs again (seconds); doubles per failure in a row."""
RESTART_MAX_S = 30.0
"""Longest wait between restarts of a failing source (seconds); a source that ran this long
before failing starts over from `RESTART_INITIAL_S`."""
RESTART_LOG_INTERVAL_S = 60.0
"""A failing source's traceback is logged at most once per this many seconds."""


class Discovery:
    """Runs the sources and keeps the datastore's membership equal to what they see.

    Args:
        store: the datastore to keep up to date.
        sources: the running sources, in configuration order (earlier wins an address).
        drain_timeout_s: longest drain before an endpoint is removed anyway (seconds).
        initial_wait_s: `start()` waits at most this long for every source's first report
            (seconds).
        check_interval_s: how often drain deadlines are checked (seconds).
    """

    def __init__(
        self,
        store: Datastore,
        sources: Sequence[DiscoverySource],
        *,
        drain_timeout_s: float = 300.0,
        initial_wait_s: float = 5.0,
        check_interval_s: float = 1.0,
    ) -> None:
        self._store = store
        self._sources = list(sources)
        self._reports: list[Mapping[str, Discovered] | None] = [None] * len(self._sources)
        self._first = [asyncio.Event() for _ in self._sources]
        self._drain_timeout = drain_timeout_s
        self._initial_wait = initial_wait_s
        self._check_interval = check_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random()  # restart jitter
        self._settled = False  # every source reported once, or initial_wait_s passed
        self.applied = 0
        """Reports applied so far (count), for tests and diagnostics."""

    def publisher(self, index: int):
        """The `publish` callback of source number `index`."""

        def publish(endpoints: Mapping[str, Discovered]) -> None:
            self._reports[index] = dict(endpoints)
            self._first[index].set()
            self.apply()

        return publish

    def apply(self) -> None:
        """Bring the datastore in line with the latest reports (synchronous, on the event loop)."""
        wanted: dict[str, Discovered] = {}
        for report in self._reports:
            for addr, found in (report or {}).items():
                wanted.setdefault(addr, found)
        # Until every source has reported once (or start() stopped waiting), an endpoint no
        # report names may belong to a source yet to answer: nothing is drained for absence.
        complete = self._settled or all(r is not None for r in self._reports)
        for addr, found in wanted.items():
            if found.ready:
                self._store.add_endpoint(found.config)
        for ep in self._store.all():
            found = wanted.get(ep.address)
            if (found is None and complete) or (found is not None and not found.ready):
                if not ep.draining:
                    why = "not ready or terminating" if found is not None else "gone from discovery"
                    log.info("endpoint %s %s: draining", ep.address, why)
                self._store.drain_endpoint(ep.address)
        self.applied += 1

    async def start(self) -> None:
        """Start every source and wait (at most `initial_wait_s`) for each one's first report."""
        for i, src in enumerate(self._sources):
            self._tasks.append(asyncio.create_task(self._run(i, src), name=f"discovery-{src.name}"))
        self._tasks.append(asyncio.create_task(self._deadlines(), name="discovery-drain-deadlines"))
        waits = [asyncio.create_task(e.wait()) for e in self._first]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=self._initial_wait)
            for t in pending:
                t.cancel()
            for i, e in enumerate(self._first):
                if not e.is_set():
                    log.warning("discovery source %s has not answered in %.3g s; serving without it", self._sources[i].name, self._initial_wait)
        self._settled = True
        self.apply()

    async def _run(self, index: int, src: DiscoverySource) -> None:
        publish = self.publisher(index)
        failures = WarnEvery(log, RESTART_LOG_INTERVAL_S)
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                await src.run(publish)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one source must not end discovery for good
                # A source that fails again at once backs off (as the agent watcher does) and
                # logs its traceback once per interval, not once per restart.
                if time.monotonic() - started >= RESTART_MAX_S:
                    attempt = 0  # it ran a good while: a new failure, not the same one again
                delay = backoff_delay(attempt, initial_s=RESTART_INITIAL_S, max_s=RESTART_MAX_S, rng=self._rng)
                attempt += 1
                failures.log(logging.ERROR, "discovery source %s failed; restarting it in %.1f s", src.name, delay, exc_info=True)
                await asyncio.sleep(delay)

    async def _deadlines(self) -> None:
        while True:
            await asyncio.sleep(self._check_interval)
            self.expire_drains()

    def expire_drains(self, now: float | None = None) -> int:
        """Remove the endpoints draining for longer than `drain_timeout_s`; returns how many."""
        now = time.monotonic() if now is None else now
        late = [
            ep for ep in self._store.all() if ep.draining and ep.draining_since is not None and now - ep.draining_since >= self._drain_timeout
        ]
        for ep in late:
            log.warning(
                "endpoint %s still has %d requests in flight after draining %.0f s; removing it", ep.address, ep.inflight, self._drain_timeout
            )
            self._store.remove_endpoint(ep.address)
        return len(late)

    async def aclose(self) -> None:
        """Stop every source (the datastore keeps its endpoints)."""
        await cancel_and_wait(self._tasks)
        self._tasks = []
