"""`llm-extproc sim` (placeholder until the simulator lands)."""

from __future__ import annotations

import typer


def sim(port: int = typer.Option(8000, help="listen port")) -> None:
    """Run the vLLM simulator."""
    raise typer.Exit(2)
