"""Fixtures for the bench tests: fixture trace paths and one prompt synthesizer per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.bench.prompts import PromptSynthesizer
from extproc.pipeline.tokens import TokenCounter

TRACES = Path(__file__).resolve().parents[1] / "testdata" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """tests/testdata/traces: tiny hand-written trace files, one per format."""
    return TRACES


@pytest.fixture(scope="session")
def synth(qwen_counter: TokenCounter) -> PromptSynthesizer:
    """A prompt synthesizer over the default tokenizer (its vocabulary vetted once)."""
    return PromptSynthesizer(qwen_counter)
