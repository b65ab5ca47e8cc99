"""The static source and a half-written file: a cut at a line boundary still validates with
fewer endpoints, and applying it drained most of the fleet. Such a shrink is refused unless
SIGHUP asks for it; a shrink within `max_removed_share` goes through, logged."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import yaml

from extproc.config.loader import load_config
from extproc.discovery.base import SourceContext
from extproc.discovery.static import Params, Source

MODEL = "m"
ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 7)]


def _text(addresses: list[str]) -> str:
    return yaml.safe_dump(
        {"models": [{"name": MODEL, "path": "builtin:qwen3-8b"}], "endpoints": [{"address": a, "models": [MODEL]} for a in addresses]}, sort_keys=False
    )


async def test_a_half_written_file_is_refused_and_sighup_applies_a_real_shrink(tmp_path: Path, caplog):
    path = tmp_path / "c.yaml"
    whole = _text(ADDRESSES)
    path.write_text(whole, encoding="utf-8")
    source = Source(Params(poll_interval_s=0.05), SourceContext(load_config(path), path))
    reports: list[set[str]] = []
    task = asyncio.create_task(source.run(lambda found: reports.append(set(found))))
    loop = asyncio.get_running_loop()

    async def until(cond, what: str) -> None:
        deadline = loop.time() + 5
        while not cond():
            assert loop.time() < deadline, what
            await asyncio.sleep(0.02)

    caplog.set_level(logging.INFO, logger="extproc.discovery.static")
    try:
        await until(lambda: reports and signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL, "started")
        lines = whole.splitlines(keepends=True)
        cut = "".join(lines[: lines.index(next(x for x in lines if "10.0.0.3" in x))])  # a line boundary: 2 endpoints left
        path.write_text(cut, encoding="utf-8")  # in place, as a naive writer does
        await until(lambda: source.refused == 1, "the half-written file was not refused")
        assert reports[-1] == set(ADDRESSES)
        assert "would remove 4 of 6 endpoints" in caplog.text and "atomically" in caplog.text

        path.write_text(_text(ADDRESSES[:4]), encoding="utf-8")  # within the share: applied, logged
        await until(lambda: reports[-1] == set(ADDRESSES[:4]), "a shrink within the share was not applied")
        assert "removes 2 of 6 endpoints (they drain): 10.0.0.5:8000, 10.0.0.6:8000" in caplog.text

        path.write_text(_text(ADDRESSES[:1]), encoding="utf-8")
        await until(lambda: source.refused == 2, "not refused")
        os.kill(os.getpid(), signal.SIGHUP)  # the operator means it
        await until(lambda: reports[-1] == set(ADDRESSES[:1]), "SIGHUP did not apply the shrink")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
