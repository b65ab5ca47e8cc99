"""Shared plugin plumbing: a pydantic `Params` base that forbids unknown keys."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Params", "Plugin"]


class Params(BaseModel):
    """Plugin parameters; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Plugin:
    """Base: holds validated params and the instance name."""

    type_name = ""

    class Params(Params):
        pass

    def __init__(self, params: Params, *, name: str) -> None:
        self.params = params
        self.name = name
