"""Configuration diagnostics: every problem at once, each with the nearest valid name.

pydantic stops checking a section at its first field error: a model's own cross-checks (an
unknown `scheduling.profile`, an endpoint, discovery source or rate-limit tenant naming an
unknown model, an unknown plugin type) only
run once all of its fields are valid, so a typo in one key used to hide a wrong profile name
beside it until the next try. `late_problems` runs those checks on the raw mapping, whatever
else is wrong, so `extproc.config.loader` reports all of them in one message; `did_you_mean`
names the closest valid spelling (difflib's ratio ≥ 0.6, its default cutoff).
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

from extproc.config.secrets import HIDDEN, hides_value
from extproc.config_base import ConfigProblem, is_key_mark, key_in, key_text, path_text

__all__ = ["describe_error", "describe_errors", "did_you_mean", "known_keys_at", "late_problems", "undefined_profile", "unknown_model", "unknown_plugin_type"]


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the choice closest to `word`, or "" when none is close
    (difflib.get_close_matches, cutoff 0.6) or `word` is not a string."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _item_type(annotation: Any) -> Any:
    """The element type of list[X] / dict[str, X] (through Optional)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                return _item_type(arg)
    args = typing.get_args(annotation)
    return args[-1] if args else None


def _is_mapping(annotation: Any) -> bool:
    """dict[str, X] (through Optional): its keys are names, not fields of X."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_mapping(a) for a in typing.get_args(annotation) if a is not type(None))
    return isinstance(origin, type) and issubclass(origin, Mapping)


def known_keys_at(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at `loc` accepts (`loc` ends with the unknown key itself), or [] when
    `loc` does not lead to a model (a plugin's free-form `params`, say)."""
    annotation: Any = root
    for part in loc[:-1]:
        model = _model_in(annotation)
        if isinstance(part, int) or model is None or _is_mapping(annotation):
            annotation = _item_type(annotation)  # a list index or a dict key (a profile's name)
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return []
        annotation = field.annotation
    model = _model_in(annotation)
    return list(model.model_fields) if model is not None else []


def _join(path: str, where: str) -> str:
    """`where` (relative: `"models"`, `"[0].type"`) below `path`."""
    if not path or not where:
        return path or where.removeprefix(".")
    return path + where if where.startswith("[") else f"{path}.{where}"


def describe_error(err: Mapping[str, Any], root: type[BaseModel], data: Any, missing_hints: Mapping[str, str] | None = None) -> tuple[str, str]:
    """One of pydantic's errors (`ValidationError.errors()`) validating `data` as `root`, as
    `(path, text)`: the path by `path_text` ("" for a check of the whole input whose text
    names the keys itself), an unknown key with the nearest known one (`did_you_mean`), a
    required key with its `missing_hints` entry (by path), a section's `ConfigProblem` at its
    own path below the section, and the offending value when the message does not show it
    (`HIDDEN` below a `SECRET_KEYS` key)."""
    # a mapping's key itself is wrong: name the mapping and the key
    if err["loc"] and is_key_mark(err["loc"][-1], _at(data, err["loc"][:-1])):
        key = err["loc"][-2]
        mapping = _at(data, err["loc"][:-2])
        if isinstance(mapping, Mapping):
            key = key_in(mapping, key)
        return path_text(err["loc"][:-2], data), f"key {key!r}: {err['msg']}"
    loc = path_text(err["loc"], data)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigProblem):  # a section's cross-check, below the section
        return _join(loc, cause.where), cause.message
    value = err.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) else None
    if shown is not None and hides_value(err["loc"]):  # an API key pasted where its digest goes
        shown = HIDDEN
    if shown is not None and len(shown) > 80:
        shown = shown[:77] + "..."
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return loc or "<root>", f"required key is missing{(missing_hints or {}).get(loc, '')}"
    if err["type"] == "extra_forbidden":
        hint = did_you_mean(err["loc"][-1], known_keys_at(root, err["loc"]))
        return loc, f"unknown key{hint} (value {shown if shown is not None else type(value).__name__})"
    if not loc or shown is None or shown in msg:
        return loc, msg
    return loc, f"{msg} (got {shown})"


def describe_errors(exc: Any, root: type[BaseModel], data: Any) -> str:
    """Every error of the pydantic ValidationError `exc` (validating `data` as `root`: a
    plugin's or a discovery source's parameters) by `describe_error`, joined with "; "."""
    lines = (describe_error(err, root, data) for err in exc.errors(include_url=False))
    return "; ".join(f"{path}: {text}" if path else text for path, text in lines)


def _at(data: Any, loc: Iterable[Any]) -> Any:
    """The part of `data` a pydantic location points to (its keys read by `key_in`), or None."""
    for part in loc:
        if isinstance(data, Mapping):
            data = data.get(key_in(data, part))
        elif isinstance(data, list) and isinstance(part, int) and -len(data) <= part < len(data):
            data = data[part]
        else:
            return None
    return data


def _get(data: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(k)
    return data


def unknown_model(name: object, configured: Iterable[str]) -> str:
    """The message for a model name that is not a configured model's canonical name (the same
    wherever one is named: an endpoint, a discovery source, a tenant's limits)."""
    names = sorted(configured)
    return f"{name!r} is not a configured model name{did_you_mean(name, names)} (configured: {', '.join(names)})"


def undefined_profile(name: object, defined: Iterable[str]) -> str:
    """The message for a `scheduling.profile` that names no built-in or configured profile."""
    names = sorted(defined)
    return f"profile {name!r} is not defined{did_you_mean(name, names)} (defined: {', '.join(names)})"


def unknown_plugin_type(name: object, known: Iterable[str]) -> str:
    """The message for a plugin `type` no registered plugin has."""
    names = sorted(known)
    return f"unknown plugin type {name!r}{did_you_mean(name, names)} (known: {', '.join(names)})"


def late_problems(data: Mapping[str, Any], builtin_profiles: Iterable[str], plugin_types: Iterable[str]) -> list[tuple[str, object, str]]:
    """The cross-checks pydantic skips while a section has other errors, run on the raw
    mapping: `(location, offending value, message)` for an unknown `scheduling.profile`, an
    unknown plugin type in a configured profile, and a model name that is not configured in
    a discovery source's, an endpoint's or a rate-limit tenant's `models`.
    Malformed shapes are skipped here (pydantic reports them). The caller names the built-in
    profiles and the registered plugin types: this module imports neither the schema nor the
    plugin registry (both import it for their messages)."""

    out: list[tuple[str, object, str]] = []
    profiles = _get(data, "scheduling", "profiles")
    defined = set(builtin_profiles) | (set(k for k in profiles if isinstance(k, str)) if isinstance(profiles, Mapping) else set())
    profile = _get(data, "scheduling", "profile")
    if isinstance(profile, str) and profile not in defined:
        out.append(("scheduling.profile", profile, undefined_profile(profile, defined)))
    if isinstance(profiles, Mapping):
        types_known = set(plugin_types)
        for name, prof in profiles.items():
            for kind in ("filters", "scorers", "picker"):
                specs = _get(prof, kind)
                specs = [specs] if isinstance(specs, Mapping) else specs if isinstance(specs, list) else []
                for i, spec in enumerate(specs):
                    t = _get(spec, "type")
                    if isinstance(t, str) and t not in types_known:
                        where = f"scheduling.profiles{key_text(name)}.{kind}" + ("" if kind == "picker" else f"[{i}]") + ".type"
                        out.append((where, t, unknown_plugin_type(t, types_known)))
    models = data.get("models")
    names = {m["name"] for m in models if isinstance(m, Mapping) and isinstance(m.get("name"), str)} if isinstance(models, list) else set()
    if not names:
        return out
    named: list[tuple[str, Any]] = []  # (where, the names there: a list, or a mapping's keys)
    sources = _get(data, "discovery", "sources")
    named += [(f"discovery.sources[{i}].models", _get(src, "models")) for i, src in enumerate(sources if isinstance(sources, list) else [])]
    endpoints = data.get("endpoints")
    named += [(f"endpoints[{i}].models", _get(ep, "models")) for i, ep in enumerate(endpoints if isinstance(endpoints, list) else [])]
    tenants = _get(data, "ratelimit", "tenants")
    named += [(f"ratelimit.tenants{key_text(name)}.models", _get(t, "models")) for name, t in (tenants.items() if isinstance(tenants, Mapping) else [])]
    for where, served in named:
        for m in served if isinstance(served, (list, Mapping)) else []:
            if isinstance(m, str) and m not in names:
                out.append((where, m, unknown_model(m, names)))
    return out
