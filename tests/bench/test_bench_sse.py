"""The incremental SSE decoder: events split anywhere across chunks."""

from __future__ import annotations

import pytest

from extproc.bench.sse import SSEDecoder

STREAM = (
    'data: {"choices":[{"delta":{"content":"héllo"}}]}\n\n'
    ": x-chunk-id=1 x-sent-at-us=123\n\n"
    'data: {"choices":[{"delta":{"content":" wörld"}}]}\n\n'
    "event: ping\ndata: line one\ndata: line two\n\n"
    "data: [DONE]\n\n"
).encode()
EXPECTED = [
    '{"choices":[{"delta":{"content":"héllo"}}]}',
    '{"choices":[{"delta":{"content":" wörld"}}]}',
    "line one\nline two",
    "[DONE]",
]


def _feed_all(chunks: list[bytes]) -> list[str]:
    decoder = SSEDecoder()
    out = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    assert decoder.pending == b""
    return out


@pytest.mark.parametrize(
    "size", [1, 2, 3, 7, 50, len(STREAM)], ids=["byte-by-byte", "2B", "3B", "7B", "50B", "whole"]
)
def test_any_split_gives_the_same_events(size: int) -> None:
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert _feed_all(chunks) == EXPECTED


def test_crlf_split_between_cr_and_lf() -> None:
    raw = STREAM.replace(b"\n", b"\r\n")
    cut = raw.index(b"\r\n") + 1  # chunk ends in "\r", the next starts with "\n"
    assert _feed_all([raw[:cut], raw[cut:]]) == EXPECTED


def test_incomplete_event_stays_pending() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a": 1}\n\ndata: {"b"') == ['{"a": 1}']
    assert decoder.pending == b'data: {"b"'
