"""`llm-extproc serve` (placeholder until the server lands)."""

from __future__ import annotations

import typer


def serve(config: str = typer.Option("", help="YAML config")) -> None:
    """Run the ext_proc server."""
    raise typer.Exit(2)
