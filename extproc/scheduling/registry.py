"""Plugin registry: a kebab-case type name → plugin class with a pydantic `Params` model.

Each plugin module registers itself with `@register("type-name")`; the config names plugins
by type and passes parameters, which the plugin's `Params` validates (unknown keys and invalid
values are errors, never silent defaults).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import pydantic

__all__ = ["ROLE_METHODS", "register", "build", "plugin_problem", "registered", "PluginConfigError"]

_REGISTRY: dict[str, type] = {}


class PluginConfigError(ValueError):
    """Unknown plugin type or invalid parameters (the message names both)."""


def register(type_name: str):
    """Class decorator: make a plugin available under `type_name`."""

    def deco(cls: type) -> type:
        if type_name in _REGISTRY:
            raise RuntimeError(f"plugin type {type_name!r} registered twice")
        cls.type_name = type_name  # type: ignore[attr-defined]
        _REGISTRY[type_name] = cls
        return cls

    return deco


def _load_all() -> None:
    from extproc.scheduling import plugins

    for mod in pkgutil.walk_packages(plugins.__path__, plugins.__name__ + "."):
        importlib.import_module(mod.name)


def registered() -> dict[str, type]:
    """Every registered plugin type → class."""
    _load_all()
    return dict(_REGISTRY)


ROLE_METHODS: dict[str, str] = {"filter": "filter", "scorer": "score", "picker": "pick"}
"""The method a plugin of each role has (the framework's Filter / Scorer / Picker protocols)."""


def plugin_problem(type_name: str, params: dict[str, Any] | None, role: str) -> tuple[str, str] | None:
    """Why a configured plugin cannot serve as a `role` (`filter`, `scorer`, `picker`), without
    building it: what the config schema checks. Returns None when it can, else `(key suffix,
    message)`: `(".type", ...)` for an unknown type (the same line as
    `config.diagnose.late_problems`'), `("", ...)` for parameters its `Params` rejects or a
    plugin of another role.

    Raises:
        ValueError: an unknown role.
    """
    # Imported here, not at the top: extproc.config's package loads the schema, which calls this.
    from extproc.config.diagnose import describe_errors, unknown_plugin_type

    method = ROLE_METHODS.get(role)
    if method is None:
        raise ValueError(f"role must be one of {sorted(ROLE_METHODS)}, got {role!r}")
    types = registered()
    cls = types.get(type_name)
    if cls is None:
        return ".type", unknown_plugin_type(type_name, types)
    try:
        cls.Params.model_validate(params or {})
    except pydantic.ValidationError as exc:
        return "", f"plugin {type_name!r}: invalid parameters: {describe_errors(exc, cls.Params, params or {})}"
    if not callable(getattr(cls, method, None)):
        return "", f"{type_name!r} is not a {role}"
    return None


def build(type_name: str, params: dict[str, Any] | None = None, *, name: str | None = None) -> Any:
    """Instantiate a plugin.

    Raises:
        PluginConfigError: unknown type, or parameters its `Params` rejects.
    """
    types = registered()
    cls = types.get(type_name)
    if cls is None:
        from extproc.config.diagnose import unknown_plugin_type

        raise PluginConfigError(unknown_plugin_type(type_name, types))
    try:
        p = cls.Params.model_validate(params or {})
    except pydantic.ValidationError as exc:
        from extproc.config.diagnose import describe_errors

        raise PluginConfigError(f"plugin {type_name!r}: invalid parameters: {describe_errors(exc, cls.Params, params or {})}") from None
    return cls(p, name=name or type_name)
