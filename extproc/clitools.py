"""Small pieces every long-running subcommand shares (serve, sim, agent)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Any

import typer
from typer.core import TyperCommand

__all__ = ["LOG_LEVELS", "FILE", "FileMetavarCommand", "fail", "setup_logging", "skip_final_collection", "stop_on_signals"]

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
FILE = "FILE"  # --help's placeholder for a file argument; pass as `metavar=` to a `str` option


class FileMetavarCommand(TyperCommand):
    """Every command's class (`extproc/cli.py`): `--help` shows a file argument as `FILE`, not
    typer's type label (`<path>`, `<str>`). `pathlib.Path` parameters get it here; a `str`
    option that names a file says `metavar=FILE` itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            described = getattr(param, "type_descriptor", None)  # typer's own parameter classes
            is_path = described is not None and described.is_path
            if param.param_type_name == "option" and param.metavar is None and is_path:
                param.metavar = FILE


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `error: <message>` to stderr and return the `typer.Exit` to raise: 2 for bad
    options or configuration (nothing was started), 1 for a failure at start-up."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def setup_logging(level: str) -> None:
    """Log to stderr at `level` (one of LOG_LEVELS, any case).

    Raises:
        typer.Exit: (2) an unknown level, after saying which ones exist.
    """
    if level.lower() not in LOG_LEVELS:
        raise fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    from extproc.config.loader import worker_index  # not at the top: `--help` loads no configuration schema

    worker = worker_index()  # `serve --workers`: say which worker speaks
    who = f"[worker {worker}] " if worker is not None else ""
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")


def skip_final_collection() -> None:
    """Call when a long-running command has closed everything and is about to return: freezes
    every live object (`gc.freeze`) so the interpreter's last collection at exit does not walk
    them. Nothing is left to finalise by then (files flushed, sockets closed); the walk over the
    tokenizer's vocabularies and the loaded modules was what made an idle `serve` take 0.5–1.5 s
    (1.9 s on a loaded machine) to exit after SIGTERM; frozen, about 0.1 s."""
    gc.freeze()


def stop_on_signals() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (handlers installed on the running loop, so
    call this before starting anything: a signal during start-up then stops cleanly after it)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
