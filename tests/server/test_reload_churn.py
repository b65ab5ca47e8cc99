"""Reloads that keep changing an endpoint's agent and KV-event sockets
(`Datastore.add_endpoint` → `on_changed`) must not pile up subscribers, watch tasks or sockets."""

from __future__ import annotations

import asyncio
import os

from extproc.config.schema import EndpointConfig
from tests.server.test_contract import ENDPOINTS, MODEL


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_many_relinks_leave_one_subscriber_one_watch_and_no_extra_tasks(make_app):
    app = await make_app()
    addr = ENDPOINTS[0]

    def cfg(i: int) -> EndpointConfig:
        return EndpointConfig(address=addr, models=[MODEL], kv_events=f"tcp://127.0.0.1:{20000 + i}", agent=f"127.0.0.1:{21000 + i}")

    app.store.add_endpoint(cfg(0))
    await asyncio.sleep(0.3)
    base_tasks, base_fds = len(asyncio.all_tasks()), fds()
    for i in range(1, 101):
        app.store.add_endpoint(cfg(i))
        await asyncio.sleep(0)
    # Replaced subscribers and watches close in the background: on a loaded machine that takes
    # more than a fixed pause; what must hold is that they do finish (bounded wait).
    deadline = asyncio.get_running_loop().time() + 10
    while len(asyncio.all_tasks()) > base_tasks and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert [s.endpoint for s in app.kv_events.subscribers] == ["tcp://127.0.0.1:20100"]
    assert app._agents.agents.count("127.0.0.1:21100") == 1 and len(app._agents.agents) == 1
    tasks, now_fds = len(asyncio.all_tasks()), fds()
    assert tasks <= base_tasks, f"tasks {base_tasks} -> {tasks}"
    assert now_fds <= base_fds + 2, f"fds {base_fds} -> {now_fds}"
    # And back to none: no subscriber, no watch.
    app.store.add_endpoint(EndpointConfig(address=addr, models=[MODEL]))
    await asyncio.sleep(0.3)
    assert app.kv_events.subscribers == [] and app._agents.agents == []
    assert len(asyncio.all_tasks()) <= base_tasks - 2
