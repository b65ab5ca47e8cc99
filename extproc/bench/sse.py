"""Incremental decoder for `text/event-stream` bodies (the client side of OpenAI streaming).

Events may be split anywhere across network chunks: mid-JSON, between the two newlines that end
an event, inside `data:`, even inside a UTF-8 character. We buffer bytes and cut only at a
blank line (bytes, so a multi-byte character is never cut), then decode each complete event.
Comment lines (`: ...`, e.g. the `x-chunk-id` markers) and fields other than `data` are ignored;
several `data:` lines of one event are joined with `\\n` (the SSE specification).
"""

from __future__ import annotations

__all__ = ["SSEDecoder"]


class SSEDecoder:
    """Feed body chunks, get back the `data` payload of every event completed so far."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        """Add `chunk`; return the data payloads (str) of events it completed, in order."""
        buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        *events, self._buffer = buffer.split(b"\n\n")
        out = []
        for raw in events:
            data = [
                line[5:].removeprefix(b" ")
                for line in raw.split(b"\n")
                if line.startswith(b"data:")
            ]
            if data:
                out.append(b"\n".join(data).decode("utf-8", errors="replace"))
        return out

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet completed (non-empty at the end means a truncated stream)."""
        return self._buffer
