"""The static source's reload: a reload that adds endpoints says, in a WARNING, that Envoy's
fallback cluster does not have them and which command regenerates it."""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from extproc.config.loader import load_config
from extproc.discovery.base import SourceContext
from extproc.discovery.static import Params, Source

MODEL = "Qwen/Qwen3-8B"  # a built-in: its tokenizer and architecture need no files


def write(path: Path, addresses: list[str]) -> None:
    path.write_text(yaml.safe_dump({"models": [{"name": MODEL}], "endpoints": [{"address": a, "models": [MODEL]} for a in addresses]}))


async def test_a_reload_that_adds_endpoints_names_the_command_that_regenerates_envoys_fallback(tmp_path: Path, caplog):
    path = tmp_path / "llm-extproc.yaml"
    write(path, ["10.0.0.1:8000"])
    source = Source(Params(), SourceContext(load_config(path), path))
    write(path, ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"])
    with caplog.at_level(logging.INFO, logger="extproc.discovery.static"):
        assert [e.address for e in await source._reload("SIGHUP")] == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert "2 endpoint(s) added (10.0.0.2:8000, 10.0.0.3:8000)" in text and "fallback cluster" in text
    assert f"llm-extproc envoy-config --config {path}" in text
    caplog.clear()
    write(path, ["10.0.0.3:8000", "10.0.0.2:8000", "10.0.0.1:8000"])  # none new: nothing for Envoy to learn
    with caplog.at_level(logging.INFO, logger="extproc.discovery.static"):
        await source._reload("SIGHUP")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
