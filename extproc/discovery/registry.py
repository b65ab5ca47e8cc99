"""Discovery source types: `type` in `discovery.sources[]` → the module implementing it.

A module named here defines `Params` (a pydantic model whose `type` field is a literal of its
name) and `Source(params, ctx)` (a `extproc.discovery.base.DiscoverySource`). Modules are
imported when a configuration names them, so the schema can import this without a cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import pydantic

from extproc.config.diagnose import describe_errors, did_you_mean

__all__ = ["SOURCES", "build_source", "parse_params"]

SOURCES: dict[str, str] = {
    "static": "extproc.discovery.static",
    "dns": "extproc.discovery.dns",
    "kubernetes": "extproc.discovery.kubernetes",
}


def _module(type_: str) -> ModuleType:
    if type_ not in SOURCES:
        raise ValueError(f"unknown discovery source type {type_!r}{did_you_mean(type_, SOURCES)} (known: {', '.join(SOURCES)})")
    return importlib.import_module(SOURCES[type_])


def parse_params(spec: Any) -> pydantic.BaseModel:
    """Validate one `discovery.sources[]` entry into its type's `Params` (passed through when
    already validated).

    Raises:
        ValueError: not a mapping, no or unknown `type`, or invalid parameters (each named).
    """
    if isinstance(spec, pydantic.BaseModel):
        return spec
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise ValueError(f"a source is a mapping with a `type` ({', '.join(SOURCES)}), got {spec!r}")
    params_cls = _module(spec["type"]).Params
    try:
        return params_cls.model_validate(dict(spec))
    except pydantic.ValidationError as exc:
        problems = describe_errors(exc, params_cls, spec)
        raise ValueError(f"{spec['type']} source: {problems}") from None


def build_source(params: pydantic.BaseModel, ctx: Any) -> Any:
    """The running source for validated `params` (`ctx`: a `SourceContext`)."""
    return _module(params.type).Source(params, ctx)  # type: ignore[attr-defined]
