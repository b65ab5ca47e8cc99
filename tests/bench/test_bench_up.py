"""`llm-extproc up`: the stack starts, prints its URLs, serves a request through Envoy, and Ctrl-C
stops every child (checked by PID)."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import httpx
import pytest

from tests.bench.stack_helpers import FLEET_1, Command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_up_serves_through_envoy_and_stops_cleanly(tmp_path: Path) -> None:
    with Command(["up", "--port", "0", "--fleet", FLEET_1, "--speed", "10"], tmp_path) as cmd:
        cmd.wait_for("Ctrl-C stops everything", timeout_s=90)
        out = cmd.stdout
        api = re.search(r"llm-extproc \(OpenAI API\): (http://127\.0\.0\.1:\d+)/v1", out)
        sims = re.findall(r"sim-\d (?:h100|a100)-qwen3-8b: http://(127\.0\.0\.1:\d+)/metrics", out)
        assert api and len(sims) == 1, out
        for label in ("Envoy admin: http://", "llm-extproc admin: http://", "llm-extproc metrics: http://"):
            assert label in out
        response = httpx.post(
            f"{api.group(1)}/v1/chat/completions",
            json={"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
            timeout=30,
            trust_env=False,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 5
        assert response.headers["x-llm-endpoint"] in sims  # Envoy names the simulator that served
        by_alias = httpx.post(
            f"{api.group(1)}/v1/chat/completions",
            json={"model": "qwen3-8b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
            timeout=30,
            trust_env=False,
        )
        assert by_alias.status_code == 200, by_alias.text  # the short name, as the example config has it
        logs = Path(re.search(r"logs: (\S+)", out).group(1))
        assert (logs / "llm-extproc.log").is_file() and (logs / "envoy.log").is_file()
        cmd.track()
        cmd.proc.send_signal(signal.SIGINT)
        rc = cmd.wait(timeout_s=60)
    # the simulator, llm-extproc and Envoy, all gone
    cmd.assert_clean_exit(rc, 0, children_at_least=3)
    # a clean stop leaves nothing behind: every `up` used to leave its logs in /tmp
    try:
        assert not logs.exists() and "child logs kept" not in cmd.stdout, cmd.stdout
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def test_up_stops_and_says_so_when_a_child_dies(tmp_path: Path) -> None:
    """A simulator killed under `up` ends it (exit 1) naming the simulator, every other child
    stopped, and the logs in `--logs DIR` kept."""
    logs = tmp_path / "logs"
    with Command(["up", "--port", "0", "--fleet", FLEET_1, "--speed", "10", "--logs", str(logs)], tmp_path) as cmd:
        cmd.wait_for("Ctrl-C stops everything", timeout_s=90, children_at_least=3)
        assert f"logs: {logs} (kept)" in cmd.stdout, cmd.stdout
        argv = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in cmd.seen}
        sims = [pid for pid, args in argv.items() if b"sim" in args]  # `python -m extproc sim --port ...`
        assert len(sims) == 1, argv
        os.kill(sims[0], signal.SIGKILL)
        rc = cmd.wait(timeout_s=60)
    cmd.assert_clean_exit(rc, 1, children_at_least=3)
    out = cmd.stdout + cmd.stderr
    assert "sim-0: exited while the stack was up" in out and "(exited with -9)" in out, out
    assert (logs / "sim-0.log").is_file() and (logs / "envoy.log").is_file()
