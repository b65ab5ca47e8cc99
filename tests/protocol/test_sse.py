"""The incremental SSE parser: WHATWG event-stream rules, every way a chunk can split an event,
bounded memory, and the event-start offsets that markers are placed at."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from httpx_sse._decoders import SSEDecoder, SSELineDecoder
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.protocol.sse import Event, SSELimitError, SSEParser

DATA = Path(__file__).parent.parent / "testdata" / "sse"
STREAMS = sorted(p.name for p in DATA.glob("*.sse"))
ENDINGS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def recorded(name: str, ending: bytes = b"\n") -> bytes:
    """A recorded stream with its line endings rewritten (JSON payloads hold no raw newlines)."""
    return (DATA / name).read_bytes().replace(b"\n", ending)


def parse_chunks(chunks: list[bytes], **kw) -> list[Event]:
    p = SSEParser(**kw)
    events = [e for c in chunks for e in p.feed(c)]
    return events + p.flush()


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(cuts)), len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def usage_of(events: list[Event]) -> dict | None:
    found = None
    for e in events:
        if e.data != "[DONE]":
            u = orjson.loads(e.data).get("usage")
            found = u if u is not None else found
    return found


EVENT = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
WANT = [Event('{"choices":[{"delta":{"content":"hi"}}]}')]


# -- one test per way a chunk boundary can fall ----------------------------------------------


def test_split_inside_the_data_field_name():
    assert parse_chunks([b"da", b"ta: x\n\n"]) == [Event("x")]


def test_split_between_colon_and_space():
    assert parse_chunks([b"data:", b" x\n\n"]) == [Event("x")]


def test_split_mid_json():
    cut = EVENT.index(b"content") + 3
    assert parse_chunks([EVENT[:cut], EVENT[cut:]]) == WANT


def test_split_between_the_two_newlines():
    p = SSEParser()
    assert p.feed(EVENT[:-1]) == []  # the line is complete, the event is not
    assert p.feed(EVENT[-1:]) == WANT


def test_split_inside_a_multibyte_character():
    text = "巴黎 🇫🇷".encode()
    raw = b"data: " + text + b"\n\n"
    for cut in range(6, 6 + len(text)):  # every byte inside the UTF-8 payload
        assert parse_chunks([raw[:cut], raw[cut:]]) == [Event("巴黎 🇫🇷")], cut


def test_split_between_cr_and_lf_of_a_crlf():
    # The LF at the start of the second chunk belongs to the CR that ended the first: one blank
    # line, so exactly one event (not an extra empty line that dispatches or drops anything).
    p = SSEParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\ndata: b\r\n\r\n") == [Event("a\nb")]


def test_crlf_split_with_lone_lf_chunk():
    p = SSEParser()
    events = []
    for c in (b"data: a\r", b"\n", b"\r", b"\n"):
        events += p.feed(c)
    assert events == [Event("a")]


@pytest.mark.parametrize("ending", ENDINGS.values(), ids=ENDINGS.keys())
def test_line_endings(ending):
    raw = b"data: a" + ending + b"data: b" + ending + ending + b"data: c" + ending + ending
    assert parse_chunks([raw]) == [Event("a\nb"), Event("c")]


def test_one_byte_at_a_time():
    raw = recorded("chat_reasoning.sse", b"\r\n")
    assert parse_chunks([raw[i : i + 1] for i in range(len(raw))]) == parse_chunks([raw])


def test_empty_chunks_change_nothing():
    p = SSEParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"") == []  # must not forget the pending CR
    assert p.feed(b"\n\n") == [Event("a")]


# -- WHATWG field rules ----------------------------------------------------------------------


RULES = [
    (b"data: x\n\n", [Event("x")]),
    (b"data:x\n\n", [Event("x")]),  # the space is optional
    (b"data:  x\n\n", [Event(" x")]),  # only one space is removed
    (b"data\n\n", [Event("")]),  # no colon: the field with an empty value
    (b"data:\n\n", [Event("")]),
    (b"data: a\ndata: b\ndata: c\n\n", [Event("a\nb\nc")]),  # multi-line data
    (b": comment\ndata: x\n\n", [Event("x")]),
    (b":\n\n", []),  # a bare comment, then a blank line: nothing to dispatch
    (b"event: delta\ndata: x\n\n", [Event("x", event="delta")]),
    (b"event:\ndata: x\n\n", [Event("x")]),  # an empty type means "message"
    (b"id: 7\ndata: x\n\ndata: y\n\n", [Event("x", id="7"), Event("y", id="7")]),  # id persists
    (b"id: 7\ndata: x\n\nid\ndata: y\n\n", [Event("x", id="7"), Event("y", id="")]),  # reset
    (b"id: a\x00b\ndata: x\n\n", [Event("x")]),  # an id with NUL is ignored
    (b"retry: 1500\ndata: x\n\n", [Event("x", retry=1500)]),
    (b"retry: 15s\ndata: x\n\n", [Event("x")]),  # not all digits: ignored
    (b"Data: x\n\n", []),  # field names are case-sensitive
    (b"foo: bar\ndata: x\n\n", [Event("x")]),  # unknown fields are ignored
    (b"event: ping\n\n", []),  # no data: not dispatched ...
    (b"event: ping\n\ndata: x\n\n", [Event("x")]),  # ... and the type does not leak
    (b"\xef\xbb\xbfdata: x\n\n", [Event("x")]),  # a leading BOM is dropped
    (b"data: x\n\n\xef\xbb\xbfdata: y\n\n", [Event("x")]),  # ... only at the stream start
    (b"data: \xff\n\n", [Event("\ufffd")]),  # invalid UTF-8 becomes U+FFFD
    (b"data: x\n", []),  # no blank line: not dispatched at end of stream
]
RULE_IDS = [
    "plain", "no-space", "two-spaces", "no-colon", "empty-value", "multi-line", "comment",
    "bare-comment", "event-type", "empty-type", "id-persists", "id-reset", "id-nul", "retry",
    "retry-invalid", "case-sensitive", "unknown-field", "no-data", "type-reset", "bom",
    "bom-only-at-start", "invalid-utf8", "unterminated",
]


@pytest.mark.parametrize(("raw", "expected"), RULES, ids=RULE_IDS)
def test_whatwg_rules(raw, expected):
    assert parse_chunks([raw]) == expected


MID_STREAM = [(r, i) for r, i in zip(RULES, RULE_IDS) if not r[0].startswith(b"\xef")]  # BOMs: start only


@pytest.mark.parametrize(("raw", "expected"), [r for r, _ in MID_STREAM], ids=[i for _, i in MID_STREAM])
def test_whatwg_rules_mid_stream(raw, expected):
    # The same rules once the stream has started (whole-block chunks take the parser's fast path).
    assert parse_chunks([b"data: p\n\n", raw]) == [Event("p"), *expected]


_LINES = st.one_of(
    st.builds(lambda v: b"data: " + v, st.sampled_from([b"x", b"{\"a\": 1}", "é巴🇫🇷".encode(), b" lead", b"[DONE]"])),
    st.builds(lambda v: b"data:" + v, st.sampled_from([b"y", b"z z"])),
    st.sampled_from([b"event: delta", b"event:", b"id: 7", b"id", b"retry: 250", b"retry: x", b": c", b":", b"foo: bar", b""]),
)


@settings(max_examples=300, deadline=None)
@given(
    lines=st.lists(st.tuples(_LINES, st.sampled_from([b"\n", b"\r\n", b"\r"])), max_size=30),
    data=st.data(),
)
def test_agrees_with_an_sse_client_library(lines, data):
    # Random streams (every data value non-empty), cut anywhere, against httpx-sse reading them
    # whole. httpx-sse also dispatches events that have no data (WHATWG does not): compare the
    # events that carry data.
    raw = b"".join(line + end for line, end in lines) + b"\n\n"
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    ours = [(e.event, e.data, e.id, e.retry) for e in parse_chunks(split_at(raw, cuts))]
    decoder = SSEDecoder()
    theirs = []
    for line in [*SSELineDecoder().decode(raw.decode()), ""]:
        sse = decoder.decode(line)
        if sse is not None and sse.data:
            theirs.append((sse.event or "message", sse.data, sse.id, sse.retry))
    assert ours == theirs


def test_unterminated_event_is_reported_then_discarded():
    p = SSEParser()
    assert p.feed(b"data: [DONE]\n\ndata: {\"partial") == [Event("[DONE]")]
    assert p.in_event and p.pending_bytes == len(b'data: {"partial')
    assert p.flush() == []
    assert not p.in_event and p.pending_bytes == 0


def test_last_event_id_survives_dispatch():
    p = SSEParser()
    p.feed(b"id: 42\ndata: x\n\n")
    assert p.last_event_id == "42"


# -- bounded memory --------------------------------------------------------------------------


def test_line_over_the_limit_in_one_chunk_raises():
    p = SSEParser(max_line_bytes=16)
    with pytest.raises(SSELimitError) as info:
        p.feed(b"data: " + b"x" * 20 + b"\n\n")
    assert (info.value.what, info.value.limit) == ("line", 16)


def test_line_over_the_limit_across_chunks_raises_before_buffering_more():
    p = SSEParser(max_line_bytes=64)
    p.feed(b"data: ")
    with pytest.raises(SSELimitError):
        for _ in range(100):  # a line with no end: the error comes before 100 chunks pile up
            p.feed(b"x" * 10)
    assert p.pending_bytes == 0
    with pytest.raises(SSELimitError):  # the parser stays failed
        p.feed(b"\n\n")


def test_event_data_over_the_limit_raises():
    p = SSEParser(max_line_bytes=100, max_event_bytes=50)
    with pytest.raises(SSELimitError) as info:
        p.feed(b"data: 0123456789\n" * 10)
    assert info.value.what == "event"


def test_a_line_at_the_limit_is_accepted():
    assert parse_chunks([b"data:" + b"x" * 11 + b"\n\n"], max_line_bytes=16) == [Event("x" * 11)]


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        SSEParser(max_line_bytes=0)


# -- recorded streams split anywhere ---------------------------------------------------------


@pytest.mark.parametrize("ending", ENDINGS.values(), ids=ENDINGS.keys())
@pytest.mark.parametrize("name", STREAMS)
def test_recorded_streams_parse(name, ending):
    events = parse_chunks([recorded(name, ending)])
    assert events[-1] == Event("[DONE]")
    assert all(orjson.loads(e.data) is not None for e in events[:-1])


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(STREAMS),
    ending=st.sampled_from(list(ENDINGS.values())),
    data=st.data(),
)
def test_any_split_gives_the_same_events_and_usage(name, ending, data):
    raw = recorded(name, ending)
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=40))
    whole = parse_chunks([raw])
    pieces = parse_chunks(split_at(raw, cuts))
    assert pieces == whole
    assert usage_of(pieces) == usage_of(whole)


# -- event starts (where markers go) ---------------------------------------------------------


def starts_by_chunk(chunks: list[bytes]) -> list[list[int]]:
    p = SSEParser(track_starts=True)
    out = []
    for c in chunks:
        p.feed(c)
        out.append(list(p.starts))
    return out


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b"data: a\n\ndata: b\n\n"], [[0, 9]]),
        ([b": hi\n\ndata: a\n\n"], [[6]]),  # comments are not event starts
        ([b"data: a\n", b"\ndata: b\n\n"], [[0], [1]]),  # the blank line completes in chunk 2
        ([b"data: a\n\nda", b"ta: b\n\n"], [[0, 9], []]),  # a start at a chunk's tail
        ([b"data: a\r", b"\ndata: b\r\n\r\n"], [[0], []]),  # same event: no new start
        ([b"data: a\r\r", b"\ndata: b\n\n"], [[0], [1]]),  # after CR CR the LF is blank: skip it
        ([b"data: a\r\r", b"data: b\n\n"], [[0], [0]]),
        ([b"event: x\ndata: a\n\n"], [[0]]),  # the first field line, whatever the field
        ([b"\xef\xbb\xbfdata: a\n\n"], [[3]]),  # after the BOM
        ([b"\xef\xbb", b"\xbfdata: a\n\ndata: b\n\n"], [[], [10]]),  # a split BOM: unmarked
        ([b"\n\n\ndata: a\n\n"], [[3]]),  # extra blank lines are not events
    ],
    ids=[
        "two-events", "after-comment", "blank-line-split", "tail-start", "crlf-split",
        "cr-cr-lf", "cr-cr", "event-field", "bom", "split-bom", "extra-blank-lines",
    ],
)
def test_event_starts(chunks, expected):
    assert starts_by_chunk(chunks) == expected


def test_starts_are_line_starts_outside_events():
    # Each recorded start is the first byte of a line, and the parser was between events there.
    raw = recorded("chat_reasoning.sse", b"\r\n")
    p = SSEParser(track_starts=True)
    p.feed(raw)
    assert len(p.starts) == raw.count(b"data:")
    assert all(raw[s : s + 5] == b"data:" and (s == 0 or raw[s - 4 : s] == b"\r\n\r\n") for s in p.starts)
