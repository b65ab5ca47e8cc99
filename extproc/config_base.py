"""The pieces every configuration section shares: the strict pydantic base and the YAML `off` fix.

A leaf module (it imports nothing from extproc): the sections declared outside
`extproc.config.schema` (`extproc.ratelimit.config`, `extproc.replicas.config`, the discovery
sources) are imported by that schema, so they cannot import it, nor the `extproc.config`
package whose `__init__` imports the schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import InitErrorDetails, ValidationError

__all__ = ["KEY_MARK", "ConfigProblem", "Strict", "is_key_mark", "key_in", "key_text", "path_text", "raise_problems", "yaml_off"]


class Strict(BaseModel):
    """A configuration section: unknown keys are errors (a typo must not pass silently) and
    the validated value is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def yaml_off(value: Any) -> Any:
    """`"off"` for False, anything else unchanged: YAML 1.1 reads a bare `off` as false, so a
    field whose choices include "off" takes this as a `mode="before"` field validator."""
    return "off" if value is False else value


class ConfigProblem(ValueError):
    """A section's cross-check that found a problem below the section: `where` is its path
    relative to the section (`"scorers[0].type"`; "" for the section itself), `message` the
    problem. `str()` reads `"where: message"`; the configuration loader (which finds the
    exception in pydantic's error) joins `where` to the section's own path instead, so the line
    reads exactly like the same problem found by `extproc.config.diagnose.late_problems`."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        self.message = message


def raise_problems(title: str, problems: Iterable[ConfigProblem]) -> None:
    """Raise every problem a section's cross-check found, not only the first: one is raised
    as it is, several as a pydantic `ValidationError` holding each as a `value_error` at the
    section (pydantic places it below the section's path, as it does a raised `ConfigProblem`).
    Returns when there is none. `title` names the section's model (pydantic's error title).

    A cross-check that stopped at its first problem hid the others until the next try (a
    model's duplicate name hid a duplicate endpoint address; a discovery source's bad
    parameters hid the next source's)."""
    found = list(problems)
    if len(found) == 1:
        raise found[0]
    if found:
        raise ValidationError.from_exception_data(title, [InitErrorDetails(type="value_error", loc=(), input=None, ctx={"error": p}) for p in found])


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def key_text(key: object) -> str:
    """A mapping key as a step of a configuration path: `.name` for a name (letters, digits,
    `_` and `-`, not starting with a digit: `.load-aware`), else in brackets, a string
    JSON-quoted (`["team a"]`, `["Qwen/Qwen3-8B"]`) and any other key as Python writes it
    (`[1]`: YAML reads a bare `1:` as an int)."""
    if isinstance(key, str):
        return f".{key}" if _NAME.fullmatch(key) else f"[{json.dumps(key, ensure_ascii=False)}]"
    return f"[{key!r}]"


def key_in(mapping: Mapping[Any, Any], part: object) -> object:
    """The key of `mapping` that pydantic's location step `part` stands for: pydantic writes a
    key that is neither a string nor an int as its text (`None` → "None", 1.5 → "1.5") and
    True as 1, so a YAML `null:` or `yes:` key read as the string "None" or the index 1.
    `part` itself when no other key matches."""
    if isinstance(part, str):  # a string key equals only itself: no scan unless it is absent
        if part in mapping:
            return part
        return next((k for k in mapping if not isinstance(k, str) and str(k) == part), part)
    return next((k for k in mapping if k == part), part)  # 1 stands for 1 or True, whichever is there


KEY_MARK = "[key]"
"""pydantic's location step after a mapping key that is itself wrong (`("labels", 1, "[key]")`)."""


def is_key_mark(part: object, data: Any) -> bool:
    """Whether the location step `part`, taken in `data` (the input the location has reached,
    None when unknown), is pydantic's `KEY_MARK` rather than a key the user wrote as "[key]":
    a mapping holding a "[key]" key is stepped into by it. A user's "[key]" label read as the
    mark blamed its mapping's own key (`endpoints[0]: key 'labels'`)."""
    return part == KEY_MARK and not (isinstance(data, Mapping) and KEY_MARK in data)


def path_text(loc: Iterable[object], data: Any = None) -> str:
    """A pydantic error location as a configuration path, `models[1].name`: a list index in
    brackets, a mapping key by `key_text`. `data` is the input the location points into; with
    it, an int step into a mapping reads as a key, without it every int is an index. A wrong
    key itself (pydantic's `[key]` step, `is_key_mark`) reads `labels[1] (the key)`; a key
    the user wrote as "[key]" reads `labels["[key]"]`."""
    out = ""
    for part in loc:
        if is_key_mark(part, data):  # pydantic's mark after a mapping key that is itself wrong
            out += " (the key)"
            continue
        index = isinstance(part, int) and not isinstance(data, Mapping)
        if isinstance(data, Mapping):
            part = key_in(data, part)
        out += f"[{part}]" if index else key_text(part)
        try:
            data = data[part] if data is not None else None  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            data = None
    return out.removeprefix(".")
