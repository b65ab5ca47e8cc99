"""Telemetry test helpers: recorded streams, fixed clocks, and a driver that plays a stream into an observer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from extproc.telemetry.observer import StreamObserver

SSE_DIR = Path(__file__).parent.parent / "testdata" / "sse"
MS = 1_000_000  # ns
START = 1_000 * MS  # an arbitrary monotonic request start (ns)
WALL = 1_753_862_400_000_000_000  # a fixed wall clock (Unix ns)
ENDPOINT = "10.0.0.1:8000"
MODEL = "Qwen/Qwen3-8B"


def recorded(name: str) -> bytes:
    return (SSE_DIR / name).read_bytes()


def events_of(raw: bytes) -> list[bytes]:
    """The stream cut after each event (`data: ...\\n\\n`); an unterminated tail stays as it is."""
    *complete, tail = raw.split(b"\n\n")
    return [e + b"\n\n" for e in complete] + ([tail] if tail else [])


@dataclass
class Played:
    observer: StreamObserver
    out: bytes  # what the client would receive
    replaced: int  # chunks the observer replaced


def play(
    observer: StreamObserver,
    chunks: list[bytes],
    times_ms: list[float],
    *,
    status: int = 200,
    content_type: str = "text/event-stream",
    content_length: int | None = None,
    headers_ms: float = 5,
    eos: bool = True,
    eos_ms: float | None = None,
) -> Played:
    """Feed headers at `headers_ms`, chunk i at `times_ms[i]` (ms after START), then an empty
    end-of-stream chunk at `eos_ms` (default: the last chunk's time) when `eos`."""
    observer.on_response_headers(status, content_type, content_length, START + int(headers_ms * MS))
    out = []
    replaced = 0
    for chunk, t in zip(chunks, times_ms, strict=True):
        r = observer.on_body_chunk(chunk, False, START + int(t * MS))
        replaced += r is not None
        out.append(chunk if r is None else r)
    if eos:
        t = times_ms[-1] if eos_ms is None else eos_ms
        r = observer.on_body_chunk(b"", True, START + int(t * MS))
        out.append(b"" if r is None else r)
    return Played(observer, b"".join(out), replaced)
