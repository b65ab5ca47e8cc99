"""`session-affinity-scorer`: 1.0 for the endpoint the request's session was last routed to,
0 for the others (all 0 when the request names no session or its endpoint is not a candidate).

The session comes from a configured header (`scheduling.prefix.session_header`, default
`x-session-id`) or the request's `user` field (`extproc.prefix.sessions`). It is soft: with a
weight below the TTFT estimate's, a session yields under load as the prefix term does, and when
its endpoint leaves the fleet or is filtered out, the request goes wherever the other scorers
say and the session is bound there from then on (it moves once, then stays). No parameters."""

from __future__ import annotations

from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.plugins.base import Plugin
from extproc.scheduling.registry import register


@register("session-affinity-scorer")
class SessionAffinityScorer(Plugin):
    def score(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint]) -> list[float]:
        bound = ctx.session_endpoint
        return [1.0 if bound is not None and ep.address == bound else 0.0 for ep in endpoints]
