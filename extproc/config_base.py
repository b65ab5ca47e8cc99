"""The pieces every configuration section shares: the strict pydantic base and the YAML `off` fix.

A leaf module (it imports nothing from extproc): the sections declared outside
`extproc.config.schema` (`extproc.ratelimit.config`, `extproc.replicas.config`, the discovery
sources) are imported by that schema, so they cannot import it, nor the `extproc.config`
package whose `__init__` imports the schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigProblem", "Strict", "yaml_off"]


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
