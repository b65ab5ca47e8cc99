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

__all__ = ["WINDOW", "check_json_values", "count_values", "too_many_values", "values_bound"]

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


def count_values(body: bytes, stop_above: int) -> int:
    """The number of JSON values in `body`, or — as soon as it is known to exceed
    `stop_above` — some number above `stop_above` (the count so far).

    Args:
        body: a JSON text (bytes). Exact for valid JSON; for invalid JSON the result is
            some finite number (parsing then refuses the body anyway).
        stop_above: stop counting once the count passes this (values).

    Escapes: a backslash inside a string always starts a two-byte escape (`\\\\`, `\\"`, `\\n`,
    `\\uXXXX`...), so deleting `\\\\` and then `\\"` pairs, left to right, leaves exactly the
    quotes that open and close strings. Windows never end inside a run of backslashes, so an
    escape is never cut in two.
    """
    count = 1
    inside = False  # the previous window ended inside a string
    last = b""  # the last structural byte seen, to spot `[` `]` split across windows
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
        # Pieces alternate outside/inside strings; each string becomes one `s` byte (so `["a"]`
        # keeps a member), marked at its opening quote (a string still open at the window's
        # end is marked here, not again in the next window).
        out = b"s".join(pieces[inside::2])
        inside = (len(pieces) - 1 + inside) % 2 == 1
        if inside:
            out += b"s"
        out = out.translate(None, _WS)
        if not out:
            continue
        count += out.count(b",") + out.count(b"[") + out.count(b"{") - out.count(b"[]") - out.count(b"{}")
        if (last == b"[" and out[:1] == b"]") or (last == b"{" and out[:1] == b"}"):
            count -= 1
        last = out[-1:]
        # An opening bracket at the window's end may be closed at the next one's start (one
        # value fewer), so stop only past that.
        if count - (last == b"[" or last == b"{") > stop_above:
            return count
    return count


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
