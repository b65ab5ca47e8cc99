"""Trace readers: one record type (`TraceRequest`) from every trace format we replay.

Formats (public sources listed at the top of docs/benchmarks.md):

| format     | file                          | arrivals                         | prefix info            |
|------------|-------------------------------|----------------------------------|------------------------|
| `mooncake` | JSONL `timestamp` (ms), `input_length`, `output_length`, `hash_ids` | from the trace | `hash_ids`, 512-token blocks |
| `azure`    | CSV `TIMESTAMP` (wall clock, 7 fractional digits), `ContextTokens`, `GeneratedTokens` | from the trace | none |
| `burstgpt` | CSV BurstGPT_1 (`Timestamp`, `Model`, `Request tokens`, ...) or BurstGPT_3 (adds `Session ID`, `Elapsed time`) | from the trace (s) | session (BurstGPT_3) |
| `sharegpt` | JSON array (or JSONL) of `{"id", "conversations": [{"from", "value"}]}` | Poisson, synthesized | real text |
| `mtbench`  | JSONL `{"question_id", "category", "turns": [t1, t2]}` | Poisson, synthesized | real text |
| `decisions` | llm-extproc's own decision log (JSONL, `decision_log.path`): `time`, `prompt_tokens`, `output_budget`, ... | from the log | none |

The two chat formats (real text, token counts from the real tokenizer) live in
`extproc.bench.chat_traces`; `load_trace` dispatches to them.

The format is detected from the file's content (`detect_format`), not from its name. A row that
cannot be read raises `TraceFormatError` naming the file and line; rows that are well formed but
unusable for a replay (a failed request with 0 tokens, nothing to generate) are skipped and
counted in `Trace.skipped` by reason.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from extproc.bench.records import TraceFormatError, TraceRequest, iter_jsonl, text_lines

if TYPE_CHECKING:
    from extproc.pipeline.tokens import TokenCounter

__all__ = [
    "FORMATS",
    "MOONCAKE_BLOCK_TOKENS",
    "Trace",
    "TraceFormatError",
    "TraceRequest",
    "detect_format",
    "iter_jsonl",
    "load_trace",
    "read_azure",
    "read_burstgpt",
    "read_mooncake",
]

FORMATS = ("mooncake", "azure", "burstgpt", "sharegpt", "mtbench", "decisions")
MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake `hash_ids` block (Mooncake FAST'25 release README)."""

_SNIFF_BYTES = 64 * 1024


@dataclass(slots=True)
class Trace:
    """A loaded trace.

    Attributes:
        path: the file read.
        format: one of `FORMATS`.
        requests: the requests, sorted by `arrival_s`.
        skipped: rows skipped, by reason (e.g. `{"zero_tokens": 17}`).
        synthesized_arrivals: True when arrival times were generated (Poisson), not read.
    """

    path: Path
    format: str
    requests: list[TraceRequest]
    skipped: dict[str, int] = field(default_factory=dict)
    synthesized_arrivals: bool = False


# --------------------------------------------------------------------------- detection


def detect_format(path: str | Path) -> str:
    """Name the format of a trace file from its first bytes (not its extension).

    Returns:
        one of `FORMATS`.

    Raises:
        TraceFormatError: unreadable, empty, or no known format.
    """
    path = Path(path)
    try:
        with path.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError as exc:
        raise TraceFormatError(path, f"cannot read: {exc.strerror or exc}") from None
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    stripped = text.lstrip()
    if not stripped:
        raise TraceFormatError(path, "empty file")
    if stripped[0] == "[":
        if '"conversations"' in stripped:
            return "sharegpt"
        raise TraceFormatError(path, "a JSON array without ShareGPT 'conversations' entries: unknown format")
    first_line = stripped.splitlines()[0]
    if stripped[0] == "{":
        try:
            obj = orjson.loads(first_line)
        except orjson.JSONDecodeError:
            raise TraceFormatError(path, "first line is not one JSON object (JSONL expected)", line=1) from None
        keys = set(obj) if isinstance(obj, dict) else set()
        if {"timestamp", "input_length", "output_length"} <= keys:
            return "mooncake"
        if {"question_id", "turns"} <= keys:
            return "mtbench"
        if "conversations" in keys:
            return "sharegpt"
        from extproc.telemetry.decision_log import DETECT_KEYS

        if DETECT_KEYS <= keys:
            return "decisions"
        raise TraceFormatError(path, f"JSONL with unknown keys {sorted(keys)}: unknown format", line=1)
    header = {h.strip() for h in next(csv.reader([first_line]))}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
        return "azure"
    if {"Timestamp", "Request tokens", "Response tokens"} <= header:
        return "burstgpt"
    raise TraceFormatError(
        path, f"unknown format (first line {first_line[:80]!r}); expected one of {', '.join(FORMATS)}", line=1
    )


# --------------------------------------------------------------------------- readers


def _int_field(path: Path, line: int, row: dict[str, Any], key: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TraceFormatError(path, f"{key!r} missing or not a number", line=line)
    try:
        number = float(value)
    except ValueError:
        raise TraceFormatError(path, f"{key!r} is not a number: {value!r}", line=line) from None
    if not math.isfinite(number) or number < 0 or number != int(number):
        raise TraceFormatError(path, f"{key!r} must be a non-negative integer, got {value!r}", line=line)
    return int(number)


def _float_field(path: Path, line: int, row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceFormatError(path, f"{key!r} missing or not a number: {value!r}", line=line) from None
    if not math.isfinite(number) or number < 0:
        raise TraceFormatError(path, f"{key!r} must be a finite non-negative number, got {value!r}", line=line)
    return number


def _usable(skipped: Counter, input_tokens: int, output_tokens: int) -> bool:
    """Count and drop rows a replay cannot send (a failed request, nothing to generate)."""
    if input_tokens == 0 and output_tokens == 0:
        skipped["zero_tokens"] += 1
    elif input_tokens == 0:
        skipped["zero_input_tokens"] += 1
    elif output_tokens == 0:
        skipped["zero_output_tokens"] += 1
    else:
        return True
    return False


def read_mooncake(path: str | Path, skipped: Counter | None = None) -> Iterator[TraceRequest]:
    """Read a Mooncake FAST'25 JSONL trace (`timestamp` in ms, `hash_ids` of 512-token blocks).

    Arrival times are the trace's (converted to seconds), not yet rebased.

    Raises:
        TraceFormatError: a line is not a JSON object or a field is missing or invalid.
    """
    path = Path(path)
    skipped = Counter() if skipped is None else skipped
    for number, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise TraceFormatError(path, "expected a JSON object", line=number)
        timestamp_ms = _float_field(path, number, row, "timestamp")
        input_tokens = _int_field(path, number, row, "input_length")
        output_tokens = _int_field(path, number, row, "output_length")
        hash_ids = row.get("hash_ids")
        if hash_ids is not None and (
            not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids)
        ):
            raise TraceFormatError(path, "'hash_ids' must be a list of integers", line=number)
        if _usable(skipped, input_tokens, output_tokens):
            yield TraceRequest(
                arrival_s=timestamp_ms / 1000.0,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                prefix_blocks=tuple(hash_ids) if hash_ids else None,
            )


def _csv_rows(path: Path, required: set[str]) -> Iterator[tuple[int, dict[str, str]]]:
    """CSV rows as dicts keyed by the stripped header; checks the header has `required`."""
    lines = text_lines(path)
    header_line: tuple[int, str] | None = None
    for number, line in lines:
        if line.strip():
            header_line = (number, line)
            break
    if header_line is None:
        raise TraceFormatError(path, "empty file")
    header = [h.strip() for h in next(csv.reader([header_line[1]]))]
    missing = required - set(header)
    if missing:
        raise TraceFormatError(path, f"CSV header lacks {sorted(missing)} (has {header})", line=header_line[0])
    for number, line in lines:
        if not line.strip():
            continue
        try:
            values = next(csv.reader(io.StringIO(line)))
        except csv.Error as exc:
            raise TraceFormatError(path, f"invalid CSV: {exc}", line=number) from None
        if len(values) != len(header):
            raise TraceFormatError(path, f"expected {len(header)} columns, found {len(values)}", line=number)
        yield number, {h: v.strip() for h, v in zip(header, values)}


def _parse_wall_clock(path: Path, line: int, text: str) -> float:
    """`2023-11-16 18:17:03.9799600` → seconds since the epoch, naive, all 7 fractional digits kept."""
    base, _, frac = text.partition(".")
    try:
        whole = datetime.fromisoformat(base)
        fraction = int(frac) / 10 ** len(frac) if frac else 0.0
    except ValueError:
        raise TraceFormatError(path, f"TIMESTAMP is not 'YYYY-MM-DD HH:MM:SS[.fffffff]': {text!r}", line=line) from None
    return (whole - datetime(1970, 1, 1, tzinfo=whole.tzinfo)).total_seconds() + fraction


def read_azure(path: str | Path, skipped: Counter | None = None) -> Iterator[TraceRequest]:
    """Read an Azure LLM inference 2023 CSV (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`).

    Raises:
        TraceFormatError: header or row malformed.
    """
    path = Path(path)
    skipped = Counter() if skipped is None else skipped
    for number, row in _csv_rows(path, {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}):
        arrival = _parse_wall_clock(path, number, row["TIMESTAMP"])
        input_tokens = _int_field(path, number, row, "ContextTokens")
        output_tokens = _int_field(path, number, row, "GeneratedTokens")
        if _usable(skipped, input_tokens, output_tokens):
            yield TraceRequest(arrival_s=arrival, input_tokens=input_tokens, output_tokens=output_tokens)


def read_burstgpt(path: str | Path, skipped: Counter | None = None) -> Iterator[TraceRequest]:
    """Read a BurstGPT CSV, either layout.

    BurstGPT_1: `Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type`;
    BurstGPT_3 inserts `Session ID, Elapsed time` after `Timestamp` (columns are read by name).
    `Timestamp` is in seconds. Failed requests (0 request and 0 response tokens) are skipped and
    counted as `zero_tokens`.

    Raises:
        TraceFormatError: header or row malformed.
    """
    path = Path(path)
    skipped = Counter() if skipped is None else skipped
    for number, row in _csv_rows(path, {"Timestamp", "Request tokens", "Response tokens"}):
        arrival = _float_field(path, number, row, "Timestamp")
        input_tokens = _int_field(path, number, row, "Request tokens")
        output_tokens = _int_field(path, number, row, "Response tokens")
        if _usable(skipped, input_tokens, output_tokens):
            yield TraceRequest(
                arrival_s=arrival,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                session=row.get("Session ID") or None,
            )


# --------------------------------------------------------------------------- loading


def _reader(fmt: str, counter: TokenCounter | None, rate: float, seed: int, mtbench_output_tokens: int) -> tuple[
    Callable[[Path, Counter], Iterable[TraceRequest]], bool
]:
    """The reader for `fmt` and whether it synthesizes (monotonic) arrival times."""
    if fmt == "mooncake":
        return read_mooncake, False
    if fmt == "azure":
        return read_azure, False
    if fmt == "burstgpt":
        return read_burstgpt, False
    if fmt == "decisions":
        from extproc.bench.decisions import read_decision_log

        return read_decision_log, False
    from extproc.bench import chat_traces

    if fmt == "sharegpt":
        return (lambda p, s: chat_traces.read_sharegpt(p, s, counter=counter, rate=rate, seed=seed)), True
    if fmt == "mtbench":
        return (
            lambda p, s: chat_traces.read_mtbench(
                p, s, counter=counter, rate=rate, seed=seed, output_tokens=mtbench_output_tokens
            )
        ), True
    raise ValueError(f"unknown trace format {fmt!r}; expected auto or one of {', '.join(FORMATS)}")


def load_trace(
    path: str | Path,
    *,
    format: str = "auto",
    limit: int | None = None,
    rate_scale: float = 1.0,
    start_offset: float = 0.0,
    rate: float = 1.0,
    seed: int = 0,
    counter: TokenCounter | None = None,
    mtbench_output_tokens: int = 256,
) -> Trace:
    """Read a trace into memory, rebased and rescaled.

    Arrival times become relative to the first request (seconds); requests before
    `start_offset` are dropped and the rest rebased to it; then inter-arrival gaps are divided by
    `rate_scale`; at most `limit` requests are kept (after the offset).

    Args:
        path: the trace file.
        format: `auto` (detect from content) or one of `FORMATS`.
        limit: keep at most this many requests (None: all).
        rate_scale: multiply the arrival rate by this (> 0): 2.0 halves every gap.
        start_offset: skip this much of the trace's beginning (seconds, trace time, >= 0).
        rate: arrival rate for formats without timestamps, ShareGPT and MT-Bench (requests/s).
        seed: seed of those synthesized (Poisson) arrivals.
        counter: tokenizer for the chat formats (default: the built-in Qwen3 tokenizer).
        mtbench_output_tokens: output length of MT-Bench requests, which have none (tokens).

    Raises:
        TraceFormatError: unreadable or malformed file, unknown format.
        ValueError: an option out of range or an unknown `format` name.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"rate_scale must be a positive number, got {rate_scale}")
    if not (start_offset >= 0 and math.isfinite(start_offset)):
        raise ValueError(f"start_offset must be >= 0 seconds, got {start_offset}")
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
    fmt = detect_format(path) if format == "auto" else format
    read, ordered = _reader(fmt, counter, rate, seed, mtbench_output_tokens)
    skipped: Counter = Counter()
    rows: list[TraceRequest] = []
    kept = 0
    for request in read(path, skipped):
        rows.append(request)
        # Synthesized arrivals increase from rows[0], so we can stop reading (and tokenizing) early.
        if ordered and limit is not None and request.arrival_s >= rows[0].arrival_s + start_offset:
            kept += 1
            if kept >= limit:
                break
    rows.sort(key=lambda r: r.arrival_s)
    requests: list[TraceRequest] = []
    if rows:
        origin = rows[0].arrival_s + start_offset
        for r in rows:
            if r.arrival_s < origin:
                continue
            if limit is not None and len(requests) >= limit:
                break
            arrival = (r.arrival_s - origin) / rate_scale
            requests.append(dataclasses.replace(r, arrival_s=arrival))
    return Trace(path=path, format=fmt, requests=requests, skipped=dict(skipped), synthesized_arrivals=ordered)
