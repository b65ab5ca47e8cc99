"""Our chat count path against transformers' own
`apply_chat_template(..., tokenize=True)` (what the engine prefills) on the built-in tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.pipeline.tokens import TokenCounter
from tests.pipeline.segments import segments_by_finditer


@pytest.fixture(scope="module")
def counter(qwen_counter: TokenCounter) -> TokenCounter:
    """The session's Qwen3 counter (loaded once for the whole suite); read only here."""
    return qwen_counter


def reference_ids(counter: TokenCounter, messages, **kwargs) -> list[int]:
    out = counter.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# U+07FD (NKO DANTAYALAN, combining class 220 since Unicode 11) between a letter and an acute:
# Python's unicodedata composes "a"+U+0301 across it, the tokenizer's own NFC does not.
@pytest.mark.parametrize("content", ["a\u07fd\u0301", "caf e\u07fd\u0301 ok", "x\u1df6\u0301", "o\u0c3c\u0308"])
def test_count_matches_reference_with_recent_combining_marks(counter: TokenCounter, content: str) -> None:
    messages = [{"role": "user", "content": content}]
    assert counter.count_chat(messages).token_ids == reference_ids(counter, messages)


def test_count_text_matches_tokenizers_with_recent_combining_marks(counter: TokenCounter) -> None:
    text = "a\u07fd\u0301"
    want = counter.tokenizer.backend_tokenizer.encode(text, add_special_tokens=True).ids
    assert len(counter.count_text(text).token_ids) == len(want)


_ADVERSARIAL = st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<tool_response>", "</tool_response>",
     "<|endoftext|>", "<|im_start", "<", "<<", "|>", "\r\n", "\r", "\n", "\x00", "\t", " ", "   ", "\u00a0", "\u3000",
     "\u2028", "\u0085", "\u200b", "\ufeff", "\x1c", "e\u0301", "\u0301", "\u0323", "\u07fd", "\u1df6", "\u0958",
     "👨\u200d👩\u200d👧", "🏳️\u200d🌈", "東京", "naïve", "'s", "'LL", "123", "١٢٣", "\U0001d7d8", "\U00016d67",
     "ﬁ", "Å", "\u212b", "-->", "{{", "}}", "{%", "\\"]
)  # fmt: skip
_TEXT = st.lists(st.one_of(_ADVERSARIAL, st.text(max_size=6)), max_size=12).map("".join)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": _TEXT})


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_MESSAGE, min_size=1, max_size=4), st.sampled_from([None, True, False]))
def test_fuzz_count_matches_reference(counter: TokenCounter, messages, thinking) -> None:
    """Every text, including text whose NFC Python and the tokenizer disagree on (handled by
    `extproc.pipeline.normalize`). One search: a second run of it restricted to text where the
    two agree (from before that fix) looked at a subset of these inputs."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    try:
        want = reference_ids(counter, messages, **kwargs)
    except Exception:
        return  # lone surrogates: the reference cannot encode them either
    got = counter.count_chat(messages, chat_template_kwargs=kwargs).token_ids
    assert got == want


_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, width=16), _TEXT,
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}), max_size=2),
    st.dictionaries(st.sampled_from(["a", "name", "arguments"]), _TEXT, max_size=2),
)  # fmt: skip
_ANY_MESSAGE = st.dictionaries(
    st.sampled_from(["role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id", "extra"]), _VALUE, max_size=4
).map(lambda d: {"role": "user", **d} if "role" not in d else d) | st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", ""]), "content": _VALUE}
)
_KWARGS = st.dictionaries(st.sampled_from(["enable_thinking", "content", "reasoning_content"]), _VALUE, max_size=2)
_TOOLS = st.none() | st.lists(
    st.one_of(_TEXT, st.just({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})), max_size=2
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ANY_MESSAGE, min_size=1, max_size=4), _KWARGS, _TOOLS, st.booleans())
def test_fuzz_direct_render_equals_apply_chat_template(counter: TokenCounter, messages, kwargs, tools, agp) -> None:
    """Any shape a JSON body can carry: output equal, or the same exception type."""
    import copy

    renderer = counter._renderer
    assert renderer is not None
    try:
        want = counter.tokenizer.apply_chat_template(
            copy.deepcopy(messages), tools=copy.deepcopy(tools), tokenize=False, add_generation_prompt=agp, **copy.deepcopy(kwargs)
        )
    except Exception as exc:
        want_exc = type(exc)
        want = None
    try:
        got = renderer.render(messages, tools=tools, template_kwargs=kwargs, add_generation_prompt=agp)
    except Exception as exc:
        assert want is None and type(exc) is want_exc, f"direct raised {type(exc).__name__}: {exc}; reference gave {want!r:.80}"
        return
    assert want is not None, f"direct rendered where apply_chat_template raised {want_exc.__name__}"
    assert got == want


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(["<", "|", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "im_start", "x", "<<|", "|>", "\n"]), max_size=20).map("".join))
def test_fuzz_str_find_cuts_equal_finditer_cuts(counter: TokenCounter, text: str) -> None:
    assert counter._segments(text) == segments_by_finditer(counter._cut_re, text)
    assert counter.encode(text) == counter.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


_WS = st.sampled_from([" ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\xa0", "\u1680",
                       "\u2000", "\u2007", "\u200a", "\u200b", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\ufeff", "\x00"])  # fmt: skip
_RUN = st.lists(_WS, min_size=1, max_size=60).map("".join)


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.one_of(_RUN, st.sampled_from(["a", "A1", "'s", "'S", "12345", "!?", "東", "é", "\U0001f600", "x-y", "<think>"])), max_size=10).map("".join))
def test_fuzz_whitespace_runs_match_tokenizers(counter: TokenCounter, text: str) -> None:
    assert counter.encode(text) == counter.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_the_disagreeing_set_holds_the_marks_python_and_the_tokenizer_normalize_differently(counter: TokenCounter) -> None:
    """Every character found at load really normalizes differently in some probe, and each
    mark the review found is among them."""
    import unicodedata

    norm = counter._fast.normalize
    found = {c for c in norm.astral} | {c for c in map(chr, range(0x80, 0x10000)) if norm.bmp.search(c)}
    assert {"\u07fd", "\u08cf", "\u0c3c", "\u1abf", "\u1df6", "\U00016ff0"} <= found
    for text in ("a\u07fd\u0301", "x\u1df6\u0301", "o\u0c3c\u0308"):
        assert norm.needs_rust(text) and norm(text) != unicodedata.normalize("NFC", text)
        assert norm(text) == counter.tokenizer.backend_tokenizer.normalizer.normalize_str(text)
    assert not norm.needs_rust("café 東京 😀")
