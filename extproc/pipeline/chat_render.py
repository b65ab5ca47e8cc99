"""The chat template rendered straight from transformers' compiled template.

`tokenizer.apply_chat_template(..., tokenize=False)` costs ~55 µs for a one-message chat here,
of which the Jinja render is ~29 µs: the rest is transformers' wrapping, done again on every
call (template lookup, a deep copy of the messages through two converters, the special-token
map rebuilt, keyword plumbing). `DirectChatRenderer` does the same render with the same
compiled template object (`transformers.utils.chat_template_utils._compile_jinja_template`:
transformers' own sandboxed environment, filters, globals and extensions) and the same
variables, with the per-request work cut to what a chat parsed from JSON needs:

- the special-token map (`bos_token`, `eos_token`, ...) read once at load;
- messages that are plain `dict`s with `str` keys, whose values are exact `str`/`int`/`float`/
  `bool`, are passed as they are, less their `None` values (what transformers'
  `_normalize_chat_messages` and `_plain_template_data` give for such data: an equal copy; the
  template cannot modify them, the environment is immutable); any other value goes through
  transformers' own two converters; reasoning fields are aliased by transformers' own function;
- `tools` that are dicts go through transformers' `_plain_template_data`, as there.

Anything else — a template chosen from several (a dict of templates), an empty conversation,
a message that is not a `dict`, a tool that is not a dict, a template variable that
`apply_chat_template` or `render_jinja_template` would take as its own argument — is handed to
`apply_chat_template` itself, so its output and its errors are transformers' own.

One template goes further: Qwen3's (recognized by its sha256), for conversations of system and
user messages with string content and no tools, is rendered by a few lines of Python that
write what its branches write for that input (`_qwen3_plain`: ~1 µs against Jinja's ~27 µs);
any other conversation takes the Jinja render above. A built-in
corpus of conversations is rendered both ways at load (`self_check`): one difference and the
tokenizer keeps `apply_chat_template` (docs/decisions/0245).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["DirectChatRenderer", "RENDER_CHECK_CORPUS"]

log = logging.getLogger(__name__)

_SCALARS = (str, int, float, bool)

QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
"""sha256 of Qwen3's chat template (the hybrid-thinking one shipped with Qwen3-0.6B...-32B and
the built-in `qwen3` tokenizer), the one template with a plain-Python render of its simplest
conversations (`_qwen3_plain`)."""

RENDER_CHECK_CORPUS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there!"}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}]},
    {"messages": [{"role": "user", "content": ""}]},
    {"messages": [{"role": "user", "content": "naïve café — 東京 🚀 \u00a0 e\u0301 <|im_start|> <tool_call>"}]},
    {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "add again"},
            {"role": "user", "content": "thanks", "name": "bob", "extra": None},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "d",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    },
    {"messages": [{"role": "user", "content": "hi"}], "kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
]
"""Conversations rendered both ways at load: every role, multi-turn, reasoning in both forms,
tool calls and results, tools, `None` values, non-ASCII text and added-token text, empty
content, a template variable, no generation prompt. (Variables a template does not read are
ignored by it, so one list serves every template.)"""


def _own_arguments() -> frozenset[str]:
    """Keyword names `apply_chat_template` and `render_jinja_template` keep for themselves: a
    template variable of that name never reaches the template through them."""
    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    names: set[str] = set()
    for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
        names.update(
            p.name for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
        )
    return frozenset(names | {"messages", "documents"})


class DirectChatRenderer:
    """Renders one tokenizer's chat template as `apply_chat_template(tokenize=False)` does.

    Args:
        tokenizer: a transformers tokenizer with a chat template.

    Raises:
        ValueError: the template cannot be rendered directly (no single template string, or
            transformers lacks the functions this relies on); the reason is the message.
    """

    def __init__(self, tokenizer: Any) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ValueError("the tokenizer has no single chat template string")
        try:
            from transformers.utils.chat_template_utils import (
                _alias_reasoning_fields,
                _compile_jinja_template,
                _message_objects_to_dicts,
                _plain_template_data,
            )
        except ImportError as exc:
            raise ValueError(f"transformers lacks a function the direct render uses: {exc}") from None
        self._tok = tokenizer
        self._compiled = _compile_jinja_template(template)
        self._plain: Callable[[Any], Any] = _plain_template_data
        self._to_dicts: Callable[[Any], Any] = _message_objects_to_dicts
        self._alias: Callable[[list[dict]], list[dict]] = _alias_reasoning_fields
        self._special: dict[str, Any] = _plain_template_data(dict(tokenizer.special_tokens_map))
        self._own = _own_arguments()
        self.plain_qwen3 = hashlib.sha256(template.encode()).hexdigest() == QWEN3_TEMPLATE_SHA256
        """True when the template is Qwen3's, whose system/user-only conversations are rendered
        by `_qwen3_plain` without Jinja."""

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The rendered prompt text (what `apply_chat_template(messages, tools=tools,
        tokenize=False, add_generation_prompt=..., **template_kwargs)` returns).

        Raises:
            whatever the template or `apply_chat_template` raises (jinja2 `TemplateError`,
            `TypeError`, `ValueError`) for the conversation.
        """
        if self.plain_qwen3 and not tools:
            text = _qwen3_plain(messages, template_kwargs, add_generation_prompt)
            if text is not None:
                return text
        chat = self._chat(messages)
        tool_schemas = None
        if tools is not None:
            if any(type(t) is not dict for t in tools):
                chat = None
            else:
                tool_schemas = self._plain(list(tools))
        variables = self._special
        if template_kwargs:
            if not self._own.isdisjoint(template_kwargs):
                chat = None
            else:
                variables = {**variables, **self._plain(dict(template_kwargs))}
        if chat is None:
            return self._tok.apply_chat_template(
                list(messages),
                tools=list(tools) if tools is not None else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        return self._compiled.render(
            messages=self._alias(chat),
            tools=tool_schemas,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def _chat(self, messages: Sequence[Any]) -> list[dict[str, Any]] | None:
        """The messages as transformers hands them to the template (`None` values dropped,
        non-scalar values converted by its own functions), or None where only
        `apply_chat_template` itself can say (not a list of dicts with str keys, empty)."""
        if not messages or type(messages) not in (list, tuple):
            return None
        out = []
        plain, to_dicts = self._plain, self._to_dicts
        for message in messages:
            if type(message) is not dict:
                return None
            copy = {}
            for key, value in message.items():
                if type(key) is not str:
                    return None
                if value is None:
                    continue
                copy[key] = value if type(value) in _SCALARS else plain(to_dicts(value))
            out.append(copy)
        return out

    def self_check(self, corpus: Sequence[Mapping[str, Any]] = RENDER_CHECK_CORPUS) -> str | None:
        """Render each corpus entry both ways; None when all agree, else what differed first
        (an entry the template rejects must be rejected both ways)."""
        for i, case in enumerate(corpus):
            messages = case["messages"]
            tools = case.get("tools")
            kwargs = case.get("kwargs") or {}
            agp = case.get("add_generation_prompt", True)
            try:
                want: str | None = self._tok.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=agp, **kwargs
                )
            except Exception as exc:  # the template may refuse a role or a field
                want = None
                want_error = type(exc)
            try:
                got: str | None = self.render(messages, tools=tools, template_kwargs=kwargs, add_generation_prompt=agp)
            except Exception as exc:
                if want is None and type(exc) is want_error:
                    continue
                return f"corpus entry {i}: direct render raised {type(exc).__name__}: {exc}"
            if got != want:
                return f"corpus entry {i}: direct render differs from apply_chat_template"
        return None


def _qwen3_plain(messages: Sequence[Any], template_kwargs: Mapping[str, Any] | None, add_generation_prompt: bool) -> str | None:
    """Qwen3's chat template for a conversation of system and user messages only, without Jinja
    (~1 µs against ~27 µs), or None for anything else: tools, any assistant or tool message, a
    message with a key besides `role` and `content` or a value that is not exactly a `str`, a
    template variable besides a `bool` `enable_thinking`.

    What the template does on that input, branch by branch: a first system message is written
    as `<|im_start|>system\n{content}<|im_end|>\n`; every user message, and every system
    message after the first, as `<|im_start|>{role}\n{content}<|im_end|>\n`; the loop that
    finds the last user query only matters to assistant messages; the generation prompt is
    `<|im_start|>assistant\n`, followed by an empty think block when `enable_thinking is false`.
    Checked against the template at load (`self_check`) and in the tests.
    """
    thinking_off = False
    if template_kwargs:
        if template_kwargs.keys() != {"enable_thinking"} or type(template_kwargs["enable_thinking"]) is not bool:
            return None
        thinking_off = template_kwargs["enable_thinking"] is False
    if not messages or type(messages) not in (list, tuple):
        return None
    parts = []
    for message in messages:
        if type(message) is not dict or len(message) != 2:
            return None
        role = message.get("role")
        content = message.get("content")
        if type(role) is not str or type(content) is not str or role not in ("user", "system"):
            return None
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n<think>\n\n</think>\n\n" if thinking_off else "<|im_start|>assistant\n")
    return "".join(parts)
