"""The pieces every configuration section shares: the strict pydantic base and the YAML `off` fix.

A leaf module (it imports nothing from extproc): the sections declared outside
`extproc.config.schema` (`extproc.ratelimit.config`, `extproc.replicas.config`, the discovery
sources) are imported by that schema, so they cannot import it, nor the `extproc.config`
package whose `__init__` imports the schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["Strict", "yaml_off"]


class Strict(BaseModel):
    """A configuration section: unknown keys are errors (a typo must not pass silently) and
    the validated value is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def yaml_off(value: Any) -> Any:
    """`"off"` for False, anything else unchanged: YAML 1.1 reads a bare `off` as false, so a
    field whose choices include "off" takes this as a `mode="before"` field validator."""
    return "off" if value is False else value
