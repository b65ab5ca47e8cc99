"""The decision log: one JSON line per decided generation request, for `llm-extproc analyze`.

Optional (`decision_log.path`). A line is written when the request's ext_proc stream ends (a
refusal: at once), so it can carry what the response showed. Fields:

| field | meaning |
|---|---|
| `time` | when the request's body arrived, or its headers for a refusal at the headers (Unix seconds, wall clock) |
| `request_id` | the request's `x-request-id`: the client's (at most `MAX_REQUEST_ID_CHARS`), or the one llm-extproc set on a routed request without one; null on a refusal without one |
| `kind` | `chat` or `completion` |
| `model` | the configured model name it resolved to, or null (unknown model, unparsable body) |
| `tenant` | a SHA-256 prefix (16 hex digits) of the request's tenant, or null (no tenants yet) |
| `prompt_tokens` | prompt tokens the engine prefills, after truncation, or null when not counted |
| `output_budget` | `max_tokens`, else the expected output (`default_output_tokens`) (tokens) |
| `endpoint` / `tier` | where it went (endpoint or tier mode), or null |
| `prefix_blocks` / `prefix_tokens` | the prompt's leading blocks (and their tokens) the prefix index believed the chosen endpoint held, or null (no index, not routed) |
| `predicted_ttft_ms` | the TTFT the scheduler predicted for the chosen endpoint at the pick, cached prefix counted (ms) |
| `observed_ttft_ms` | the TTFT seen on the response, when telemetry sampled it (ms), else null |
| `status` | the HTTP status the client got (ours on a refusal, the engine's otherwise), or null |
| `outcome` / `reason` | `routed` or `rejected`; the error code of a refusal |
| `truncation` | null, or what head + tail truncation did (`Truncation.as_dict`) |
| `decision_ms` | time to decide (ms) |

Never prompt text, message content, headers or credentials: only counts, names from the
configuration, addresses, the tenant's hash, and the request id (the one header kept: it is how a
client's complaint is matched to its line).

Writing is off the event loop: `write` puts the record on a bounded queue (a full queue drops
the line and counts it) and the standard library's `QueueListener` thread serialises it and
hands it to a `RotatingFileHandler`, which rotates by size (`max_bytes`, `backup_count` old
files `path.1` … `path.N`). A failed write (disk full) drops that line and counts it too, with
one warning a minute. The reader (`extproc.bench.decisions.read_decision_log`) turns a log into trace requests.
"""

from __future__ import annotations

import hashlib
import logging
import logging.handlers
import os
import queue
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from extproc.scheduling.plugins.scorers.ttft_estimate import predicted_ttft_s

if TYPE_CHECKING:
    from prometheus_client import Counter as PromCounter

    from extproc.config.schema import DecisionLogConfig, ModelConfig
    from extproc.pipeline.request import Routed
    from extproc.pipeline.truncate import Truncation

__all__ = ["DETECT_KEYS", "DecisionLog", "DecisionRecord", "log_path_problem", "tenant_hash"]

log = logging.getLogger(__name__)

WRITE_ERROR_LOG_INTERVAL_S = 60.0
"""Least time between two warnings about failed writes (seconds): a full disk fails every line."""

MAX_REQUEST_ID_CHARS = 128
"""Longest client `x-request-id` recorded (characters; a longer one is cut): the client chooses
it, and a line stays bounded."""

DETECT_KEYS = frozenset(("time", "kind", "prompt_tokens", "output_budget", "outcome"))
"""Keys every decision-log line has: how `llm-extproc analyze` tells the format."""


def tenant_hash(tenant: str | None) -> str | None:
    """A stable, non-reversible tag of a tenant id: the first 16 hex digits of its SHA-256."""
    if tenant is None:
        return None
    return hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@dataclass(slots=True)
class DecisionRecord:
    """What one decision log line says (see the module doc), filled as the request goes:
    the pipeline sets what it counted, the server where it went and what came back.

    `tenant` is the raw tenant id (hashed when written); the pipeline fills it once requests
    carry one.
    """

    time: float
    kind: str
    request_id: str | None = None
    model: str | None = None
    tenant: str | None = None
    prompt_tokens: int | None = None
    output_budget: int | None = None
    endpoint: str | None = None
    tier: str | None = None
    predicted_ttft_s: float | None = None
    observed_ttft_s: float | None = None
    status: int | None = None
    outcome: str = "routed"
    reason: str | None = None
    truncation: Truncation | None = None
    decision_s: float | None = None
    prefix_blocks: int | None = None
    prefix_tokens: int | None = None

    def counted(self, prompt_tokens: list[int], max_tokens: int | None, model: ModelConfig) -> None:
        """Record the prompt's tokens (summed over prompts) and the output budget: `max_tokens`,
        else the model's expected output, as the KV estimate takes it."""
        self.prompt_tokens = sum(prompt_tokens)
        self.output_budget = max_tokens or min(model.default_output_tokens, max(1, model.max_model_len - max(prompt_tokens)))

    def predict(self, routed: Routed) -> None:
        """Record the TTFT the scheduler predicted for the chosen endpoint (its prefix-aware
        estimate, `ttft-estimate-scorer`); without one in the profile, the endpoint's fit for the
        request's prefill work and the backlog it joins. Also the prefix match there: the
        leading blocks the index believed it held, and their tokens."""
        ep = routed.endpoint
        if ep is None:
            return
        if routed.prefix is not None:
            self.prefix_blocks = routed.prefix.matched.get(ep.address, 0)
            self.prefix_tokens = routed.prefix.cached_tokens(ep.address)
        if routed.predicted_ttft_s and ep.address in routed.predicted_ttft_s:
            self.predicted_ttft_s = routed.predicted_ttft_s[ep.address]
        else:
            self.predicted_ttft_s = predicted_ttft_s([ep], [routed.prefill_tokens], now=time.monotonic())[0]

    def as_dict(self) -> dict[str, Any]:
        """The JSON line's fields."""
        return {
            "time": round(self.time, 6),
            "request_id": None if self.request_id is None else self.request_id[:MAX_REQUEST_ID_CHARS],
            "kind": self.kind,
            "model": self.model,
            "tenant": tenant_hash(self.tenant),
            "prompt_tokens": self.prompt_tokens,
            "output_budget": self.output_budget,
            "endpoint": self.endpoint,
            "tier": self.tier,
            "prefix_blocks": self.prefix_blocks,
            "prefix_tokens": self.prefix_tokens,
            "predicted_ttft_ms": _ms(self.predicted_ttft_s),
            "observed_ttft_ms": _ms(self.observed_ttft_s),
            "status": self.status,
            "outcome": self.outcome,
            "reason": self.reason,
            "truncation": None if self.truncation is None else self.truncation.as_dict(),
            "decision_ms": _ms(self.decision_s),
        }


class _JSONLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return orjson.dumps(record.msg).decode()


class _Handler(logging.handlers.RotatingFileHandler):
    """A rotating file whose failed writes (disk full, I/O error, failed rotation) count as
    dropped lines and log one warning a minute, instead of logging's traceback with the whole
    record on stderr for every line."""

    def __init__(self, path: Path, config: DecisionLogConfig, dropped: PromCounter | None) -> None:
        super().__init__(path, maxBytes=config.max_bytes, backupCount=config.backup_count, encoding="utf-8")
        self._dropped = dropped
        self._warned_at: float | None = None

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        if self._dropped is not None:
            self._dropped.inc()
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= WRITE_ERROR_LOG_INTERVAL_S:
            self._warned_at = now
            exc = sys.exc_info()[1]
            log.warning("decision log %s: a line could not be written (%s); dropping lines until writes succeed", self.baseFilename, exc)

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:  # the last flush of a full disk
            log.warning("decision log %s: closing lost buffered lines: %s", self.baseFilename, exc)


class _Listener(logging.handlers.QueueListener):
    """Turns queued records into lines in the listener's thread: the event loop only enqueues."""

    def prepare(self, record: Any) -> logging.LogRecord:
        return logging.makeLogRecord({"msg": record.as_dict(), "levelno": logging.INFO, "levelname": "INFO"})


def log_path_problem(path: str | Path) -> str | None:
    """Why `DecisionLog.start` could not open `path`, found without creating anything (for
    `llm-extproc check-config`), or None when it looks openable: the path is a directory, or is
    not writable; or the nearest existing ancestor of a path not yet there is not a directory,
    or not writable (start creates the missing directories). The text reads like the `OSError`
    start would raise. Permission checks are `os.access`'s: root passes them all."""
    p = Path(path)
    if p.is_dir():
        return "Is a directory"
    if p.exists():
        return None if os.access(p, os.W_OK) else "Permission denied"
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"Not a directory ({parent})"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"Permission denied ({parent})"


class DecisionLog:
    """Writes decision records as JSON lines, rotated by size, from a background thread.

    Args:
        config: path, rotation and queue bound.
        dropped: counter of lines dropped because the queue was full or the write failed
            (disk full, I/O error), or None.
    """

    def __init__(self, config: DecisionLogConfig, dropped: PromCounter | None = None) -> None:
        if config.path is None:
            raise ValueError("decision_log.path is not set")
        self.path = Path(config.path)
        self._config = config
        self._dropped = dropped
        self._queue: queue.Queue[DecisionRecord] = queue.Queue(maxsize=config.queue_size)
        self._listener: _Listener | None = None
        self._handler: logging.handlers.RotatingFileHandler | None = None

    def start(self) -> None:
        """Open the file (creating its directory) and start the writer thread.

        Raises:
            OSError: the file cannot be opened.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handler = _Handler(self.path, self._config, self._dropped)
        handler.setFormatter(_JSONLines())
        self._handler = handler
        self._listener = _Listener(self._queue, handler)  # type: ignore[arg-type]
        self._listener.start()

    def write(self, record: DecisionRecord) -> None:
        """Queue one record (never blocks; a full queue drops it and counts the drop)."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            if self._dropped is not None:
                self._dropped.inc()

    def close(self) -> None:
        """Write what is queued, stop the thread, close the file."""
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        if self._handler is not None:
            self._handler.close()
            self._handler = None
