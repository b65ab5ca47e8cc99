"""The decision log (`decision_log.path`, written by extproc.telemetry.decision_log) read back as
a trace: what `llm-extproc analyze` and `bench --trace` replay. The writer owns the format
(`DETECT_KEYS`); the reading is benchmark tooling and lives here, so runtime telemetry imports
nothing of extproc.bench.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from extproc.bench.records import TraceFormatError, TraceRequest, iter_jsonl
from extproc.telemetry.decision_log import DETECT_KEYS

__all__ = ["read_decision_log"]


def read_decision_log(path: str | Path, skipped: Counter | None = None) -> Iterator[TraceRequest]:
    """Requests of a decision log as trace requests, for `llm-extproc analyze`.

    `input_tokens` is the prompt as the client sent it (before truncation), `output_tokens` the
    output budget, `arrival_s` the decision time, `refused` whether llm-extproc refused it. Lines without a prompt count (refused before
    counting) are skipped and counted as `not_counted`.

    Raises:
        TraceFormatError: a line is not a JSON object or a field is malformed (names the line).
    """
    path = Path(path)
    skipped = Counter() if skipped is None else skipped
    for number, row in iter_jsonl(path):
        if not isinstance(row, dict) or not DETECT_KEYS <= set(row):
            raise TraceFormatError(path, f"not a decision-log line (needs {sorted(DETECT_KEYS)})", line=number)
        prompt = row["prompt_tokens"]
        cut = row.get("truncation")
        if isinstance(cut, dict) and isinstance(cut.get("tokens_before"), int):
            prompt = cut["tokens_before"]
        if prompt is None:
            skipped["not_counted"] += 1
            continue
        budget = row["output_budget"]
        when = row["time"]
        for key, value in (("prompt_tokens", prompt), ("output_budget", budget)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TraceFormatError(path, f"{key!r} must be a positive integer, got {value!r}", line=number)
        if not isinstance(when, int | float) or isinstance(when, bool) or when < 0:
            raise TraceFormatError(path, f"'time' must be a non-negative number, got {when!r}", line=number)
        yield TraceRequest(arrival_s=float(when), input_tokens=prompt, output_tokens=budget, refused=row["outcome"] != "routed")
