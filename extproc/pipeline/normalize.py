"""A tokenizer's Unicode normalizer, exactly as `tokenizers` applies it, at Python's speed.

`tokenizers` normalizes with its own Rust tables (the `unicode-normalization-alignments`
crate), Python's `unicodedata` with the tables of its own Unicode version (14.0 on 3.11). They
disagree on characters assigned between the two versions: with the `tokenizers` installed here
and Python 3.11, 100 characters (combining marks such as U+07FD, U+0898-089F, U+08CA-08D3,
U+0C3C, U+1ABF-1ACE, U+1DF6-1DFA, and the parts of a few new composites) are starters without
decompositions to Rust and reorder or compose with their neighbours in Python, so "a" + U+07FD
+ U+0301 is 3 code points to the tokenizer and 2 to Python, and the token ids differ.

The Rust normalizer is exact but ~20× slower than `unicodedata` (0.53 ms against 0.024 ms on
an 8k-token text, 70% of tiktoken's own encode time; docs/benchmarks.md). So at load we find
every code point where the two disagree (`disagreeing_code_points`), and `ExactNormalizer`
uses Rust only for text that holds one of them, `unicodedata` for the rest.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["ExactNormalizer", "UnsupportedNormalizer", "disagreeing_code_points", "exact_normalizer"]

_FORMS = ("NFC", "NFD", "NFKC", "NFKD")

# Code points that can carry normalization properties: the BMP, the SMP and the SSP, less the
# ranges whose properties are fixed by construction (CJK unified ideographs: starters without
# decompositions; Hangul syllables: decomposed by algorithm in both; private use: never given
# properties), and the CJK compatibility ideographs supplement (singleton decompositions). The
# SIP and TIP (planes 2-3) are allocated to unified ideographs only; planes 4-13 are unassigned.
_RANGES = ((0x80, 0x3400), (0xA000, 0xAC00), (0xD7A4, 0xD800), (0xF900, 0x10000), (0x10000, 0x20000),
           (0x2F800, 0x2FA20), (0xE0000, 0xE1000))  # fmt: skip

# The probes of each code point c: alone, then between "a" and an acute (class 230) or a dot
# below (class 220). A combining class that differs between the two tables reorders or blocks
# one of them differently; "a" composes with both, so a blocked composition shows.
_PROBES = ("{c}", "a{c}\u0301", "a{c}\u0323")


class UnsupportedNormalizer(ValueError):
    """A normalizer other than NFC/NFD/NFKC/NFKD or a sequence of them."""


def _python(spec: dict) -> Callable[[str], str] | None:
    """The normalizer `spec` by `unicodedata` (None: a no-op)."""
    kind = spec.get("type")
    if kind in _FORMS:
        return lambda text: unicodedata.normalize(kind, text)
    if kind == "Sequence":
        steps = [s for s in (_python(sub) for sub in spec.get("normalizers", [])) if s is not None]
        if not steps:
            return None

        def run(text: str) -> str:
            for step in steps:
                text = step(text)
            return text

        return run
    raise UnsupportedNormalizer(f"normalizer {kind!r} is not supported (only NFC/NFD/NFKC/NFKD)")


def _rust(spec: dict) -> Any:
    """The normalizer `spec` as a `tokenizers.normalizers` object (the tokenizer's own code)."""
    from tokenizers import normalizers

    kind = spec.get("type")
    if kind in _FORMS:
        return getattr(normalizers, kind)()
    return normalizers.Sequence([_rust(sub) for sub in spec.get("normalizers", [])])


def _code_points() -> list[str]:
    """Every character of `_RANGES`."""
    return [chr(cp) for lo, hi in _RANGES for cp in range(lo, hi)]


def _differing(python: Callable[[str], str], rust: Callable[[str], str], texts: list[str]) -> list[int]:
    """Indices of `texts` the two normalizers give differently; all texts go through each in
    one call, joined by newlines (a boundary no normalization form crosses or changes)."""
    joined = "\n".join(texts)
    a, b = python(joined), rust(joined)
    if a == b:
        return []
    return [i for i, (x, y) in enumerate(zip(a.split("\n"), b.split("\n"), strict=True)) if x != y]


def disagreeing_code_points(spec: dict) -> frozenset[str]:
    """Characters on whose text the normalizer `spec` by `unicodedata` and by `tokenizers`
    may give different results: each character of `_RANGES` is normalized alone and
    between `_PROBES` marks, and its canonical decomposition by either implementation is
    normalized too (a composition one table knows and the other does not shows only there:
    then the decomposition's characters are included). ~0.4 s, once per process and spec.

    Raises:
        UnsupportedNormalizer: `spec` is not NFC/NFD/NFKC/NFKD or a sequence of them.
    """
    from tokenizers import normalizers

    python = _python(spec)
    if python is None:
        return frozenset()
    rust = _rust(spec).normalize_str
    chars = _code_points()
    found: set[str] = set()
    for probe in _PROBES:
        head, tail = probe.split("{c}")
        found.update(chars[i] for i in _differing(python, rust, [head + c + tail for c in chars]))
    decomposed = "\n".join(chars)
    for nfd in (unicodedata.normalize("NFD", decomposed), normalizers.NFD().normalize_str(decomposed)):
        texts = [t for t, c in zip(nfd.split("\n"), chars, strict=True) if t != c]
        found.update(ch for i in _differing(python, rust, texts) for ch in texts[i] if not ch.isascii())
    return frozenset(found)


_ASTRAL = re.compile("[\U00010000-\U0010ffff]")


@dataclass(frozen=True, slots=True)
class ExactNormalizer:
    """A normalizer whose output equals `tokenizers`' on every text (as far as
    `disagreeing_code_points` finds every character the two disagree on; the load-time
    cross-check and tests/pipeline/test_token_counts.py's fuzz compare whole token ids).

    Attributes:
        python: the normalizer by `unicodedata`, used unless the text holds a disagreeing character.
        rust: the same normalizer by `tokenizers` (the tokenizer's own).
        bmp: a regex class of the disagreeing characters up to U+FFFF (None: there are none).
        astral: the disagreeing characters beyond U+FFFF.
    """

    python: Callable[[str], str]
    rust: Callable[[str], str]
    bmp: re.Pattern[str] | None
    astral: frozenset[str]

    @classmethod
    def build(cls, python: Callable[[str], str], rust: Callable[[str], str], disagreeing: frozenset[str]) -> ExactNormalizer:
        bmp = sorted(c for c in disagreeing if ord(c) < 0x10000)
        pattern = re.compile("[" + "".join(re.escape(c) for c in bmp) + "]") if bmp else None
        return cls(python, rust, pattern, frozenset(c for c in disagreeing if ord(c) >= 0x10000))

    def needs_rust(self, text: str) -> bool:
        """Whether `text` holds a character the two normalizers may disagree on. A regex class
        for the BMP ones (~2-5 ns a character); a set lookup for the rarer ones beyond, only
        when the text has such characters at all (a class holding them runs ~30x slower)."""
        if self.bmp is not None and self.bmp.search(text):
            return True
        return bool(self.astral) and _ASTRAL.search(text) is not None and not self.astral.isdisjoint(text)

    def __call__(self, text: str) -> str:
        return self.rust(text) if self.needs_rust(text) else self.python(text)


@lru_cache(maxsize=8)
def _exact(spec_key: str) -> ExactNormalizer | None:
    spec = json.loads(spec_key)
    python = _python(spec)
    if python is None:
        return None
    return ExactNormalizer.build(python, _rust(spec).normalize_str, disagreeing_code_points(spec))


def exact_normalizer(spec: dict | None) -> ExactNormalizer | None:
    """The `tokenizer.json` normalizer `spec` as an `ExactNormalizer` (None: no normalization).
    Built once per distinct spec and process.

    Raises:
        UnsupportedNormalizer: anything but NFC/NFKC/NFD/NFKD (or a sequence of them).
    """
    if spec is None:
        return None
    return _exact(json.dumps(spec, sort_keys=True))
