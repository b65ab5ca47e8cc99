"""The record every trace reader yields, its format error, and the JSONL line reader they share.

Below every reader (`traces`, `chat_traces`, `decisions`), so none of them imports another to
get these: `traces.load_trace` dispatches to the others, and the decision log's reader is the
benchmark side's, not the runtime telemetry's (extproc.telemetry never imports extproc.bench).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = ["TraceFormatError", "TraceRequest", "iter_jsonl", "text_lines"]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload, whatever its source.

    Attributes:
        arrival_s: arrival time relative to the start of the trace (seconds, trace time).
        input_tokens: prompt length the engine prefills, chat template included (tokens).
        output_tokens: tokens to generate (tokens, >= 1).
        prefix_blocks: ids of the prompt's 512-token blocks; requests sharing leading ids share
            that prefix (Mooncake `hash_ids`; the synthetic workload uses the same scheme), or None.
        session: conversation id when the source has one (BurstGPT_3, ShareGPT, MT-Bench,
            synthetic sessions), else None.
        messages: the real chat messages (OpenAI shape) when the source has text, else None.
        refused: True for a decision-log request llm-extproc refused (`outcome: rejected`): it
            was offered, so it counts in input lengths and arrivals, but nothing was generated,
            so `analyze` leaves its output budget out.
        model: the `model` to send (a LoRA adapter's name, `extproc.bench.lora_workload`), or
            None for the load generator's model.
    """

    arrival_s: float
    input_tokens: int
    output_tokens: int
    prefix_blocks: tuple[int, ...] | None = None
    session: str | None = None
    messages: list[dict[str, Any]] | None = None
    refused: bool = False
    model: str | None = None


class TraceFormatError(ValueError):
    """A trace file is unreadable, of an unknown format, or has a malformed row.

    The message starts with `path:line:` (or `path:` when no line applies).
    """

    def __init__(self, path: str | Path, message: str, *, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path = Path(path)
        self.line = line


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """`(line number, line)` of a UTF-8 text file (a BOM is dropped).

    Raises:
        TraceFormatError: unreadable or not UTF-8.
    """
    try:
        with path.open("r", encoding="utf-8-sig") as fh:
            for number, line in enumerate(fh, start=1):
                yield number, line
    except UnicodeDecodeError as exc:
        raise TraceFormatError(path, f"not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise TraceFormatError(path, f"cannot read: {exc.strerror or exc}") from None


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """`(line number, value)` for every non-blank line of a JSONL file.

    Raises:
        TraceFormatError: unreadable, not UTF-8, or a line that is not JSON (names the line).
    """
    for number, line in text_lines(path):
        if not line.strip():
            continue
        try:
            yield number, orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise TraceFormatError(path, f"invalid JSON: {exc.msg}", line=number) from None
