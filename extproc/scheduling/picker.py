"""Pickers over candidate endpoints.

`least-inflight`: fewest in-flight requests counted by this server; ties broken uniformly at
random so equal endpoints share load instead of the first one taking every burst.
`random`: uniform choice (a baseline).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.datastore.endpoints import Endpoint

__all__ = ["pick_least_inflight", "pick_random", "PICKERS"]


def pick_least_inflight(candidates: Sequence[Endpoint], rng: random.Random) -> Endpoint:
    """The endpoint with the fewest in-flight requests (random among ties).

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no candidates")
    low = min(ep.inflight for ep in candidates)
    best = [ep for ep in candidates if ep.inflight == low]
    return best[0] if len(best) == 1 else rng.choice(best)


def pick_random(candidates: Sequence[Endpoint], rng: random.Random) -> Endpoint:
    """A uniformly random endpoint.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("no candidates")
    return rng.choice(list(candidates))


PICKERS = {"least-inflight": pick_least_inflight, "random": pick_random}
