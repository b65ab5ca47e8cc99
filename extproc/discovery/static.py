"""The static source: the configuration file's `endpoints` list, reloaded when the file changes
or the process gets SIGHUP.

A reload reads the whole file again and validates it as at start; only `endpoints` is applied
(other changes are logged as needing a restart). A file that does not validate, or whose
endpoints name a model the running configuration does not serve, is refused with an error in
the log and the endpoints stay as they were. Endpoints that left are drained, never cut: their
in-flight requests finish (`extproc.discovery.manager`).

A reload that adds endpoints logs a WARNING naming them and the command that regenerates a bare
Envoy's fallback cluster: `llm-extproc envoy-config` wrote the list as it was at the time, and
while llm-extproc is unreachable fail-open Envoy balances over that list only
(`fallback_cluster_note`).

The file is polled (its size, mtime and inode, every `poll_interval_s`): a ConfigMap mounted
in a pod changes by an atomic symlink swap, which a stat sees and a watch on the file misses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Literal

import pydantic

from extproc.config.loader import ConfigError, load_config
from extproc.config_base import Strict
from extproc.config.schema import Config, EndpointConfig
from extproc.discovery.base import Discovered, DiscoverySource, Publish, SourceContext

__all__ = ["Params", "Source", "fallback_cluster_note"]

log = logging.getLogger(__name__)


class Params(Strict):
    """`{type: static}` parameters.

    Attributes:
        watch: reload when the configuration file changes (polled).
        poll_interval_s: how often the file is checked (seconds).
        sighup: reload on SIGHUP (when running on the main thread's event loop).
    """

    type: Literal["static"] = "static"
    watch: bool = True
    poll_interval_s: float = pydantic.Field(default=1.0, gt=0)
    sighup: bool = True


def _stamp(path: os.PathLike[str] | str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Source(DiscoverySource):
    """The configuration file's endpoints.

    Args:
        params: `Params`.
        ctx: the running configuration and its path (no path: the endpoints never change).
    """

    name = "static"

    def __init__(self, params: Params, ctx: SourceContext) -> None:
        self._params = params
        self._config = ctx.config
        self._path = ctx.config_path
        self._wake = asyncio.Event()
        self.reloads = 0
        """Reloads applied (count)."""
        self.refused = 0
        """Reloads refused for an invalid file (count)."""

    @staticmethod
    def _report(endpoints: list[EndpointConfig]) -> dict[str, Discovered]:
        return {e.address: Discovered(e) for e in endpoints}

    async def run(self, publish: Publish) -> None:
        publish(self._report(self._config.endpoints))
        if self._path is None:
            await asyncio.Event().wait()  # nothing to reload from
        loop = asyncio.get_running_loop()
        hup = False
        if self._params.sighup:
            try:
                loop.add_signal_handler(signal.SIGHUP, self._wake.set)
                hup = True
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals
                log.info("static discovery: SIGHUP reload unavailable on this loop")
        stamp = _stamp(self._path)
        try:
            while True:
                timeout = self._params.poll_interval_s if self._params.watch else None
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                    reason = "SIGHUP"
                except TimeoutError:
                    reason = "file change"
                self._wake.clear()
                now = _stamp(self._path)
                if reason == "file change" and (now == stamp or now is None):
                    continue
                stamp = now
                endpoints = await self._reload(reason)
                if endpoints is not None:
                    self.reloads += 1
                    publish(self._report(endpoints))
        finally:
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)

    async def _reload(self, reason: str) -> list[EndpointConfig] | None:
        """The new file's endpoints, or None (refused, logged)."""
        assert self._path is not None
        try:
            new: Config = await asyncio.to_thread(load_config, self._path)
        except ConfigError as exc:
            self.refused += 1
            log.error("configuration reload (%s) refused, endpoints unchanged: %s", reason, exc)
            return None
        served = {m.name for m in self._config.models}
        unknown = sorted({m for e in new.endpoints for m in e.models} - served)
        if unknown:
            self.refused += 1
            log.error(
                "configuration reload (%s) refused, endpoints unchanged: endpoints name models this process does not serve "
                "(%s); adding models needs a restart",
                reason, ", ".join(unknown),
            )  # fmt: skip
            return None
        if new.model_copy(update={"endpoints": self._config.endpoints}) != self._config:
            log.warning("configuration reload (%s): only `endpoints` is applied; the other changes need a restart", reason)
        note = fallback_cluster_note(self._config.endpoints, new.endpoints, self._path)
        self._config = self._config.model_copy(update={"endpoints": new.endpoints})
        log.info("configuration reload (%s): %d endpoints", reason, len(new.endpoints))
        if note:
            log.warning("configuration reload (%s): %s", reason, note)
        return new.endpoints


def fallback_cluster_note(old: list[EndpointConfig], new: list[EndpointConfig], path: os.PathLike[str] | str) -> str | None:
    """What to tell the operator when a reload adds endpoints (None when it adds none): llm-extproc
    routes to them at once, but a bare Envoy's fail-open fallback cluster is the list
    `envoy-config` wrote, so regenerate it (the command names the configuration file) and
    restart or hot-restart Envoy. With Istio the fallback is the `vllm` Service: its selector,
    not this list, decides."""
    before = {e.address for e in old}
    added = [e.address for e in new if e.address not in before]
    if not added:
        return None
    shown = ", ".join(added[:5]) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
    return (
        f"{len(added)} endpoint(s) added ({shown}): llm-extproc routes to them now, but Envoy's fail-open fallback "
        f"cluster (used while llm-extproc is unreachable) still lists the old endpoints; regenerate it with "
        f"`llm-extproc envoy-config --config {path} -o <your envoy.yaml>` and restart Envoy (with Istio the "
        "vllm Service's selector covers them)"
    )

