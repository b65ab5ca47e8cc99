"""Token counts equal what the engine sees: the tokenizer's own chat-template tokenization."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.errors import BadRequestError
from extproc.pipeline.tokens import TokenCounter, TokenizerLoadError

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


def reference(counter: TokenCounter, messages, **kw) -> list[int]:
    return counter.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True, **kw)


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_chat_count_equals_apply_chat_template(qwen_counter, name):
    msgs = CONVERSATIONS[name]
    ref = reference(qwen_counter, msgs)
    got = qwen_counter.count_chat(msgs)
    assert got.token_ids == ref
    # A second time is served from the segment cache and must not change the answer.
    assert qwen_counter.count_chat(msgs).token_ids == ref


def test_tools_rendered_into_the_prompt(qwen_counter):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    with_tools = qwen_counter.count_chat(msgs, tools=tools)
    assert with_tools.token_ids == reference(qwen_counter, msgs, tools=tools)
    assert with_tools.count > qwen_counter.count_chat(msgs).count + 20


def test_chat_template_kwargs_passed_through(qwen_counter):
    msgs = [{"role": "user", "content": "hi"}]
    off = qwen_counter.count_chat(msgs, chat_template_kwargs={"enable_thinking": False})
    assert off.token_ids == reference(qwen_counter, msgs, enable_thinking=False)
    assert off.count != qwen_counter.count_chat(msgs).count  # Qwen3 adds an empty think block


def test_multi_turn_history_hits_the_cache(qwen_counter):
    history = [{"role": "user", "content": f"question {i} " * 50} for i in range(6)]
    qwen_counter.count_chat(history)
    before = qwen_counter.cache_stats()
    qwen_counter.count_chat(history + [{"role": "user", "content": "a brand new follow-up question"}])
    after = qwen_counter.cache_stats()
    assert after["hits"] - before["hits"] >= len(history)
    # Only the new message segment (and the generation prompt, if new) were tokenized afresh.
    assert after["misses"] - before["misses"] <= 2


def test_completion_prompt_matches_plain_tokenization(qwen_counter):
    text = "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\n"
    assert qwen_counter.count_text(text).token_ids == qwen_counter.tokenizer(text)["input_ids"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=200), min_size=1, max_size=4))
def test_any_text_counts_exactly(qwen_counter, contents):
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "ok"})
    assert qwen_counter.count_chat(msgs).token_ids == reference(qwen_counter, msgs)


def test_template_rejection_is_a_bad_request(qwen_counter):
    with pytest.raises(BadRequestError):
        qwen_counter.count_chat([{"role": "user", "content": None}])  # the template concatenates content


@pytest.mark.parametrize("source", ["builtin:llama9", "/nonexistent/tokenizer"], ids=["unknown-builtin", "missing-dir"])
def test_bad_tokenizer_source(source):
    with pytest.raises(TokenizerLoadError) as info:
        TokenCounter.from_source(source)
    assert source.split(":")[-1] in str(info.value)
