"""A fast encoder for byte-level BPE tokenizers, built from the model's own `tokenizer.json`.

Qwen2/2.5/3, Llama 3 and other GPT-2-style tokenizers are a normalizer (none or NFC), a regex
split (the `Split` pre-tokenizer, or `ByteLevel` with its GPT-2 regex), a byte-level alphabet
(GPT-2's byte-to-unicode table) and a BPE model whose merges are learned in the order of the
vocabulary ids. `tiktoken` runs exactly that (a regex split, then BPE by rank on raw bytes) in
Rust, ~7× faster than `tokenizers` on English prose, 12× on digit runs, about even on long CJK
runs without punctuation (docs/decisions/0200), so we hand it:

- the ranks: each vocabulary entry turned back into its bytes (the GPT-2 table inverted) and
  ranked by its id, which is also the id tiktoken returns;
- the split regex, as written in `tokenizer.json` (tiktoken's `fancy-regex` accepts the
  Oniguruma patterns these models use: `\\p{L}`, `(?i:...)`, look-ahead);
- nothing else: added tokens are cut out before (`TokenCounter` splits at them already) and
  the normalizer is applied to the text between them, as `tokenizers` does.

Equivalence is not assumed: `build_fast_encoder` refuses anything outside that shape with a
reason, and `cross_check` compares the result with `tokenizers` on a built-in corpus (CJK,
emoji, code, whitespace runs, non-NFC text, every added token). `TokenCounter` uses the fast
encoder only when both pass; otherwise it keeps `tokenizers` and says why.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.pipeline.normalize import UnsupportedNormalizer, exact_normalizer

__all__ = ["FastEncoder", "UnsupportedTokenizer", "build_fast_encoder", "cross_check", "cross_check_corpus"]

# GPT-2's pre-tokenizer regex, used by `ByteLevel(use_regex=True)` (tokenizers' byte_level.rs).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class UnsupportedTokenizer(ValueError):
    """The tokenizer is not a plain byte-level BPE with a regex split (the reason says which part)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (openai/gpt-2 encoder.py, also tokenizers'
    byte_level.rs): printable Latin-1 bytes map to themselves, the rest to U+0100 onwards."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_TO_LATIN1 = {ord(c): b for c, b in _UNICODE_TO_BYTE.items()}  # str.translate table: alphabet → Latin-1 code point


def _normalizer(spec: dict | None) -> Callable[[str], str] | None:
    """The text normalizer of a `tokenizer.json` (None: no normalization), giving exactly what
    `tokenizers` gives (Python's and the tokenizer's Unicode tables differ: see
    `extproc.pipeline.normalize`).

    Raises:
        UnsupportedTokenizer: anything but NFC/NFKC/NFD/NFKD (or a sequence of them).
    """
    try:
        return exact_normalizer(spec)
    except UnsupportedNormalizer as exc:
        raise UnsupportedTokenizer(str(exc)) from None


def _split_pattern(spec: dict | None) -> str:
    """The regex that splits text into pre-tokens, from the `pre_tokenizer` section.

    Accepted: `Sequence[Split(Regex, Isolated, invert=false), ByteLevel(add_prefix_space=false,
    use_regex=false)]` (Qwen2/3, Llama 3) or a lone `ByteLevel(add_prefix_space=false,
    use_regex=true)` (GPT-2 style).

    Raises:
        UnsupportedTokenizer: any other shape.
    """
    if spec is None:
        raise UnsupportedTokenizer("no pre_tokenizer")
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]
    if not steps or steps[-1].get("type") != "ByteLevel":
        raise UnsupportedTokenizer("the pre_tokenizer does not end with ByteLevel")
    byte_level = steps[-1]
    if byte_level.get("add_prefix_space"):
        raise UnsupportedTokenizer("ByteLevel add_prefix_space is not supported")
    splits = steps[:-1]
    if not splits:
        if not byte_level.get("use_regex", True):
            raise UnsupportedTokenizer("ByteLevel without a regex and no Split: nothing splits the text")
        return GPT2_PATTERN
    if len(splits) != 1 or byte_level.get("use_regex", True):
        raise UnsupportedTokenizer("only one Split before a ByteLevel without its own regex is supported")
    split = splits[0]
    pattern = split.get("pattern") or {}
    if split.get("type") != "Split" or "Regex" not in pattern:
        raise UnsupportedTokenizer(f"pre-tokenizer {split.get('type')!r} is not a regex Split")
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise UnsupportedTokenizer("only Split(behavior=Isolated, invert=false) is supported")
    return pattern["Regex"]


_LOOKAHEAD_TAIL = r"|\s+(?!\S)|\s+"
_BARE_FLAGS = re.compile(r"\(\?[a-zA-Z-]+\)")


def grouped_pattern(pattern: str) -> str:
    r"""`pattern` with every alternative before its trailing `\s+(?!\S)|\s+` in one
    non-capturing group, or `pattern` itself when it has no such tail.

    The same regex (ordered alternation is associative: `(?:A|B)|C` tries A, then B, then C at
    each position, as `A|B|C` does), ~1.15-1.6× faster in tiktoken: fancy-regex runs a pattern
    with a lookahead in its backtracking VM, calling the `regex` crate once per plain
    alternative at each match; grouped, it calls it once for all of them (measured on Qwen3's
    pattern: prose, code, CJK, whitespace runs; docs/decisions/0246). Not done when the head
    ends in a backslash (the `|` would be escaped) or sets bare inline flags such as `(?x)`,
    which would then stop at the group's end.
    """
    if not pattern.endswith(_LOOKAHEAD_TAIL):
        return pattern
    head = pattern[: -len(_LOOKAHEAD_TAIL)]
    if not head or (len(head) - len(head.rstrip("\\"))) % 2 or _BARE_FLAGS.search(head):
        return pattern
    return f"(?:{head}){_LOOKAHEAD_TAIL}"


def _ranks(model: dict) -> dict[bytes, int]:
    """bytes → rank (= token id) for tiktoken, from a byte-level BPE `model` section.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; `tokenizers`
    merges the pair listed first in `merges`. They agree when each merge's result has a larger
    id than every earlier merge's result, which is checked here.

    Raises:
        UnsupportedTokenizer: not a plain BPE, a vocabulary entry outside the byte-level
            alphabet, or ids out of merge order.
    """
    if model.get("type") != "BPE":
        raise UnsupportedTokenizer(f"model type {model.get('type')!r} is not BPE")
    for key in ("dropout", "unk_token"):
        if model.get(key) is not None:
            raise UnsupportedTokenizer(f"BPE {key} is not supported")
    if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise UnsupportedTokenizer("BPE byte_fallback / subword prefix / word suffix are not supported")
    vocab: dict[str, int] = model["vocab"]
    stray = set("".join(vocab)) - _UNICODE_TO_BYTE.keys()
    if stray:
        raise UnsupportedTokenizer(f"vocabulary characters {sorted(stray)[:5]!r} are not in the byte-level alphabet")
    ranks = {token.translate(_TO_LATIN1).encode("latin-1"): token_id for token, token_id in vocab.items()}
    if len(ranks) != len(vocab) or len(set(ranks.values())) != len(ranks):
        raise UnsupportedTokenizer("the vocabulary maps two entries to the same bytes or id")
    last = -1
    for merge in model.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right)
        if merged is None:
            raise UnsupportedTokenizer(f"merge {left!r} + {right!r} gives a token not in the vocabulary")
        if merged <= last:
            raise UnsupportedTokenizer("vocabulary ids are not in merge order (tiktoken ranks by id)")
        last = merged
    return ranks


@dataclass(frozen=True, slots=True)
class FastEncoder:
    """tiktoken's byte-level BPE core with the model's normalizer and split regex.

    Attributes:
        encoding: the `tiktoken.Encoding` (no special tokens of its own).
        normalize: the text normalizer (None: none).
    """

    encoding: Any
    normalize: Callable[[str], str] | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, which must hold no added token (the caller cuts them out).
        Releases the GIL while encoding."""
        if self.normalize is not None and not text.isascii():
            text = self.normalize(text)
        return self.encoding.encode_ordinary(text)


def build_fast_encoder(tokenizer_json: dict | str | Path) -> FastEncoder:
    """A `FastEncoder` from a parsed `tokenizer.json` (or its path).

    Raises:
        UnsupportedTokenizer: the tokenizer is not of the supported shape (the reason says why),
            or tiktoken is not installed or rejects the regex.
    """
    if not isinstance(tokenizer_json, dict):
        tokenizer_json = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    try:
        import tiktoken
    except ImportError:
        raise UnsupportedTokenizer("tiktoken is not installed") from None
    normalize = _normalizer(tokenizer_json.get("normalizer"))
    pattern = _split_pattern(tokenizer_json.get("pre_tokenizer"))
    ranks = _ranks(tokenizer_json.get("model") or {})
    for added in tokenizer_json.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word") or added.get("normalized"):
            # TokenCounter does not cut at these, and they interact with their neighbours.
            raise UnsupportedTokenizer(f"added token {added.get('content')!r} has lstrip/rstrip/single_word/normalized set")
    try:
        encoding = tiktoken.Encoding("tokenizer.json", pat_str=grouped_pattern(pattern), mergeable_ranks=ranks, special_tokens={})
    except Exception as exc:  # tiktoken raises ValueError for a regex fancy-regex cannot compile
        raise UnsupportedTokenizer(f"tiktoken rejected the tokenizer: {exc}") from None
    return FastEncoder(encoding, normalize)


# --- the cross-check -----------------------------------------------------------------------

_CORPUS = [
    "Hello, world! How's it going? I'M FINE, THEY'LL SEE, YOU'RE, WE'VE, I'D, IT'S.",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159 -42 1e-9 0x1F 2026-12-01T00:00:00Z",
    "   leading spaces, trailing spaces   \n\n\n  \t\tindented\ttabs\r\n\r\nwindows lines\r\n   \n \n",
    "a  b   c    d     e\u00a0f\u2003g\u3000h\u200bi\ufeffj",
    "你好，世界！今天天气怎么样？我们来讨论一下大型语言模型的推理优化。",
    "日本語のテキスト：東京タワーは高さ333メートルです。カタカナ、ひらがな、漢字。",
    "한국어 텍스트입니다. 안녕하세요! 대규모 언어 모델.",
    "Emoji: 😀🙂👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ ✨🚀 🏳️‍🌈 and text after 🤖.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}\n',
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%o''brien%';  -- comment",
    "<div class=\"x\">&nbsp;&amp;</div> <!-- html --> https://example.com/a?b=c&d=e#f",
    # non-NFC input: decomposed accents, Hangul jamo, compatibility characters, the Ångström sign
    "e\u0301cole cafe\u0301 nai\u0308ve \u1100\u1161\u11a8 \u212b \u2126 \ufb01 \u00c5 A\u030a",
    # marks Python's Unicode tables know and the tokenizer's older ones do not (normalize.py)
    "a\u07fd\u0301 cafe\u07fd\u0301 x\u1df6\u0301 o\u0c3c\u0308 a\u1ac1\u0323 e\u08d3\u0301 u\u1df9\u0300",
    "Ελληνικά κείμενα. Русский текст, ёжик. עברית. العربية: مرحبا بالعالم.",
    "हिन्दी पाठ। தமிழ். ภาษาไทย ไม่มีช่องว่าง. ជំរាបសួរ",
    "Math: ∑_{i=1}^{n} x_i² ≤ ∞, α+β=γ, ∀x∈ℝ. Fractions ½ ¼. Superscripts x⁰¹²³.",
    "Control \x00\x01\x07\x1b[31mred\x1b[0m and \x7f\x80\u0085 and lone surrogate-free text.",
    "!!!???... --- ___ *** ### @@@ $$$ %%% ^^^ &&& ((())) [[[]]] {{{}}} ''' \"\"\" ``` ~~~",
    "   \n",
    " ",
    "\n\n\n\n\n",
    "Mixed 123abc456 ABC'S don't 'quoted' \"double\" it’s ’curly’ ‘quotes’.",
    "Long number 12345678901234567890123456789012345678901234567890 and ０１２ full-width.",
]


def cross_check_corpus(added_tokens: Sequence[str], seed: int = 0, random_texts: int = 60) -> list[str]:
    """The built-in corpus: fixed texts (CJK, emoji, code, whitespace runs, non-NFC text, ...),
    each added token alone and between text, and seeded random mixes of all of them.

    Args:
        added_tokens: the tokenizer's added tokens (their text).
        seed: seed of the random mixes.
        random_texts: number of random mixes.
    """
    texts = list(_CORPUS)
    for tok in added_tokens:
        texts += [tok, f"text{tok}text", f" {tok} ", f"\n{tok}\n你好{tok}😀", tok + tok]
    texts.append("".join(added_tokens))
    rng = random.Random(seed)
    words = [w for t in _CORPUS for w in re.split(r"(\s+)", t) if w] + list(added_tokens)
    for _ in range(random_texts):
        texts.append("".join(rng.choice(words) for _ in range(rng.randint(1, 40))))
        # random code points, surrogates excluded
        texts.append("".join(chr(rng.choice((rng.randint(0x20, 0x7E), rng.randint(0xA0, 0xD7FF), rng.randint(0x1F300, 0x1FAFF))))
                             for _ in range(rng.randint(1, 30))))  # fmt: skip
    return texts


def cross_check(encode: Callable[[str], list[int]], reference: Callable[[str], list[int]], texts: Iterable[str]) -> str | None:
    """Compare two encoders on `texts`; None when they agree, else a description of the first
    text where they differ (for the log)."""
    for text in texts:
        got, want = encode(text), reference(text)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return f"differs from tokenizers on {text[:60]!r} at token {at} ({len(got)} vs {len(want)} tokens)"
    return None
