"""`label-filter`: keep endpoints whose configured labels match every `match` entry.

Parameters:
    match (dict[str, str], required): label → required value.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Params, Plugin
from extproc.scheduling.registry import register


@register("label-filter")
class LabelFilter(Plugin):
    class Params(Params):
        match: dict[str, str] = Field(min_length=1)

    def filter(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        want = self.params.match.items()
        return [ep for ep in endpoints if all(ep.labels.get(k) == v for k, v in want)]
