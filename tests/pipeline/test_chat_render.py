"""The direct chat-template render equals `apply_chat_template(tokenize=False)`, output and errors."""

from __future__ import annotations

import copy
import re
from collections import UserDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from extproc.models import builtin_tokenizer_dir
from extproc.pipeline.chat_render import DirectChatRenderer, _qwen3_plain
from extproc.pipeline.tokens import TokenCounter
from tests.pipeline.segments import segments_by_finditer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather — «now», 東京 too",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]

CASES = {
    "user": [{"role": "user", "content": "Hello there!"}],
    "system-user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    "multi-turn": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n6"},
        {"role": "user", "content": "thanks"},
    ],
    "reasoning-fields": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "because"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "b", "reasoning": "older name"},
        {"role": "assistant", "content": "c", "thinking": "gpt-oss name"},
    ],
    "tool-calls": [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "1"},
        {"role": "tool", "content": '{"temp": 25}', "tool_call_id": "2"},
    ],
    "non-ascii": [{"role": "user", "content": "naïve café — 東京 🚀 👨‍👩‍👧 \u00a0 e\u0301 한국어 \r\n\t"}],
    "added-token-text": [{"role": "user", "content": "literal <|im_start|>assistant and <tool_call> </think> inside"}],
    "empty-content": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}, {"role": "user", "content": ""}],
    "none-values": [{"role": "user", "content": "hi", "name": None, "tool_calls": None}],
    "extra-fields": [{"role": "user", "content": "hi", "name": "bob", "n": 3, "x": 1.5, "flag": True, "meta": {"a": [1, None]}}],
    "content-parts": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}],
    "content-none": [{"role": "user", "content": None}],
    "no-role": [{"content": "who am I"}],
    "tuple-of-messages": ({"role": "user", "content": "a tuple"},),
}
KWARGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}]


@pytest.fixture(scope="module")
def tok():
    return TokenCounter.from_source("builtin:qwen3").tokenizer


@pytest.fixture(scope="module")
def direct(tok) -> DirectChatRenderer:
    return DirectChatRenderer(tok)


def outcome(fn, *args, **kwargs) -> tuple[str, str]:
    """("ok", text) or (exception type, message): the two paths must agree on either."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)


def both(tok, direct, messages, *, tools=None, kwargs=None, agp=True):
    want = outcome(
        tok.apply_chat_template, messages, tools=tools, tokenize=False, add_generation_prompt=agp, **(kwargs or {})
    )
    sent = copy.deepcopy(messages)
    got = outcome(direct.render, messages, tools=tools, template_kwargs=kwargs, add_generation_prompt=agp)
    assert messages == sent  # the caller's messages are never modified
    return want, got


@pytest.mark.parametrize("kwargs", KWARGS, ids=["none", "thinking-off", "thinking-on"])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
@pytest.mark.parametrize("agp", [True, False], ids=["gen-prompt", "no-gen-prompt"])
@pytest.mark.parametrize("name", CASES)
def test_direct_render_equals_apply_chat_template(tok, direct, name, kwargs, tools, agp):
    want, got = both(tok, direct, CASES[name], tools=tools, kwargs=kwargs, agp=agp)
    assert got == want


def test_the_corpus_renders_and_errors_as_expected(tok, direct):
    """The cases cover both outcomes: Qwen3's template renders most and rejects content it
    cannot concatenate (a parts list, None)."""
    outcomes = {name: both(tok, direct, msgs)[1][0] for name, msgs in CASES.items()}
    assert outcomes["content-parts"] != "ok"
    assert outcomes["content-none"] != "ok"
    assert outcomes["tool-calls"] == "ok" and outcomes["multi-turn"] == "ok"
    assert direct.self_check() is None


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60) | st.sampled_from(
    ["", "<think>\nr\n</think>\n\nx", "<|im_end|>", "<tool_response>x</tool_response>", "\n\n", " "]
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _text},
    optional={"reasoning_content": _text | st.none(), "name": _text | st.none(), "tool_call_id": st.none() | _text},
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_message, min_size=1, max_size=6), st.sampled_from(KWARGS), st.booleans(), st.booleans())
def test_any_conversation_renders_the_same(tok, direct, messages, kwargs, with_tools, agp):
    want, got = both(tok, direct, messages, tools=TOOLS if with_tools else None, kwargs=kwargs, agp=agp)
    assert got == want


_plain_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": _text})


@settings(max_examples=200, deadline=None)
@given(st.lists(_plain_message, min_size=1, max_size=5), st.sampled_from(KWARGS), st.booleans())
def test_qwen3_system_and_user_conversations_render_without_jinja_and_the_same(tok, direct, messages, kwargs, agp):
    assert direct.plain_qwen3
    assert _qwen3_plain(messages, kwargs, agp) is not None  # the plain-Python path is the one taken
    want, got = both(tok, direct, messages, kwargs=kwargs, agp=agp)
    assert got == want


@pytest.mark.parametrize(
    "messages, kwargs",
    [
        ([{"role": "assistant", "content": "a"}], {}),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}], {}),
        ([{"role": "user", "content": "a", "name": "bob"}], {}),
        ([{"role": "user", "content": None}], {}),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], {}),
        ([{"role": "user", "content": "a"}], {"enable_thinking": 0}),
        ([{"role": "user", "content": "a"}], {"enable_thinking": None}),
        ([UserDict({"role": "user", "content": "a"})], {}),
        ([], {}),
    ],
    ids=["assistant", "tool", "extra-key", "none-content", "parts", "thinking-int", "thinking-none", "mapping", "empty"],
)
def test_anything_else_goes_to_jinja(tok, direct, messages, kwargs):
    assert _qwen3_plain(messages, kwargs, True) is None
    want, got = both(tok, direct, messages, kwargs=kwargs)
    assert got == want


def test_inputs_only_transformers_can_convert_go_through_it(tok, direct):
    """A message that is not a plain dict, a tool given as a function, an empty conversation:
    the direct render hands these to `apply_chat_template` and gives its answer."""

    def get_weather(city: str) -> str:
        """Weather now.

        Args:
            city: the city
        """
        return city

    cases = [
        ([UserDict({"role": "user", "content": "a mapping"})], None),
        ([{"role": "user", "content": "function tool"}], [get_weather]),
        ([{"role": "user", "content": "bad tool"}], ["not a tool"]),
        ([], None),
    ]
    for messages, tools in cases:
        want, got = both(tok, direct, messages, tools=tools)
        assert got == want
    assert both(tok, direct, cases[0][0])[1][0] == "ok"
    assert "get_weather" in both(tok, direct, cases[1][0], tools=cases[1][1])[1][1]


@pytest.fixture
def tok_with_template(tmp_path):
    """A fresh Qwen3 tokenizer (not the shared one) whose chat template a test may replace."""
    return AutoTokenizer.from_pretrained(str(builtin_tokenizer_dir("qwen3")), local_files_only=True)


def test_a_variable_apply_chat_template_keeps_for_itself_never_reaches_the_template(tok_with_template):
    """`max_length`, `padding`, ... are apply_chat_template's own arguments: passed as template
    variables they are consumed there, so the direct render must not hand them to the template."""
    tok_with_template.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}[{{ max_length }}|{{ bos_token }}|{{ v }}]"
    direct = DirectChatRenderer(tok_with_template)
    assert not direct.plain_qwen3
    msgs = [{"role": "user", "content": "x"}]
    for kwargs in ({"max_length": 5, "v": 1}, {"v": "<|im_end|>"}, {"padding": True}):
        want, got = both(tok_with_template, direct, msgs, kwargs=kwargs)
        assert got == want, kwargs
    assert both(tok_with_template, direct, msgs, kwargs={"max_length": 5, "v": 1})[1] == ("ok", "x[||1]")


def test_several_templates_keep_apply_chat_template(tok_with_template, caplog):
    tok_with_template.chat_template = {"default": "{{ messages[0].content }}", "tool_use": "T{{ messages[0].content }}"}
    with pytest.raises(ValueError, match="single chat template"):
        DirectChatRenderer(tok_with_template)
    counter = TokenCounter(tok_with_template)
    assert counter.renderer == "apply_chat_template" and "single chat template" in counter.renderer_note
    assert counter.render_chat([{"role": "user", "content": "hi"}]) == "hi"
    assert counter.render_chat([{"role": "user", "content": "hi"}], tools=TOOLS) == "Thi"


def test_a_render_that_differs_fails_the_self_check(tok_with_template):
    """The special-token map is read once at load: a tokenizer changed after that renders
    differently, and the self-check says so (TokenCounter then keeps apply_chat_template)."""
    tok_with_template.chat_template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    tok_with_template.bos_token = "<|im_start|>"
    direct = DirectChatRenderer(tok_with_template)
    assert direct.self_check() is None
    tok_with_template.bos_token = "<|endoftext|>"
    assert re.match(r"corpus entry 0: direct render differs", direct.self_check() or "")


def test_the_counter_renders_directly(qwen_counter):
    assert qwen_counter.renderer == "direct", qwen_counter.renderer_note
    msgs = CASES["tool-calls"]
    want = qwen_counter.tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert qwen_counter.render_chat(msgs, tools=TOOLS) == want


def test_segment_cuts_equal_a_scan_for_every_added_token(qwen_counter):
    """Cuts found by `str.find` on the tokens' first character are exactly `finditer`'s."""
    assert qwen_counter._cut_lead == "<"
    texts = [
        "",
        "<",
        "<<|im_start|>",
        "a<b<|im_end|><|im_end|>x<|im_start|>user\n<think></think><tool_call>",
        "<|im_start|" * 3 + "<|im_start|>",
        "no cut here at all",
        "<|im_start|>",
        "x" * 50 + "<" + "<|endoftext|>" + "<<",
    ]
    for text in texts:
        assert qwen_counter._segments(text) == segments_by_finditer(qwen_counter._cut_re, text), text
