"""Incremental parser for `text/event-stream` response bodies (the proxy side of SSE).

Follows the WHATWG HTML "event stream interpretation" rules
(https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation):

* lines end with CRLF, LF or CR — and a CR at the end of one chunk may pair with an LF at the
  start of the next, which is then not a second line ending;
* one UTF-8 byte-order mark at the very start of the stream is dropped;
* a blank line dispatches the event; a line starting with `:` is a comment; `field:value` with
  one optional space after the colon; a line without a colon is a field with an empty value;
* `data` lines are joined with LF; `event` sets the type (default `message`); `id` sets the last
  event id unless it contains NUL (and persists across events); `retry` is accepted only when
  it is all ASCII digits; other field names are ignored; field names are case-sensitive;
* an event whose data buffer is empty is not dispatched;
* at end of stream an unterminated event is discarded (`flush()` reports it, dispatches nothing).

Chunks may be split at any byte: inside `data:`, mid-JSON, between the two newlines, inside a
multi-byte UTF-8 character. The parser cuts lines on bytes (CR and LF never occur inside a
UTF-8 multi-byte sequence) and decodes each complete field value, invalid sequences becoming
U+FFFD as the spec's decoder does.

Memory is bounded: a line longer than `max_line_bytes`, or an event whose data exceeds
`max_event_bytes`, raises `SSELimitError`; the parser then refuses further input (the caller
stops parsing and passes the rest through).

For stream markers the parser can also report where, in each fed chunk, an event block starts
(`track_starts=True`, then `starts` after each `feed`): the offset of the first byte of the
first non-comment line after an event boundary. Inserting a comment line there is never inside
an event.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Event", "SSEError", "SSELimitError", "SSEParser"]

_BOM = b"\xef\xbb\xbf"
_CR = 0x0D
_LF = 0x0A
_COLON = 0x3A


class Event(NamedTuple):
    """One dispatched server-sent event (a named tuple: cheap to build, once per event).

    Attributes:
        data: the data lines joined with `\\n` (str).
        event: the event type (`message` unless an `event:` field set it).
        id: the last event id at dispatch (persists across events, per the spec).
        retry: the reconnection time (milliseconds) set by a `retry:` field of this event, or None.
    """

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


class SSEError(ValueError):
    """The event stream cannot be parsed further."""


class SSELimitError(SSEError):
    """A line or an event's data exceeded its bound (the stream is not SSE the way we expect).

    Attributes:
        what: `line` or `event`.
        size: bytes seen so far (bytes).
        limit: the bound (bytes).
    """

    def __init__(self, what: str, size: int, limit: int) -> None:
        super().__init__(f"SSE {what} of at least {size} bytes exceeds the limit of {limit} bytes")
        self.what = what
        self.size = size
        self.limit = limit


class SSEParser:
    """Feed response-body chunks, get back the events each one completed.

    Args:
        max_line_bytes: longest accepted line, terminator excluded (bytes; default 1 MiB).
        max_event_bytes: largest accepted data of one event (bytes; default 4 MiB).
        track_starts: record in `starts` the offsets at which event blocks begin in each chunk.

    Raises:
        ValueError: a bound below 1.
    """

    __slots__ = (
        "max_line_bytes", "max_event_bytes", "starts", "_track", "_rest", "_rest_len", "_skip_lf", "_at_start",
        "_data", "_data_bytes", "_type", "_retry", "_last_id", "_in_event", "_start_seen", "_failed",
        "events_dispatched",
    )

    def __init__(self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 4 << 20, track_starts: bool = False) -> None:
        if max_line_bytes < 1 or max_event_bytes < 1:
            raise ValueError("SSE bounds must be at least 1 byte")
        self.max_line_bytes = max_line_bytes
        self.max_event_bytes = max_event_bytes
        self.starts: list[int] = []
        """Offsets (into the last fed chunk) where an event block begins; filled when tracking."""
        self.events_dispatched = 0
        self._track = track_starts
        self._rest: list[bytes] = []  # pieces of an unterminated line carried to the next chunk
        self._rest_len = 0
        self._skip_lf = False  # the previous chunk ended with CR: a leading LF belongs to it
        self._at_start = True  # no line completed yet (the BOM may still be ahead)
        self._data: list[bytes] = []
        self._data_bytes = 0
        self._type = ""
        self._retry: int | None = None
        self._last_id = ""
        self._in_event = False  # a field line was seen since the last blank line
        self._start_seen = False  # the start of the current block was already reported
        self._failed: SSELimitError | None = None

    @property
    def last_event_id(self) -> str:
        """The stream's last event id (what a client would send as `Last-Event-ID`)."""
        return self._last_id

    @property
    def pending_bytes(self) -> int:
        """Bytes of an unterminated line held for the next chunk (bytes)."""
        return self._rest_len

    @property
    def in_event(self) -> bool:
        """True when fields of an event were seen and its terminating blank line was not."""
        return self._in_event or self._rest_len > 0

    def feed(self, chunk: bytes) -> list[Event]:
        """Add the next body chunk; return the events it completed, in order.

        Raises:
            SSELimitError: a line or event over its bound (this and every later call).
        """
        if self._failed is not None:
            raise self._failed
        if self._track:
            self.starts = []
        if not chunk:
            return []
        base = 0
        if self._skip_lf:
            self._skip_lf = False
            if chunk[0] == _LF:
                base = 1
                if len(chunk) == 1:
                    return []
        if b"\n" not in chunk and b"\r" not in chunk:
            # No line ends here: keep the piece (a list, so a long line fed in small pieces is
            # not copied over and over).
            piece = chunk[base:] if base else chunk
            if self._track and not self._rest_len:
                self._note_start(piece, base)
            self._rest.append(piece)
            self._rest_len += len(piece)
            if self._rest_len > self.max_line_bytes:
                self._fail("line", self._rest_len, self.max_line_bytes)
            return []
        carried = self._rest_len
        if not carried and not self._at_start and b"\r" not in chunk:
            buf = chunk[base:] if base else chunk
            if buf.endswith(b"\n\n"):
                return self._blocks(buf, base)
        if carried:
            self._rest.append(chunk[base:] if base else chunk)
            buf = b"".join(self._rest)
        else:
            buf = chunk[base:] if base else chunk
        pos = base - carried  # offset in `chunk` of buf[0]; negative while in the carried line
        out: list[Event] = []
        lines = buf.splitlines(keepends=True)
        last = lines[-1]
        if last[-1] in (_CR, _LF):
            self._rest = []
            self._rest_len = 0
            self._skip_lf = last[-1] == _CR
        else:
            lines.pop()
            self._rest = [last]
            self._rest_len = len(last)
        for raw in lines:
            end = len(raw) - (2 if raw.endswith(b"\r\n") else 1)
            if end > self.max_line_bytes:
                self._fail("line", end, self.max_line_bytes)
            if self._track and pos >= 0:
                self._note_start(raw, pos)
            pos += len(raw)
            self._line(raw[:end], out)
        if self._rest_len:
            if self._rest_len > self.max_line_bytes:
                self._fail("line", self._rest_len, self.max_line_bytes)
            if self._track:
                self._note_start(self._rest[0], pos)
        return out

    def _blocks(self, buf: bytes, pos: int) -> list[Event]:
        """Fast path for the usual chunk: LF endings only, no carried line, ending with a blank
        line — so it cuts into whole `\\n\\n`-terminated blocks; a block that is one `data: `
        line outside an event is an event by itself."""
        out: list[Event] = []
        track = self._track
        blocks = buf.split(b"\n\n")
        blocks.pop()  # the empty piece after the final separator
        for block in blocks:
            if not self._in_event and block[:6] == b"data: " and b"\n" not in block:
                if len(block) > self.max_line_bytes:
                    self._fail("line", len(block), self.max_line_bytes)
                if len(block) - 5 > self.max_event_bytes:
                    self._fail("event", len(block) - 5, self.max_event_bytes)
                if track:
                    self.starts.append(pos)
                out.append(Event(block[6:].decode("utf-8", "replace"), "message", self._last_id, None))
                self.events_dispatched += 1
                pos += len(block) + 2
                continue
            for line in block.split(b"\n"):
                if len(line) > self.max_line_bytes:
                    self._fail("line", len(line), self.max_line_bytes)
                if track:
                    self._note_start(line or b"\n", pos)
                pos += len(line) + 1
                self._line(line, out)
            self._dispatch(out)  # the blank line that ends the block
            pos += 1
        return out

    def flush(self) -> list[Event]:
        """End of stream: discard an unterminated event (WHATWG) and return the events dispatched
        by it — always none. Check `in_event` before calling to learn whether the stream was cut
        inside an event."""
        self._rest = []
        self._rest_len = 0
        self._skip_lf = False
        self._reset_event()
        return []

    def _fail(self, what: str, size: int, limit: int) -> None:
        self._failed = SSELimitError(what, size, limit)
        self._rest = []
        self._rest_len = 0
        raise self._failed

    def _note_start(self, line: bytes, pos: int) -> None:
        """Record `pos` if `line` (which starts there) is the first field line of an event block."""
        if self._in_event or self._start_seen or line[0] in (_CR, _LF, _COLON):
            return
        if self._at_start and line[:1] == b"\xef":
            if line.startswith(_BOM):
                if len(line) == 3 or line[3] in (_CR, _LF, _COLON):
                    return
                pos += 3
            elif _BOM.startswith(line):
                return  # the BOM itself is split: this block goes unmarked
        self._start_seen = True
        self.starts.append(pos)

    def _line(self, line: bytes, out: list[Event]) -> None:
        if self._at_start:
            self._at_start = False
            if line.startswith(_BOM):
                line = line[3:]
        if not line:
            self._dispatch(out)
            return
        if line[0] == _COLON:
            return
        self._in_event = True
        i = line.find(b":")
        if i < 0:
            name, value = line, b""
        else:
            name, value = line[:i], line[i + 1 :]
            if value[:1] == b" ":
                value = value[1:]
        if name == b"data":
            self._data_bytes += len(value) + 1
            if self._data_bytes > self.max_event_bytes:
                self._fail("event", self._data_bytes, self.max_event_bytes)
            self._data.append(value)
        elif name == b"event":
            self._type = value.decode("utf-8", "replace")
        elif name == b"id":
            if b"\x00" not in value:
                self._last_id = value.decode("utf-8", "replace")
        elif name == b"retry":
            if value.isdigit():  # bytes.isdigit is ASCII digits only
                self._retry = int(value)

    def _dispatch(self, out: list[Event]) -> None:
        if self._data:
            data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
            out.append(Event(data.decode("utf-8", "replace"), self._type or "message", self._last_id, self._retry))
            self.events_dispatched += 1
        self._reset_event()

    def _reset_event(self) -> None:
        self._data = []
        self._data_bytes = 0
        self._type = ""
        self._retry = None
        self._in_event = False
        self._start_seen = False
