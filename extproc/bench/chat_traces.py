"""Readers for the two chat-text formats: ShareGPT conversations and MT-Bench questions.

Both carry real prompt text and no timestamps: arrivals are synthesized as a Poisson process
at `rate` requests/s (exponential gaps, first request at 0) from `seed`, in file order (the
turns of one conversation arrive in order, a mean gap apart). Token counts come from the real
tokenizer, chat template applied (`TokenCounter.count_chat`), as the engine will count them.

ShareGPT: each entry becomes one request per human turn that a gpt turn answers; the request's
messages are the conversation so far up to and including that human turn, and its output
length is the answer's length in tokens. Leading gpt messages (split segments of a longer
conversation) are dropped; a system message is kept only in first position.

MT-Bench: two requests per question; the second turn's history holds a synthesized answer to the
first of exactly `output_tokens` tokens (the file has no answers).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from extproc.bench.records import TraceFormatError, TraceRequest, iter_jsonl

if TYPE_CHECKING:
    from extproc.pipeline.tokens import TokenCounter

__all__ = ["poisson_arrivals", "read_mtbench", "read_sharegpt"]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
          "system": "system"}


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    """Arrival times (seconds) of a Poisson process at `rate` requests/s: 0, then exponential gaps."""
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        yield t
        t += float(rng.exponential(1.0 / rate))


def _default_counter(counter: TokenCounter | None) -> TokenCounter:
    if counter is not None:
        return counter
    from extproc.pipeline.tokens import TokenCounter

    return TokenCounter.from_source("builtin:qwen3")


def _sharegpt_entries(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, entry) pairs from a JSON array or a JSONL file; `where` names entry or line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceFormatError(path, f"cannot read: {exc.strerror or exc}") from None
    if data.lstrip()[:1] != b"[":
        for number, entry in iter_jsonl(path):
            yield f"line {number}", entry
        return
    try:
        entries = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise TraceFormatError(path, f"invalid JSON: {exc.msg}", line=exc.lineno) from None
    for i, entry in enumerate(entries):
        yield f"entry {i}", entry


def _conversation(path: Path, where: str, entry: Any) -> list[dict[str, str]]:
    """The entry's messages in OpenAI roles, or raise naming the entry."""
    conversations = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(conversations, list):
        raise TraceFormatError(path, f"{where}: expected an object with a 'conversations' list")
    messages = []
    for k, message in enumerate(conversations):
        if not isinstance(message, dict) or not isinstance(message.get("value"), str):
            raise TraceFormatError(path, f"{where}: message {k} needs a string 'value'")
        role = _ROLES.get(str(message.get("from", "")).lower())
        if role is None:
            raise TraceFormatError(path, f"{where}: message {k} has unknown 'from' {message.get('from')!r}")
        messages.append({"role": role, "content": message["value"]})
    return messages


def read_sharegpt(
    path: str | Path,
    skipped: Counter | None = None,
    *,
    counter: TokenCounter | None = None,
    rate: float = 1.0,
    seed: int = 0,
) -> Iterator[TraceRequest]:
    """Read ShareGPT conversations (JSON array or JSONL) into chat requests.

    Skipped (counted): `empty_conversation` (no human turn answered by gpt),
    `zero_output_tokens` (an empty answer).

    Raises:
        TraceFormatError: invalid JSON, an entry without a `conversations` list, a message
            without a string `value`, or an unknown `from`.
    """
    path = Path(path)
    skipped = Counter() if skipped is None else skipped
    counter = _default_counter(counter)
    arrivals = poisson_arrivals(rate, seed)
    for where, entry in _sharegpt_entries(path):
        messages = _conversation(path, where, entry)
        while messages and messages[0]["role"] == "assistant":
            messages.pop(0)
        messages = [m for i, m in enumerate(messages) if m["role"] != "system" or i == 0]
        session = str(entry.get("id")) if entry.get("id") is not None else where
        produced = False
        for i, message in enumerate(messages[:-1]):
            answer = messages[i + 1]
            if message["role"] != "user" or answer["role"] != "assistant":
                continue
            produced = True
            output_tokens = len(counter.encode(answer["content"]))
            if output_tokens == 0:
                skipped["zero_output_tokens"] += 1
                continue
            history = messages[: i + 1]
            yield TraceRequest(
                arrival_s=next(arrivals),
                input_tokens=counter.count_chat(history).count,
                output_tokens=output_tokens,
                session=session,
                messages=history,
            )
        if not produced:
            skipped["empty_conversation"] += 1


def read_mtbench(
    path: str | Path,
    skipped: Counter | None = None,
    *,
    counter: TokenCounter | None = None,
    rate: float = 1.0,
    seed: int = 0,
    output_tokens: int = 256,
) -> Iterator[TraceRequest]:
    """Read MT-Bench `question.jsonl`: one request per turn, `output_tokens` each.

    Raises:
        TraceFormatError: a line that is not JSON, or lacks `question_id` / a list of string `turns`.
        ValueError: `output_tokens` < 1.
    """
    from extproc.bench.prompts import PromptSynthesizer

    if output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    path = Path(path)
    skipped = Counter() if skipped is None else skipped
    counter = _default_counter(counter)
    synthesizer = PromptSynthesizer(counter)
    arrivals = poisson_arrivals(rate, seed)
    for number, row in iter_jsonl(path):
        row = row if isinstance(row, dict) else {}
        turns = row.get("turns")
        if "question_id" not in row or not (
            isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)
        ):
            raise TraceFormatError(path, "expected 'question_id' and a non-empty list of string 'turns'", line=number)
        session = f"mtbench-{row['question_id']}"
        history: list[dict[str, Any]] = []
        for k, turn in enumerate(turns):
            if k:
                answer = synthesizer.stream_text(f"mtbench-answer:{row['question_id']}:{k}", output_tokens)
                history.append({"role": "assistant", "content": answer})
            history.append({"role": "user", "content": turn})
            messages = list(history)
            yield TraceRequest(
                arrival_s=next(arrivals),
                input_tokens=counter.count_chat(messages).count,
                output_tokens=output_tokens,
                session=session,
                messages=messages,
            )
