"""An overlay: the YAML that `up`, `demo`, `bench` and scripts/bench_prefix.py lay over the
llm-extproc config they generate for their simulated fleet (`--extproc-config`), checked as
those commands check it and as `llm-extproc check-config --overlay FILE` does, before anything
starts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from extproc.config.schema import Config

if TYPE_CHECKING:
    from extproc.stack.fleet import LoraFleet

__all__ = ["MAX_OVERLAY_BYTES", "OWNED_KEYS", "OverlayError", "accepted_keys", "check_overlay"]

MAX_OVERLAY_BYTES = 1 << 20
"""Largest overlay file (bytes)."""

OWNED_KEYS = frozenset({"listen", "admin", "endpoints"})
"""Top-level keys the stack sets itself (its ports and its fleet); an overlay may not."""


class OverlayError(ValueError):
    """The overlay cannot be laid over the stack's config; the message says why (without the
    option's name, which the caller adds)."""


def accepted_keys() -> list[str]:
    """Every top-level key an overlay may set (the configuration's, less `OWNED_KEYS`)."""
    return sorted(set(Config.model_fields) - OWNED_KEYS)


def check_overlay(
    path: Path, profiles: Sequence[str], *, roles: Sequence[str] | None = None, lora: LoraFleet | None = None
) -> tuple[dict[str, Any], Config]:
    """Read `path` and lay it over the config generated for a fleet of simulator `profiles`
    (with their P/D `roles` and `lora` adapters, as `extproc.stack.fleet.NamedFleet` has them).

    `models` entries are laid over the fleet's model of the same name (aliases, truncation,
    `max_model_len`, ...; `extproc.bench.stacks.merge_models`); mappings merge key by key.

    Returns:
        (the overlay as read, the validated merged configuration).

    Raises:
        OverlayError: unreadable or over `MAX_OVERLAY_BYTES`, not a YAML mapping, a key of
            `OWNED_KEYS`, a model the fleet does not serve, or an invalid merged configuration.
    """
    import yaml

    from extproc.bench.stacks import merge_config, server_config
    from extproc.config.loader import ConfigError, config_from_mapping

    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_OVERLAY_BYTES + 1)
        if len(raw) > MAX_OVERLAY_BYTES:
            raise OverlayError(f"{path} is larger than {MAX_OVERLAY_BYTES} bytes")
        overrides = yaml.safe_load(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise OverlayError(f"cannot read {path}: {exc}") from None
    if not isinstance(overrides, dict):
        raise OverlayError(f"{path} must hold a YAML mapping")
    owned = sorted(set(overrides) & OWNED_KEYS)
    if owned:
        raise OverlayError(
            f"{path} sets {', '.join(owned)}, which the stack owns (its fleet and ports); an overlay may set "
            f"{', '.join(accepted_keys())} (models: entries by name, laid over the fleet's models)"
        )
    addresses = {f"127.0.0.1:{8000 + i}": p for i, p in enumerate(profiles)}
    by_address = dict(zip(addresses, roles)) if roles else None
    sample = server_config(addresses, profile="load-aware", roles=by_address, lora=lora)
    try:
        cfg = config_from_mapping(merge_config(sample, overrides), source=str(path))
    except ValueError as exc:  # ConfigError, or a models entry naming no model of the fleet
        raise OverlayError(str(exc) if isinstance(exc, ConfigError) else f"{path}: {exc}") from None
    return overrides, cfg
