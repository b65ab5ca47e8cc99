""""Keep head + tail" truncation of over-long prompts (DESIGN section 9 item 5).

The design notes' rule (their `truncate_by_tail`): keep a prefix of `min(512, len // 4)` tokens
(the system prompt and the task statement) and fill the rest of the budget from the tail (the
latest turns), dropping the middle of the history. They report it loses less quality than
uniform truncation on long-tailed production prompts.

One guard the notes lack: their formula asks for a negative tail when `max_len` is below the
prefix (e.g. 1,000 tokens cut to 100 wants a 250-token prefix), so the prefix is also capped at
half of `max_len` and the latest turn keeps at least half the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["HEAD_TOKENS", "head_tail_split", "truncate_head_tail"]

HEAD_TOKENS = 512
"""Largest prefix kept (tokens), from the design notes."""

T = TypeVar("T")


def head_tail_split(length: int, max_len: int) -> tuple[int, int]:
    """How many leading and trailing tokens a prompt of `length` tokens keeps under `max_len`.

    Returns:
        `(head, tail)` in tokens; `(length, 0)` when it already fits.

    Raises:
        ValueError: `length` < 0 or `max_len` < 1.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1 token, got {max_len}")
    if length <= max_len:
        return length, 0
    head = min(HEAD_TOKENS, length // 4, max_len // 2)
    return head, max_len - head


def truncate_head_tail(tokens: Sequence[T], max_len: int) -> list[T]:
    """Cut `tokens` to at most `max_len` by keeping its head and its tail.

    Args:
        tokens: a tokenized prompt (any sequence).
        max_len: the budget (tokens, >= 1).

    Returns:
        a new list: `tokens` itself when it fits, else head + tail (exactly `max_len` items).

    Raises:
        ValueError: `max_len` < 1.
    """
    head, tail = head_tail_split(len(tokens), max_len)
    if tail == 0:
        return list(tokens[:head])
    return list(tokens[:head]) + list(tokens[len(tokens) - tail :])
