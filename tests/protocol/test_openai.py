"""Parsing of every request shape the pipeline accepts, and the errors for the ones it refuses."""

from __future__ import annotations

import orjson
import pytest

from extproc.errors import InvalidJSONError, ValidationError
from extproc.protocol.openai import parse_body, route_kind, with_model
from extproc.types import RequestKind

CHAT = RequestKind.CHAT
COMP = RequestKind.COMPLETION


def body(**fields) -> bytes:
    return orjson.dumps(fields)


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/chat/completions?x=1", CHAT),
        ("POST", "/v1/chat/completions/", CHAT),
        ("POST", "/v1/completions", COMP),
        ("GET", "/v1/chat/completions", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/embeddings", None),
        ("POST", "/v1/chat/completionsX", None),
    ],
    ids=["chat", "chat-query", "chat-slash", "completions", "get-chat", "models", "embeddings", "prefix-only"],
)
def test_route_kind(method, path, expected):
    assert route_kind(method, path) is expected


def test_chat_with_only_messages_gets_defaults():
    r = parse_body(CHAT, body(model="m", messages=[{"role": "user", "content": "hi"}]))
    assert (r.model, r.max_tokens, r.n, r.stream, r.include_usage, r.user) == ("m", None, 1, False, False, None)
    assert r.messages == [{"role": "user", "content": "hi"}]


def test_chat_every_field():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = parse_body(
        CHAT,
        body(
            model="m",
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "bob"}],
            tools=tools,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            n=3,
            user="alice",
            temperature=0.2,  # unknown to us, tolerated
        ),
    )
    assert (r.max_tokens, r.n, r.stream, r.include_usage, r.user) == (10, 3, True, True, "alice")
    assert r.tools == tools
    assert r.messages[1] == {"role": "user", "content": "u", "name": "bob"}


def test_max_completion_tokens_wins_over_max_tokens():
    r = parse_body(CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=7))
    assert r.max_tokens == 7


def test_content_parts_joined_with_newline_like_vllm():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    r = parse_body(CHAT, body(model="m", messages=[{"role": "user", "content": parts}]))
    assert r.messages[0]["content"] == "first\nsecond"


def test_assistant_tool_call_message_without_content():
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ]
    r = parse_body(CHAT, body(model="m", messages=msgs))
    assert r.messages[1]["content"] == "" and r.messages[1]["tool_calls"][0]["id"] == "1"


def test_message_fields_reach_the_template_as_sent_none_dropped_at_the_top_only():
    call = {"id": None, "type": "function", "function": {"name": "w", "arguments": "{}"}}
    msg = {"role": "assistant", "content": None, "name": None, "tool_calls": [call], "x": {"a": None}}
    r = parse_body(CHAT, body(model="m", messages=[msg]))
    assert r.messages == [{"role": "assistant", "content": "", "tool_calls": [call], "x": {"a": None}}]


@pytest.mark.parametrize(
    ("kind", "raw"),
    [
        (CHAT, body(model="m", messages=[{"role": "user", "content": "hi", "x": [[]] * 60}])),
        (COMP, body(model="m", prompt=list(range(70)))),
        (COMP, body(model="m", prompt=["a"] * 70)),
    ],
    ids=["chat-extra-field", "token-ids", "batched-prompts"],
)
def test_bodies_over_max_values_are_refused_before_decoding(kind, raw):
    with pytest.raises(ValidationError) as info:
        parse_body(kind, raw, max_values=64)
    assert info.value.code == "too_many_json_values" and "more than 64 JSON values" in info.value.message
    parse_body(kind, raw)  # valid otherwise


@pytest.mark.parametrize(
    ("prompt", "needle"),
    [
        ([1.5] * 5000, "list of 5000 items that are not all token ids; a batch holds at most 100 prompts"),
        ([1] * 5000 + ["x"], "list of 5001 items that are not all token ids"),
        ([[1.5] * 50] * 10, "item 0 is not a list of token ids"),
        (["a", "b", [1]], "item 2 is not a string"),
        ([1, "a"], "item 1 is not a token id"),
        ([[1, 2], [3, True]], "item 1 is not a list of token ids"),
    ],
    ids=["floats", "ids-then-a-string", "lists-of-floats", "mixed", "id-then-string", "bool-is-no-token-id"],
)
def test_a_prompt_list_is_checked_before_pydantic(prompt, needle):
    """A completions body may hold a full context of token ids; a list of anything else fails
    on its first bad item (pydantic would report every item of every union branch)."""
    with pytest.raises(ValidationError) as info:
        parse_body(COMP, body(model="m", prompt=prompt), max_prompts=100)
    assert needle in info.value.message and info.value.param == "prompt"


@pytest.mark.parametrize(
    "prompt", [list(range(5000)), ["a", "b"], [[1, 2], [3]], "text"], ids=["token-ids", "strings", "id-lists", "string"]
)
def test_valid_prompt_lists_pass_the_pre_check(prompt):
    assert parse_body(COMP, body(model="m", prompt=prompt), max_prompts=100).model == "m"


def test_max_messages_is_checked_before_the_messages_are_validated():
    raw = body(model="m", messages=[{"role": 1}] * 3)  # every message invalid
    with pytest.raises(ValidationError) as info:
        parse_body(CHAT, raw, max_messages=2)
    assert (info.value.param, info.value.message) == ("messages", "3 messages; at most 2 are accepted")
    with pytest.raises(ValidationError) as info:
        parse_body(CHAT, raw, max_messages=3)
    assert info.value.param == "messages[0].role"


@pytest.mark.parametrize(
    ("prompt", "prompts", "ids"),
    [
        ("hello", ["hello"], []),
        (["a", "b"], ["a", "b"], []),
        ([1, 2, 3], [], [[1, 2, 3]]),
        ([[1], [2, 3]], [], [[1], [2, 3]]),
    ],
    ids=["string", "string-list", "token-ids", "token-id-lists"],
)
def test_completion_prompt_shapes(prompt, prompts, ids):
    r = parse_body(COMP, body(model="m", prompt=prompt, max_tokens=4))
    assert (r.prompts, r.prompt_token_ids, r.max_tokens) == (prompts, ids, 4)


@pytest.mark.parametrize(
    ("kind", "raw", "param"),
    [
        (CHAT, body(messages=[{"role": "user", "content": "x"}]), "model"),
        (CHAT, body(model="m"), "messages"),
        (CHAT, body(model="m", messages=[]), "messages"),
        (CHAT, body(model="m", messages=[{"content": "x"}]), "messages[0].role"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": 5}]), "messages[0].content"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=-1), "max_tokens"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=0), "max_tokens"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens="5"), "max_tokens"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5.0), "max_tokens"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=True), "max_tokens"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], n=0), "n"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": "x"}], stream="yes"), "stream"),
        (CHAT, body(model=5, messages=[{"role": "user", "content": "x"}]), "model"),
        (CHAT, body(model="m", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages[0].content[0].type"),
        (COMP, body(model="m"), "prompt"),
        (COMP, body(model="m", prompt=[]), "prompt"),
        (COMP, body(model="m", prompt=["a", 2]), "prompt"),
    ],
    ids=[
        "no-model", "no-messages", "empty-messages", "no-role", "content-int", "max-tokens-negative",
        "max-tokens-zero", "max-tokens-string", "max-tokens-float", "max-tokens-bool", "n-zero", "stream-string",
        "model-int", "image-part", "no-prompt", "empty-prompt", "mixed-prompt",
    ],
)
def test_validation_errors_name_the_param(kind, raw, param):
    with pytest.raises(ValidationError) as info:
        parse_body(kind, raw)
    assert info.value.param == param
    assert info.value.status == 400
    assert param.split("[")[0].split(".")[0] in info.value.message


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "caf\xff"}]}', "not valid UTF-8 (invalid byte at offset 60)"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "not valid JSON"),
        (b"", "not valid JSON"),
    ],
    ids=["garbage", "array", "invalid-utf8-in-string", "lone-surrogate", "empty"],
)
def test_malformed_bodies(raw, needle):
    with pytest.raises(InvalidJSONError) as info:
        parse_body(CHAT, raw)
    assert needle in info.value.message
    assert info.value.status == 400


def test_with_model_changes_only_the_model():
    body = b'{"model": "alias", "messages": [{"role": "user", "content": "h\xc3\xa9"}], "n": 2, "top_p": 0.5}'
    out = with_model(body, "Org/Served")
    assert orjson.loads(out) == {**orjson.loads(body), "model": "Org/Served"}
    assert list(orjson.loads(out)) == ["model", "messages", "n", "top_p"]  # order kept


def test_with_model_changes_only_the_model_bytes():
    """Numbers, escapes and spacing reach the engine as the client wrote them (a re-serialiser
    would print 1e15 as 1000000000000000.0 and turn integers beyond 64 bits into floats); with
    duplicate keys the last one, the one parsers keep, is replaced."""
    body = b'{ "model" : "a", "x": [1e15, 123456789012345678901234567890, 1E5], "c": "h\\u00e9", "model":"alias"}'
    assert with_model(body, "Org/Served") == body.replace(b'"model":"alias"', b'"model":"Org/Served"')


@pytest.mark.parametrize(
    "prompt",
    [[5, -1, 7], [5, 2**32, 7], [[1, 2], [3, -4]], [[1, 2], [2**63]]],
    ids=["negative", "past-uint32", "batch-negative", "batch-huge"],
)
def test_token_ids_outside_uint32_are_a_400_naming_the_item(prompt):
    # An id no engine vocabulary holds, and one the prefix hasher cannot pack (it raised
    # ValueError in the routing path: a 500 to the client).
    with pytest.raises(ValidationError) as info:
        parse_body(COMP, body(model="m", prompt=prompt))
    assert info.value.param == "prompt"
    assert info.value.status == 400
    assert "0..4294967295" in info.value.message


def test_token_ids_at_the_uint32_bounds_pass():
    assert parse_body(COMP, body(model="m", prompt=[0, 2**32 - 1])).prompt_token_ids == [[0, 2**32 - 1]]


def test_a_text_part_whose_text_is_not_a_string_says_so():
    # It used to say "unsupported content part type 'text'" — the one type that is supported.
    raw = body(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": {"nested": 1}}]}])
    with pytest.raises(ValidationError) as info:
        parse_body(CHAT, raw)
    assert info.value.param == "messages[0].content[0].text"
    assert "must be a string" in info.value.message and "unsupported" not in info.value.message
