"""The `llm-extproc` command: serve | check-config | envoy-config | agent | sim | pd-sidecar | demo | up | bench | load | analyze.

Each subcommand's options live beside its implementation; heavy imports happen inside the
command bodies so `llm-extproc --help` stays fast.
"""

from __future__ import annotations

import typer

from extproc.agent.cli import agent
from extproc.bench.cli import analyze, bench, demo, up
from extproc.bench.load_cli import load
from extproc.clitools import FileMetavarCommand
from extproc.server.cli import check_config, envoy_config, serve
from extproc.pd.cli import pd_sidecar
from extproc.sim.cli import sim

__all__ = ["app", "main"]

app = typer.Typer(
    name="llm-extproc",
    help="LLM-inference-aware load balancing for vLLM fleets behind Envoy (ext_proc).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: wraps to the terminal (80 columns stay readable), shows a flag as a
    # flag (no `<bool>` type column) and numbers and defaults in full.
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"llm-extproc {version('llm-extproc')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
) -> None:
    """LLM-inference-aware load balancing for vLLM fleets behind Envoy (ext_proc)."""


for _name, _command in [
    ("serve", serve),
    ("check-config", check_config),
    ("envoy-config", envoy_config),
    ("sim", sim),
    ("pd-sidecar", pd_sidecar),
    ("agent", agent),
    ("demo", demo),
    ("up", up),
    ("bench", bench),
    ("load", load),
    ("analyze", analyze),
]:
    app.command(_name, cls=FileMetavarCommand)(_command)


def main() -> None:
    """Console-script entry point."""
    app()
