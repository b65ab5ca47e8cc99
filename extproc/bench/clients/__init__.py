"""The field's own benchmark clients (guidellm, inference-perf) driven against a bench stack.

Each runs from its own virtualenv, given by the path of its executable (guidellm needs torch,
inference-perf Python >= 3.12: neither belongs in the project's), offline (`HF_HUB_OFFLINE=1`,
the built-in Qwen3 tokenizer directory by local path), on the same requests as our load
generator, written in the trace format the client reads. `scripts/bench_clients.py` puts their
figures beside ours.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from extproc.bench.traces import TraceRequest

__all__ = ["ClientError", "offsets", "run_client", "tokenizer_dir"]


class ClientError(RuntimeError):
    """An external client failed, timed out or wrote no report (the message holds its output's tail)."""


def offsets(requests: Sequence[TraceRequest], stretch: float = 1.0) -> list[tuple[float, TraceRequest]]:
    """`(seconds after the first arrival × stretch, request)`, by arrival: a client's trace rows.

    `stretch` is 1 / the simulators' speed: the clients keep wall time.

    Raises:
        ValueError: no request, or `stretch` not > 0.
    """
    if not requests:
        raise ValueError("no request to write")
    if not stretch > 0:
        raise ValueError(f"stretch must be > 0, got {stretch}")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    return [((r.arrival_s - ordered[0].arrival_s) * stretch, r) for r in ordered]


def tokenizer_dir() -> Path:
    """The built-in Qwen3 tokenizer's directory (holds tokenizer.json), for the clients' local-path
    tokenizer options."""
    from extproc.models import builtin_tokenizer_dir

    return Path(builtin_tokenizer_dir("qwen3"))


def run_client(argv: list[str], *, workdir: Path, report: Path, timeout_s: float) -> Path:
    """Run an external client (`argv`) offline; its output goes to `workdir/<name>.log`.

    The environment drops our PYTHONPATH (the client has its own virtualenv) and points the
    hub at a closed local port, so nothing is downloaded.

    Returns:
        `report`, once the client exited 0 and wrote it.

    Raises:
        ClientError: a non-zero exit, a time-out, or no report.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "NO_COLOR": "1"}
    env.pop("PYTHONPATH", None)
    name = Path(argv[0]).name
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=workdir, check=False)
    except subprocess.TimeoutExpired:
        raise ClientError(f"{name} did not finish within {timeout_s:g} s") from None
    except OSError as exc:
        raise ClientError(f"{name} cannot run: {exc}") from None
    (workdir / f"{name}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0 or not report.exists():
        raise ClientError(f"{name} exited {done.returncode} without {report.name}: {(done.stdout + done.stderr)[-1500:]}")
    return report
