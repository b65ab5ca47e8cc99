"""Load and validate the YAML configuration; apply environment overrides.

Environment overrides (addresses only, so a container can move ports without a new file):
`LLM_EXTPROC_GRPC_ADDRESS`, `LLM_EXTPROC_ADMIN_ADDRESS`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import yaml

from extproc.config.diagnose import describe_error, late_problems
from extproc.config.schema import BUILTIN_PROFILES, Config
from extproc.config.secrets import mask_urls
from extproc.models import DEFAULT_MODEL
from extproc.scheduling.registry import registered

__all__ = ["ConfigError", "load_config", "config_from_mapping", "default_config", "worker_index", "ENV_OVERRIDES", "WORKER_ENV"]

ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "LLM_EXTPROC_GRPC_ADDRESS": ("listen", "grpc"),
    "LLM_EXTPROC_ADMIN_ADDRESS": ("listen", "admin"),
}

WORKER_ENV = "LLM_EXTPROC_WORKER"
"""Set by `serve --workers N`'s supervisor in each worker's environment (with that worker's
listen addresses): the worker's index, 0 .. N-1."""


def worker_index(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's worker index under `serve --workers N` (`WORKER_ENV` in `environ`, default
    `os.environ`), or None when it is not such a worker (unset, empty or not a number)."""
    value = (os.environ if environ is None else environ).get(WORKER_ENV, "")
    return int(value) if value.isdigit() else None


MISSING_HINTS = {
    "models": f" (the models the fleet serves; the smallest entry: `models: [{{name: {DEFAULT_MODEL}}}]`)",
}
"""What to write for a required key a new configuration most often leaves out."""


class ConfigError(ValueError):
    """The configuration is invalid; the message names each offending key and value."""


def _format(exc: pydantic.ValidationError, raw: Mapping[str, Any], source: str) -> str:
    found = [describe_error(err, Config, raw, MISSING_HINTS) for err in exc.errors(include_url=False)]
    # The cross-checks pydantic skipped because their section had other errors; one it ran
    # reads the same (path, message) and is not said twice, nor is one the late checks find
    # twice (a model listed twice in one endpoint's `models`).
    found += [(where, message) for where, _, message in late_problems(raw, BUILTIN_PROFILES, registered())]
    problems = list(dict.fromkeys(found))
    lines = [f"invalid configuration in {source}:"]
    lines += [_one_line(f"{path}: {text}" if path else text) for path, text in problems]
    return "\n".join(lines)


MAX_PROBLEM_CHARS = 2000
"""Longest problem line (characters): a longer one keeps its start and end, the middle
elided. A megabyte key or name was echoed whole, in every message naming it."""


def _one_line(problem: str) -> str:
    """A problem as one indented line of at most `MAX_PROBLEM_CHARS`: a line break in a name
    the message lists unquoted (a profile named "a\\nb" among the defined ones) is written as
    `\\n`, not broken, and a huge name's middle is left out (the count said); a URL's
    credentials are masked (`mask_urls`: a Redis URL given where a mapping goes was echoed)."""
    text = mask_urls(problem).replace("\r", "\\r").replace("\n", "\\n")
    if len(text) > MAX_PROBLEM_CHARS:
        head, tail = MAX_PROBLEM_CHARS * 2 // 3, MAX_PROBLEM_CHARS // 4
        text = f"{text[:head]} … ({len(text) - head - tail} characters left out) … {text[-tail:]}"
    return "  " + text


def config_from_mapping(raw: Mapping[str, Any], *, source: str = "<mapping>", env: Mapping[str, str] | None = None) -> Config:
    """Validate a parsed mapping, applying environment overrides first.

    Raises:
        ConfigError: with every offending key and value.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"invalid configuration in {source}: top level must be a mapping, got {type(raw).__name__}")
    data: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    applied = []
    environ = env if env is not None else os.environ
    # `serve --workers` sets the listen addresses of each worker itself: not the user's overrides.
    own = {"LLM_EXTPROC_GRPC_ADDRESS", "LLM_EXTPROC_ADMIN_ADDRESS"} if worker_index(environ) is not None else set()
    for var, (section, key) in ENV_OVERRIDES.items():
        value = environ.get(var)
        if value:
            if var not in own:
                applied.append(f"{var} → {section}.{key}")
            data.setdefault(section, {})
            if not isinstance(data[section], dict):
                raise ConfigError(f"invalid configuration in {source}: {section} must be a mapping")
            data[section][key] = value
    if applied:
        source = f"{source} (with environment overrides {', '.join(applied)})"
    try:
        return Config.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_format(exc, data, source)) from None


def load_config(path: str | Path, *, env: Mapping[str, str] | None = None) -> Config:
    """Load a YAML file.

    Raises:
        ConfigError: unreadable file, invalid YAML (nesting too deep for the parser included),
            or invalid values.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"configuration {p} is not UTF-8") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        elif isinstance(exc, yaml.reader.ReaderError):  # a control character: a position, no mark
            at = exc.position
            where = f" at line {text.count(chr(10), 0, at) + 1}, column {at - text.rfind(chr(10), 0, at)}"
        # A ReaderError's str() runs on to a second line ('in "<unicode string>", position 1')
        problem = (getattr(exc, "problem", None) or str(exc)).splitlines()[0]
        raise ConfigError(f"configuration {p} is not valid YAML{where}: {problem}") from None
    except RecursionError:  # PyYAML's composer recurses once per level: `[[[...]]]` 5,000 deep
        raise ConfigError(f"configuration {p} nests too deeply (lists or mappings hundreds of levels deep)") from None
    try:
        # An empty file is an empty mapping; `0`, `""` or `false` alone is not one (was read as empty)
        return config_from_mapping({} if raw is None else raw, source=str(p), env=env)
    except RecursionError:  # a check walking a value hundreds of levels deep
        raise ConfigError(f"invalid configuration in {p}: it nests too deeply (lists or mappings hundreds of levels deep)") from None


def default_config(endpoints: list[str] | None = None, *, env: Mapping[str, str] | None = None) -> Config:
    """The embedded default: the project's default model (Qwen3-8B, built-in tokenizer and
    architecture) served by `endpoints` (default: one simulator at 127.0.0.1:8000)."""
    raw = {
        "models": [{"name": DEFAULT_MODEL, "aliases": ["qwen3-8b"], "max_model_len": 40960}],
        "endpoints": [{"address": a, "models": [DEFAULT_MODEL]} for a in (endpoints or ["127.0.0.1:8000"])],
    }
    return config_from_mapping(raw, source="<default>", env=env)
