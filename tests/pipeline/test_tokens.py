"""Token counts equal what the engine sees: the tokenizer's own chat-template tokenization."""

from __future__ import annotations

import json
import logging
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.errors import BadRequestError
from extproc.models import builtin_tokenizer_dir
from extproc.pipeline.fastbpe import UnsupportedTokenizer, build_fast_encoder, cross_check_corpus
from extproc.pipeline.tokens import TokenCounter, TokenizerLoadError
from tests.conftest import altered_qwen_tokenizer, drop_merge

CONVERSATIONS = {
    "single-user": [{"role": "user", "content": "Hello there!"}],
    "system-user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    "multi-turn-with-think": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "special-token-text-in-content": [{"role": "user", "content": "literal <|im_start|> and <tool_call> inside"}],
    "unicode": [{"role": "user", "content": "naïve café — 東京 🚀 \u00a0 e\u0301"}],
    "empty-content": [{"role": "user", "content": ""}],
    "long": [{"role": "user", "content": "lorem ipsum dolor sit amet " * 2000}],
}


@pytest.fixture(scope="module", params=["tiktoken", "tokenizers"])
def counter(request, qwen_counter) -> TokenCounter:
    """The Qwen3 counter with each encoder: the fast one (cross-checked at load) and the
    reference `tokenizers` one; every exactness test below runs on both."""
    if request.param == "tiktoken":
        assert qwen_counter.encoder == "tiktoken", qwen_counter.encoder_note
        return qwen_counter
    reference = TokenCounter.from_source("builtin:qwen3", encoder="tokenizers")
    assert reference.encoder == "tokenizers"
    return reference


def reference(counter: TokenCounter, messages, **kw) -> list[int]:
    return counter.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True, **kw)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_count_equals_apply_chat_template(counter, name):
    msgs = CONVERSATIONS[name]
    ref = reference(counter, msgs)
    got = counter.count_chat(msgs)
    assert got.token_ids == ref
    # A second time is served from the segment cache and must not change the answer.
    assert counter.count_chat(msgs).token_ids == ref


def test_tools_rendered_into_the_prompt(counter):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    with_tools = counter.count_chat(msgs, tools=tools)
    assert with_tools.token_ids == reference(counter, msgs, tools=tools)
    assert with_tools.count > counter.count_chat(msgs).count + 20


def test_chat_template_kwargs_passed_through(counter):
    msgs = [{"role": "user", "content": "hi"}]
    off = counter.count_chat(msgs, chat_template_kwargs={"enable_thinking": False})
    assert off.token_ids == reference(counter, msgs, enable_thinking=False)
    assert off.count != counter.count_chat(msgs).count  # Qwen3 adds an empty think block


def test_multi_turn_history_hits_the_cache(counter):
    history = [{"role": "user", "content": f"question {i} " * 50} for i in range(6)]
    counter.count_chat(history)
    before = counter.cache_stats()
    counter.count_chat(history + [{"role": "user", "content": "a brand new follow-up question"}])
    after = counter.cache_stats()
    assert after["hits"] - before["hits"] >= len(history)
    # Only the new message segment (and the generation prompt, if new) were tokenized afresh.
    assert after["misses"] - before["misses"] <= 2


def test_completion_prompt_matches_plain_tokenization(counter):
    text = "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n"
    assert counter.count_text(text).token_ids == counter.tokenizer(text)["input_ids"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=200), min_size=1, max_size=4))
def test_any_text_counts_exactly(counter, contents):
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "ok"})
    assert counter.count_chat(msgs).token_ids == reference(counter, msgs)


def test_template_rejection_is_a_bad_request(counter):
    with pytest.raises(BadRequestError):
        counter.count_chat([{"role": "user", "content": None}])  # the template concatenates content


@pytest.mark.parametrize("source", ["builtin:llama9", "/nonexistent/tokenizer"], ids=["unknown-builtin", "missing-dir"])
def test_bad_tokenizer_source(source):
    with pytest.raises(TokenizerLoadError) as info:
        TokenCounter.from_source(source)
    assert source.split(":")[-1] in str(info.value)


def test_tokenizer_path_under_home(tmp_path, monkeypatch):
    # `~` is the user's home, as for a model's `architecture` path (which expanded it while a
    # tokenizer's `~/...` was refused as missing: one config, two rules).
    shutil.copytree(builtin_tokenizer_dir("qwen3"), tmp_path / "tok")
    monkeypatch.setenv("HOME", str(tmp_path))
    counter = TokenCounter.from_source("~/tok")
    reference = TokenCounter.from_source("builtin:qwen3")
    assert counter.count_text("Hello there").token_ids == reference.count_text("Hello there").token_ids


# --- the fast encoder and its load-time cross-check ------------------------------------------


def test_the_cross_check_corpus_covers_what_tokenizers_differ_on(qwen_counter):
    """The corpus has CJK, emoji, code, whitespace runs, non-NFC text and every added token, and
    the fast encoder agrees with `tokenizers` on all of it (whole texts, added tokens included)."""
    added = list(qwen_counter._added_ids)
    assert {"<|im_start|>", "<think>", "</tool_call>"} <= set(added)
    corpus = cross_check_corpus(added)
    joined = "".join(corpus)
    for needle in ("你好", "한국어", "😀", "👨\u200d👩", "def fib", "\r\n", "   \n", "e\u0301", "\u212b", *added):
        assert needle in joined
    assert unicodedata.normalize("NFC", joined) != joined  # non-NFC text is in it
    backend = qwen_counter.tokenizer.backend_tokenizer
    for text in corpus:
        assert qwen_counter.encode(text) == backend.encode(text, add_special_tokens=False).ids, text


def test_an_altered_tokenizer_fails_the_cross_check_and_keeps_tokenizers(tmp_path, caplog):
    """Dropping the merge `i` + `n` leaves the vocabulary (tiktoken's ranks) as it was but changes
    what `tokenizers` does with every word holding "in": the cross-check must catch it, and the
    counts stay `tokenizers`' own."""

    with caplog.at_level(logging.WARNING, logger="extproc.pipeline.tokens"):
        counter = TokenCounter.from_source(str(altered_qwen_tokenizer(tmp_path, drop_merge("i", "n"))))
    assert counter.encoder == "tokenizers"
    assert counter.encoder_note.startswith("cross-check failed")
    assert [r.levelno for r in caplog.records if "cross-check failed" in r.getMessage()] == [logging.WARNING]
    msgs = [{"role": "user", "content": "nothing in the inn is interesting"}]
    assert counter.count_chat(msgs).token_ids == reference(counter, msgs)


def test_an_unsupported_normalizer_keeps_tokenizers():
    """What the loaded tokenizer does is what counts (transformers' Qwen2Tokenizer rebuilds its
    normalizer and pre-tokenizer itself, whatever tokenizer.json says): a backend given a
    Lowercase normalizer is not one tiktoken can run."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(builtin_tokenizer_dir("qwen3")), local_files_only=True)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    counter = TokenCounter(tok)
    assert counter.encoder == "tokenizers"
    assert "Lowercase" in counter.encoder_note
    assert counter.count_text("HeLLo World").token_ids == tok("HeLLo World")["input_ids"]


def test_build_refuses_ids_out_of_merge_order():
    data = json.loads((builtin_tokenizer_dir("qwen3") / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    vocab["in"], vocab["er"] = vocab["er"], vocab["in"]  # two early merges' results swap ids
    with pytest.raises(UnsupportedTokenizer, match="merge order"):
        build_fast_encoder(data)


def test_unknown_encoder_is_refused(qwen_counter):
    with pytest.raises(ValueError, match="encoder"):
        TokenCounter(qwen_counter.tokenizer, encoder="fast")


def test_the_split_pattern_is_grouped_and_still_exact(qwen_counter):
    """tiktoken runs Qwen3's pattern with its plain alternatives in one group (fancy-regex then
    calls the `regex` crate once per match, not once per alternative): the same pre-tokens, so
    the same ids as with the pattern as written, on the cross-check corpus and on prose."""
    import tiktoken

    from extproc.pipeline.fastbpe import GPT2_PATTERN, grouped_pattern

    tail = r"|\s+(?!\S)|\s+"
    encoding = qwen_counter._fast.encoding
    assert encoding._pat_str.startswith("(?:") and encoding._pat_str.endswith(")" + tail)
    written = json.loads((builtin_tokenizer_dir("qwen3") / "tokenizer.json").read_text(encoding="utf-8"))
    pattern = written["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    assert encoding._pat_str == grouped_pattern(pattern) != pattern
    as_written = tiktoken.Encoding("as-written", pat_str=pattern, mergeable_ranks=encoding._mergeable_ranks, special_tokens={})
    texts = cross_check_corpus(list(qwen_counter._added_ids)) + ["a  b   c\n  d\t\t e " * 20, "  x", "x  ", " ", ""]
    for text in texts:
        assert encoding.encode_ordinary(text) == as_written.encode_ordinary(text), text
    assert grouped_pattern(GPT2_PATTERN).startswith("(?:'s|")
    for untouched in [r"a|\s+", r"\|\s+(?!\S)|\s+", r"(?x)a b|\s+(?!\S)|\s+", tail]:
        assert grouped_pattern(untouched) == untouched


def test_the_segment_cache_is_bounded_in_bytes_and_still_exact(counter):
    """Bounded at 4M tokens held as lists of ints (~42 bytes a token), the cache grew a server
    by ~5.6 MB per 1,000 unique prompts; now the ids are packed (4 bytes a token) and the bound
    is in bytes, every entry counted."""
    import sys

    from extproc.pipeline.tokens import TokenCounter, cache_entry_bytes

    small = TokenCounter(counter.tokenizer, cache_bytes=1 << 20)
    for i in range(600):
        msgs = [{"role": "system", "content": f"policy {i} " * 40}, {"role": "user", "content": f"unique question {i} " * 30}]
        small.count_chat(msgs)
        stats = small.cache_stats()
        assert stats["bytes"] <= 1 << 20
    assert stats["limit_bytes"] == 1 << 20 and stats["entries"] > 50
    held = sum(cache_entry_bytes(seg, ids) for seg, ids in small._cache.items())  # noqa: SLF001 - the accounting itself
    assert held == stats["bytes"] and all(ids.itemsize == 4 for ids in small._cache.values())  # noqa: SLF001
    assert stats["bytes"] < 4 * stats["tokens"] + sum(sys.getsizeof(s) for s in small._cache) + 400 * stats["entries"]  # noqa: SLF001
    history = [{"role": "user", "content": "cached once " * 20}]
    assert small.count_chat(history).token_ids == small.count_chat(history).token_ids == reference(small, history)
