"""The admin HTTP server (default port 9090): `/metrics`, `/healthz`, `/api/v1/endpoints`.

Nothing here echoes request content, user ids or credentials.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.datastore.endpoints import Datastore
from extproc.metrics import Metrics

__all__ = ["AdminServer"]


class AdminServer:
    """aiohttp app serving the admin endpoints.

    Args:
        metrics: whose registry `/metrics` exposes.
        store: endpoint state for `/api/v1/endpoints`.
        is_serving: returns False while shutting down (then `/healthz` answers 503).
        host, port: listen address (port 0 picks a free one; see `.port` after start).
    """

    def __init__(self, metrics: Metrics, store: Datastore, is_serving: Callable[[], bool], host: str, port: int) -> None:
        self._metrics = metrics
        self._store = store
        self._is_serving = is_serving
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port = port

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/api/v1/endpoints", self._endpoints)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        server = site._server  # noqa: SLF001 - aiohttp exposes no public bound-port accessor
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        for ep in self._store.all():
            self._metrics.endpoint_healthy.labels(ep.address).set(1 if ep.healthy else 0)
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        if not self._is_serving():
            return web.json_response({"status": "shutting_down"}, status=503)
        healthy = sum(1 for ep in self._store.all() if ep.healthy)
        return web.json_response({"status": "ok", "endpoints_healthy": healthy, "endpoints": len(self._store.all())})

    async def _endpoints(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "endpoints": [
                    {
                        "address": ep.address,
                        "models": sorted(ep.models),
                        "labels": ep.labels,
                        "healthy": ep.healthy,
                        "inflight": ep.inflight,
                        "last_probe_error": ep.last_probe_error,
                    }
                    for ep in self._store.all()
                ]
            }
        )
