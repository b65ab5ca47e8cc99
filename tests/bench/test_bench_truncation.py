"""Head + tail truncation (the design notes' `prefix = min(512, len/4)`, rest from the tail)."""

from __future__ import annotations

import pytest

from extproc.bench.truncation import head_tail_split, truncate_head_tail


@pytest.mark.parametrize(
    ("length", "max_len", "head", "tail"),
    [
        (100, 200, 100, 0),  # fits: untouched
        (200, 200, 200, 0),  # exactly the budget: untouched
        (10_000, 4096, 512, 3584),  # long prompt: the full 512-token head
        (1000, 800, 250, 550),  # len/4 = 250 < 512
        (1000, 100, 50, 50),  # the notes' 250-token head would not fit: capped at max_len / 2
        (10, 1, 0, 1),  # a one-token budget keeps the last token
    ],
    ids=["fits", "exact", "long", "quarter-head", "tiny-budget", "one-token"],
)
def test_split(length: int, max_len: int, head: int, tail: int) -> None:
    assert head_tail_split(length, max_len) == (head, tail)


def test_truncate_keeps_head_and_tail_in_order() -> None:
    tokens = list(range(10_000))
    cut = truncate_head_tail(tokens, 4096)
    assert len(cut) == 4096
    assert cut[:512] == list(range(512))
    assert cut[512:] == list(range(10_000 - 3584, 10_000))


def test_truncate_returns_a_copy_when_it_fits() -> None:
    tokens = [5, 6, 7]
    cut = truncate_head_tail(tokens, 8)
    assert cut == tokens and cut is not tokens


def test_truncate_any_sequence() -> None:
    assert truncate_head_tail("abcdefgh", 4) == ["a", "b", "g", "h"]


@pytest.mark.parametrize(("length", "max_len"), [(10, 0), (-1, 5)], ids=["zero-budget", "negative-length"])
def test_bad_arguments(length: int, max_len: int) -> None:
    with pytest.raises(ValueError):
        head_tail_split(length, max_len)
