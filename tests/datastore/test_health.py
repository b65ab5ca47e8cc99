"""Health probes: a slow engine (probes timing out) is tolerated longer than a refusing one."""

from __future__ import annotations

import asyncio

from aiohttp import web

from extproc.config.schema import EndpointConfig, HealthCheckConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.health import HealthChecker
from extproc.stack.ports import free_port
from .conftest import serve_get


async def test_timeouts_flip_after_timeout_threshold_refusals_after_unhealthy_threshold():
    delay = {"s": 0.0}

    async def health(_: web.Request) -> web.Response:
        await asyncio.sleep(delay["s"])
        return web.Response(text="ok")

    runner, port = await serve_get("/health", health)
    store = Datastore([EndpointConfig(address=f"127.0.0.1:{port}", models=["m"]), EndpointConfig(address=f"127.0.0.1:{free_port()}", models=["m"])])
    slow, dead = store.all()
    checker = HealthChecker(store, HealthCheckConfig(interval_s=60, timeout_s=0.3, unhealthy_threshold=2, timeout_threshold=4))
    try:
        await checker.start()  # first probe decides outright
        assert slow.healthy and not dead.healthy
        dead.healthy, dead.consecutive_failures = True, 0  # as if it had been up: two refusals take it down
        delay["s"] = 1.0  # well past the 0.3 s timeout; the 0.3 s leaves a loaded machine room to answer in time
        results = []
        for _ in range(4):
            await checker.probe_all()
            results.append((slow.healthy, dead.healthy))
        assert results == [(True, True), (True, False), (True, False), (False, False)]
        assert slow.last_probe_error == "timeout" and dead.last_probe_error == "ClientConnectorError: Connection refused"
        delay["s"] = 0.0
        await checker.probe_all()
        assert slow.healthy
    finally:
        await checker.aclose()
        await runner.cleanup()


async def test_an_endpoint_added_after_start_takes_no_request_before_its_first_probe():
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    runner, port = await serve_get("/health", health)
    store = Datastore([])
    checker = HealthChecker(store, HealthCheckConfig(interval_s=60, timeout_s=0.5))
    store.on_added.append(checker.add)
    try:
        await checker.start()
        up = store.add_endpoint(EndpointConfig(address=f"127.0.0.1:{port}", models=["m"]))
        down = store.add_endpoint(EndpointConfig(address=f"127.0.0.1:{free_port()}", models=["m"]))
        assert not up.healthy and not down.healthy  # not probed yet: out of routing
        for _ in range(100):
            if up.probed and down.probed:
                break
            await asyncio.sleep(0.01)
        assert up.healthy and not down.healthy
    finally:
        await checker.aclose()
        await runner.cleanup()
