#!/usr/bin/env python3
"""In-process costs behind decisions 0200, 0245 and 0246, on Qwen3's built-in tokenizer: the
encoder alone (tiktoken against `tokenizers`), the split regex as the tokenizer writes it against
grouped (`fastbpe.grouped_pattern`), and a one-message chat's render (`apply_chat_template`
against the direct render). Best of `--repeat` rounds of `--number` calls, in ms per call.

    flock /tmp/bench.lock .venv/bin/python scripts/bench_encoder.py [--number 300 --repeat 15]

Texts: prose (README.md's paragraphs), Python source (this package's `tokens.py`), CJK and
whitespace runs, each cut to `--chars` characters; the chat is the prose cut to ~1k tokens.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from pathlib import Path

import tiktoken

from extproc.pipeline.fastbpe import _split_pattern, grouped_pattern
from extproc.pipeline.tokens import TokenCounter

ROOT = Path(__file__).resolve().parent.parent


def best_ms(fn: Callable[[], object], number: int, repeat: int) -> float:
    """The fastest round's time per call (ms)."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1000


def texts(chars: int) -> dict[str, str]:
    prose = " ".join(p for p in (ROOT / "README.md").read_text(encoding="utf-8").split("\n\n") if p[:1].isalpha())
    code = (ROOT / "extproc/pipeline/tokens.py").read_text(encoding="utf-8")
    cjk = "東京の天気は晴れです。我们今天去公园散步，然后吃午饭。서울은 한국의 수도입니다。"
    spaces = "def f():\n    return  1\t\t\n\n   x =   2   \n" + " " * 40 + "\n"
    return {name: (t * (chars // len(t) + 1))[:chars] for name, t in (("prose", prose), ("code", code), ("cjk", cjk), ("whitespace", spaces))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=6000, help="characters per text (6,000 ≈ 1k tokens of prose)")
    ap.add_argument("--number", type=int, default=300, help="calls per round")
    ap.add_argument("--repeat", type=int, default=15, help="rounds; the fastest counts")
    args = ap.parse_args()
    counter = TokenCounter.from_source("builtin:qwen3")
    assert counter._fast is not None, counter.encoder_note
    grouped = counter._fast.encoding
    spec = json.loads(counter.tokenizer.backend_tokenizer.to_str())
    written = tiktoken.Encoding("as-written", pat_str=_split_pattern(spec["pre_tokenizer"]), mergeable_ranks=grouped._mergeable_ranks, special_tokens={})
    backend = counter.tokenizer.backend_tokenizer
    n, r = args.number, args.repeat
    print("| text | chars | tokenizers (ms) | tiktoken, regex as written (ms) | tiktoken, grouped (ms) | grouped speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, text in texts(args.chars).items():
        assert written.encode_ordinary(text) == grouped.encode_ordinary(text)
        ref = best_ms(lambda: backend.encode(text, add_special_tokens=False), n, r)
        as_written = best_ms(lambda: written.encode_ordinary(text), n, r)
        fast = best_ms(lambda: grouped.encode_ordinary(text), n, r)
        print(f"| {name} | {len(text):,} | {ref:.3f} | {as_written:.3f} | {fast:.3f} | {as_written / fast:.2f}× |")
    chat = [{"role": "user", "content": texts(args.chars)["prose"]}]
    apply = best_ms(lambda: counter.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), n, r)
    direct = best_ms(lambda: counter.render_chat(chat), n, r)
    print(f"\nrender of a one-message chat ({len(chat[0]['content']):,} characters): apply_chat_template {apply * 1000:.1f} µs, "
          f"direct ({counter.renderer}) {direct * 1000:.1f} µs")  # fmt: skip


if __name__ == "__main__":
    main()
