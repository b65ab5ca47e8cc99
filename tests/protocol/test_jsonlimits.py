"""Counting JSON values on a body's bytes: exact where it refuses, never fooled by strings."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.errors import ValidationError
from extproc.protocol import jsonlimits
from extproc.protocol.jsonlimits import MAX_JSON_DEPTH, check_json_depth, check_json_values, count_values, json_depth, values_bound


def reference(value) -> int:
    """Values in a decoded document: every object, array, string, number and literal (keys not)."""
    n, stack = 0, [value]
    while stack:
        item = stack.pop()
        n += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return n


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"7", 1),
        (b"[]", 1),
        (b"[ \n ]", 1),
        (b'{"a": {}}', 2),
        (b'["x"]', 2),
        (b'{"k": []}', 2),
        (b"[[],[],[]]", 4),
        (b'[1, "two", true, null, {"five": 5.0}]', 7),
        (b'"[[],{},[],{}],,,"', 1),
        (b'{"code": "def f(a, b): return {a: [b, {}]}"}', 2),
        (rb'["say \"[1,2]\", {x}", "\\", "\\\\\"[,]\"", 3]', 5),
        (rb'{"k\"[": "v,{", "\u005b": "\u0022,["}', 3),
        (b"[" * 5000 + b"]" * 5000, 5000),
        (b"[" * 5000 + b"1" + b"]" * 5000, 5001),
    ],
    ids=[
        "scalar",
        "empty-array",
        "empty-array-spaced",
        "empty-object-member",
        "one-string",
        "key-not-counted",
        "empty-lists",
        "mixed",
        "brackets-in-a-string",
        "code-in-a-prompt",
        "escaped-quotes-and-backslashes",
        "escapes-in-keys",
        "deeper-than-a-parser-allows",
        "deep-with-a-leaf",
    ],
)
def test_exact_count(body, expected):
    assert count_values(body, 10**9) == expected
    assert values_bound(body) >= expected


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet='[]{},:"\\ \n\tab\u00e9\u2028'),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(alphabet='[]{},"\\a', max_size=4), inner, max_size=6),
    max_leaves=60,
)


@settings(max_examples=300, deadline=None)
@given(
    value=json_values,
    window=st.sampled_from([1, 2, 3, 7, 64 * 1024]),
    indent=st.sampled_from([None, 1]),
    ascii_only=st.booleans(),
)
def test_count_matches_a_parser_at_any_window_size(value, window, indent, ascii_only):
    """Windows as small as one byte cut strings, escapes and `[]` pairs at every position."""
    body = json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode()
    old, jsonlimits.WINDOW = jsonlimits.WINDOW, window
    try:
        got = count_values(body, 10**9)
    finally:
        jsonlimits.WINDOW = old
    assert got == reference(orjson.loads(body))
    assert values_bound(body) >= got


def test_the_count_stops_soon_after_the_limit():
    body = b'{"messages": [{"role": "user", "content": "hi", "x": [' + b"[]," * 1_000_000 + b"[]]}]}"
    assert count_values(body, 10**9) == reference(orjson.loads(body))
    stopped = count_values(body, 1000)
    assert 1000 < stopped < 1000 + jsonlimits.WINDOW  # one window past the limit, not the whole body


def test_the_limit_is_exact():
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 100})  # 303 values
    assert reference(orjson.loads(body)) == 303
    check_json_values(body, 303)
    with pytest.raises(ValidationError) as info:
        check_json_values(body, 302)
    err = info.value
    assert err.status == 400 and err.code == "too_many_json_values"
    assert "more than 302 JSON values" in err.message and "limits.max_json_values" in err.message


@pytest.mark.parametrize("window", [2, 3, 5, 8, 13])
def test_a_pair_split_across_windows_does_not_refuse_a_body_at_the_limit(window):
    """`[` ending one window and `]` starting the next are one value, not two: a body holding
    exactly the limit is counted to the end, whichever byte the window boundary falls on."""
    old, jsonlimits.WINDOW = jsonlimits.WINDOW, window
    try:
        for pad in range(2 * window):
            body = b'{"a": 1,' + b" " * pad + b'"b": []}'
            assert count_values(body, 3) == 3, pad
    finally:
        jsonlimits.WINDOW = old


def test_a_long_run_of_backslashes_spans_windows():
    """A window never ends inside a backslash run (the run is skipped with a regex, at C speed)."""
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "," * 20_000 + "\\" * 100_000 + '"]'}]})
    old, jsonlimits.WINDOW = jsonlimits.WINDOW, 4096
    try:
        assert count_values(body, 16384) == 6
    finally:
        jsonlimits.WINDOW = old


def test_commas_and_brackets_inside_strings_never_refuse():
    """Far more `,[{` bytes than the limit (the cheap bound is over it), but few real values."""
    prompt = "def f(a, b):\n    return {'a': [a, b], \"c\": {x: y for x, y in z}}, [1, 2, 3]\n" * 2000
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]})
    assert values_bound(body) > 10_000
    check_json_values(body, 64)


def reference_depth(value) -> int:
    """Nesting of arrays and objects in a decoded document (a scalar is 0)."""
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize(
    "doc",
    [
        {"a": "[[[[[[[[{{{{", "b": [[["\\\"[", {"c": []}]]]},
        [[[[[[]]]]], "]]]]]]]]]]]]", [[[[{"x": "{{{{{"}]]]]],
    ],
)
def test_json_depth_skips_brackets_inside_strings_and_escapes(doc):
    body = json.dumps(doc).encode()
    assert json_depth(body, 0) == reference_depth(doc)


def test_json_depth_across_windows_and_its_400():
    deep = b'{"s": "' + b"[" * (jsonlimits.WINDOW + 3) + b'", "x": ' + b"[" * 300 + b"]" * 300 + b"}"
    assert json_depth(deep, 1000) == 301
    assert json_depth(deep) > MAX_JSON_DEPTH
    with pytest.raises(ValidationError) as exc:
        check_json_depth(deep)
    assert exc.value.code == "json_too_deep" and exc.value.status == 400
    check_json_depth(b'{"x": ' + b"[" * 127 + b"]" * 127 + b"}")  # 128 levels with the object
