"""The `llm-extproc` command as a newcomer first meets it: `--version`, and `--help` of every
command readable in an 80-column terminal (no cut numbers or defaults, no `<bool>` type noise)."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from extproc.cli import app

COMMANDS = ["", "serve", "check-config", "envoy-config", "sim", "agent", "demo", "up", "bench", "load", "analyze"]


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"llm-extproc {version('llm-extproc')}"


@pytest.mark.parametrize("command", COMMANDS, ids=[c or "top" for c in COMMANDS])
def test_help_fits_80_columns_without_type_noise(command: str):
    result = CliRunner().invoke(app, [*command.split(), "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "<bool>" not in result.output
    assert "…" not in result.output  # nothing cut short


def test_bench_help_lists_each_policy_unbroken_at_80_columns():
    from extproc.bench.policies import POLICIES

    result = CliRunner().invoke(app, ["bench", "--help"], terminal_width=80, env={"COLUMNS": "80"})
    for name in POLICIES:
        assert f"  {name}: " in result.output  # one per line, never cut at a hyphen


@pytest.mark.parametrize(
    ("command", "option"),
    [("serve", "--config"), ("envoy-config", "--config"), ("envoy-config", "--output"), ("bench", "--trace"),
     ("bench", "--extproc-config"), ("analyze", "--json")],
)
def test_file_options_show_file_not_a_type_label(command: str, option: str):
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert f"{option} FILE" in result.output
    options = [line for line in result.output.splitlines() if line.lstrip().startswith("-")]
    assert not [line for line in options if "<path>" in line]
