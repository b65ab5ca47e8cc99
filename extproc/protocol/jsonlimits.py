"""How many JSON values a request body holds, counted from its bytes before it is parsed.

A body under `limits.max_body_bytes` can still be a million tiny values (`"x": [[],[],...]` in a
message, a content list of a million parts, tool schemas with huge `properties`): decoding,
validating and walking them costs 0.3–1.5 µs per value (measured), seconds of event-loop CPU
for one 4 MiB body. The limit (`limits.max_json_values`) is therefore decided on the bytes:

* `values_bound` — an upper bound at C speed (one `bytes.translate`, ~1 ns per byte: ~4 ms
  for 4 MiB, microseconds for a usual request); a body under the limit this way pays nothing
  more.
* `count_values` — the exact count, string-aware, in windows of WINDOW bytes with C-speed
  bytes operations per window, stopping at the first window past the limit: a refusal costs a
  few milliseconds whatever the body size; a legitimate body full of commas inside its strings
  (code in a prompt) is counted whole, ~5–12 ns per byte (20–50 ms for 4 MiB, a body of backslash escapes the slowest; the pipeline runs
  that off the event loop). Only this exact count refuses.

A JSON value is an object, an array, a string, a number, `true`, `false` or `null`; object keys
are not values (each belongs to one). For valid JSON, values = 1 + commas + non-empty containers,
outside strings: each comma separates two members, and a non-empty container's first member
has no comma before it.
"""

from __future__ import annotations

import re

from extproc.errors import ValidationError

__all__ = [
    "MAX_JSON_DEPTH", "WINDOW", "check_json_depth", "check_json_shape", "check_json_values", "count_values", "json_depth",
    "opening_brackets", "too_many_values", "values_bound",
]  # fmt: skip

WINDOW = 64 * 1024
"""Bytes counted per step of `count_values` (~0.3 ms of C-speed work; the count stops at the
first window past the limit, and a thread running it yields the GIL between windows)."""

_WS = b" \t\r\n"
_BACKSLASHES = re.compile(rb"\\*")


def values_bound(body: bytes) -> int:
    """An upper bound on the number of JSON values in `body` (any bytes).

    For valid JSON, values = 1 + commas + non-empty containers ≤ 1 + every `,` `[` `{` byte
    (strings not skipped); and a value takes at least one byte plus one separating it from the
    next, so values ≤ (len + 1) // 2. The smaller of the two; never below the real count.
    """
    return min((len(body) + 1) // 2, 1 + len(body) - len(body.translate(None, b",[{")))


def _outside_strings(body: bytes):
    """`body`'s bytes outside JSON strings, window by window (`WINDOW` bytes of input each), each
    string replaced by one `s` byte (marked at its opening quote) and whitespace removed.

    Escapes: a backslash inside a string always starts a two-byte escape (`\\\\`, `\\"`, `\\n`,
    `\\uXXXX`...), so deleting `\\\\` and then `\\"` pairs, left to right, leaves exactly the
    quotes that open and close strings. Windows never end inside a run of backslashes, so an
    escape is never cut in two.
    """
    inside = False  # the previous window ended inside a string
    start, size = 0, len(body)
    while start < size:
        end = min(start + WINDOW, size)
        if end < size and body[end - 1] == 0x5C:  # never end inside a run of backslashes
            end = min(_BACKSLASHES.match(body, end).end() + 1, size)  # type: ignore[union-attr]
        chunk = body[start:end]
        start = end
        if b"\\" in chunk:
            chunk = chunk.replace(b"\\\\", b"").replace(b'\\"', b"")
        pieces = chunk.split(b'"')
        # Pieces alternate outside/inside strings; a string still open at the window's end is
        # marked here, not again in the next window.
        out = b"s".join(pieces[inside::2])
        inside = (len(pieces) - 1 + inside) % 2 == 1
        if inside:
            out += b"s"
        out = out.translate(None, _WS)
        if out:
            yield out


def count_values(body: bytes, stop_above: int) -> int:
    """The number of JSON values in `body`, or — as soon as it is known to exceed
    `stop_above` — some number above `stop_above` (the count so far).

    Args:
        body: a JSON text (bytes). Exact for valid JSON; for invalid JSON the result is
            some finite number (parsing then refuses the body anyway).
        stop_above: stop counting once the count passes this (values).

    Strings are skipped by `_outside_strings` (one `s` byte each, so `["a"]` keeps a member).
    """
    count = 1
    last = b""  # the last structural byte seen, to spot `[` `]` split across windows
    for out in _outside_strings(body):
        count += out.count(b",") + out.count(b"[") + out.count(b"{") - out.count(b"[]") - out.count(b"{}")
        if (last == b"[" and out[:1] == b"]") or (last == b"{" and out[:1] == b"}"):
            count -= 1
        last = out[-1:]
        # An opening bracket at the window's end may be closed at the next one's start (one
        # value fewer), so stop only past that.
        if count - (last == b"[" or last == b"{") > stop_above:
            return count
    return count


MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects a request body may have (levels; the top-level object
is 1). orjson refuses past 1,024, but the paths that re-read an accepted body (an alias's
`with_model`, truncation's spans: `extproc.protocol.jsonspans`) use the standard library's
recursive scanner, which hit Python's recursion limit near 1,000 levels (a 500 and a traceback
per request, after the endpoint was picked). Tool schemas, the deepest legitimate requests,
nest a few dozen levels at most."""

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8


def opening_brackets(body: bytes) -> int:
    """`[` and `{` bytes in `body`, strings not skipped: a bound on its depth (~1 ns per byte)."""
    return len(body) - len(body.translate(None, b"[{"))


def json_depth(body: bytes, stop_above: int = MAX_JSON_DEPTH) -> int:
    """The deepest nesting of arrays and objects in `body` (levels; a scalar is 0); only its
    side of `stop_above` is exact: past it, some depth above `stop_above`; when `body` holds no
    more opening brackets than `stop_above`, that count (a bound, not the depth).

    Free when `body` holds no more opening brackets than `stop_above` (one `bytes.translate`);
    else string-aware, window by window, the running depth summed by numpy (C speed).
    """
    import numpy as np

    opening = opening_brackets(body)
    if opening <= stop_above:
        return opening
    depth = deepest = 0
    for out in _outside_strings(body):
        steps = out.translate(None, _NOT_BRACKETS).translate(_DEPTH_STEP)
        if not steps:
            continue
        running = np.cumsum(np.frombuffer(steps, dtype=np.int8), dtype=np.int64) + depth
        deepest = max(deepest, int(running.max()))
        depth = int(running[-1])
        if deepest > stop_above:
            break
    return deepest


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse `body` when its arrays and objects nest deeper than `limit` levels.

    Raises:
        ValidationError: code `json_too_deep`, the limit named in the message (a 400).
    """
    if json_depth(body, limit) > limit:
        raise ValidationError(
            f"request body nests JSON arrays and objects more than {limit} levels deep; at most {limit} are accepted",
            code="json_too_deep",
        )


def too_many_values(limit: int) -> ValidationError:
    """The 400 for a body over `limits.max_json_values` (`limit` values)."""
    return ValidationError(
        f"request body has more than {limit} JSON values; at most {limit} are accepted (limits.max_json_values)",
        code="too_many_json_values",
    )


def check_json_values(body: bytes, limit: int) -> None:
    """Refuse `body` when it holds more than `limit` JSON values: the cheap bound first, the
    exact count (stopping past the limit) only when the bound is over it.

    Raises:
        ValidationError: code `too_many_json_values`, the limit named in the message.
    """
    # A body of at most 2 × limit bytes cannot hold more values: most requests stop here,
    # before the bound's copy of the body.
    if (len(body) + 1) // 2 <= limit:
        return
    if values_bound(body) > limit and count_values(body, limit) > limit:
        raise too_many_values(limit)


def check_json_shape(body: bytes, max_values: int, max_depth: int = MAX_JSON_DEPTH) -> None:
    """`check_json_values` then `check_json_depth` (what a worker thread runs for a large body).

    Raises:
        ValidationError: over either limit (a 400).
    """
    check_json_values(body, max_values)
    check_json_depth(body, max_depth)
