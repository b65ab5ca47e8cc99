"""Where the members of a JSON object and the items of a JSON array sit in the body's text.

Rewriting a request body (an alias's model name, a truncated prompt) must change only the
values that change: numbers, escapes, spacing and fields we do not know reach the engine as the
client wrote them. These helpers find the character spans of values so a caller can splice
new text in between untouched slices. Values are skipped with the standard library's C
scanner (`json.JSONDecoder.raw_decode`), which also checks them.
"""

from __future__ import annotations

import json

__all__ = ["array_items", "object_members", "skip_ws"]

_DECODER = json.JSONDecoder()


def skip_ws(text: str, i: int) -> int:
    """The first index at or after `i` that is not JSON whitespace."""
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def object_members(text: str, start: int = 0) -> tuple[list[tuple[str, int, int]], int]:
    """The members of the JSON object at `text[start]` (whitespace before it allowed).

    Returns:
        `([(key, value_start, value_end), ...] in document order, index after the closing brace)`;
        a key sent twice appears twice (a JSON parser keeps the last).

    Raises:
        ValueError: not a well-formed JSON object there (`json.JSONDecodeError` is a ValueError).
    """
    i = skip_ws(text, start)
    if text[i : i + 1] != "{":
        raise ValueError("not a JSON object")
    i = skip_ws(text, i + 1)
    out: list[tuple[str, int, int]] = []
    while text[i : i + 1] != "}":
        if text[i : i + 1] != '"':
            raise ValueError("malformed JSON object")
        key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
        i = skip_ws(text, i)
        if text[i : i + 1] != ":":
            raise ValueError("malformed JSON object")
        value_start = skip_ws(text, i + 1)
        _, value_end = _DECODER.raw_decode(text, value_start)
        out.append((key, value_start, value_end))
        i = skip_ws(text, value_end)
        if text[i : i + 1] == ",":
            i = skip_ws(text, i + 1)
        elif text[i : i + 1] != "}":
            raise ValueError("malformed JSON object")
    return out, i + 1


def array_items(text: str, start: int) -> tuple[list[tuple[int, int]], int]:
    """The items of the JSON array at `text[start]` (whitespace before it allowed).

    Returns:
        `([(item_start, item_end), ...], index after the closing bracket)`.

    Raises:
        ValueError: not a well-formed JSON array there.
    """
    i = skip_ws(text, start)
    if text[i : i + 1] != "[":
        raise ValueError("not a JSON array")
    i = skip_ws(text, i + 1)
    out: list[tuple[int, int]] = []
    while text[i : i + 1] != "]":
        _, end = _DECODER.raw_decode(text, i)
        out.append((i, end))
        i = skip_ws(text, end)
        if text[i : i + 1] == ",":
            i = skip_ws(text, i + 1)
        elif text[i : i + 1] != "]":
            raise ValueError("malformed JSON array")
    return out, i + 1
