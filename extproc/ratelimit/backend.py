"""The interface every window backend implements (memory, Redis): one call per decision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from extproc.ratelimit.window import Decision, ScopeLimit

__all__ = ["BackendUnavailable", "WindowBackend"]


class BackendUnavailable(Exception):
    """The backend could not answer (Redis unreachable, timed out, or errored).

    Attributes:
        dropped: the connection failed (closed, reset, refused), as opposed to a timeout or an
            error reply: a pooled connection Redis closed is worth one retry on a fresh one.
    """

    def __init__(self, message: str, *, dropped: bool = False) -> None:
        super().__init__(message)
        self.dropped = dropped


class WindowBackend(Protocol):
    """A store of sliding windows, keyed by scope.

    `now_ms` is for tests (explicit time); None means the backend's own clock (the memory
    backend's monotonic clock, Redis's `TIME`, so every replica sharing Redis shares one clock).
    """

    name: str
    local: bool
    """True when calls never suspend (an in-process backend): the caller need not guard them."""

    async def acquire(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None, request_id: str | None = None) -> Decision:
        """Admit and charge `cost` tokens and one request in every scope, or refuse (`window.decide`).
        `request_id` enters the in-flight set of every scope with a concurrency cap (required then).

        Raises:
            BackendUnavailable: no answer.
            ValueError: a capped scope and no `request_id`.
        """
        ...

    async def settle(self, keys: Sequence[str], bucket: int, delta: int, now_ms: int | None = None, request_id: str | None = None) -> None:
        """Correct an admitted charge by `delta` tokens and release `request_id` from the
        in-flight sets (`window.settle`). A remote backend retries once on a fresh connection
        when its connection dropped (a lost settlement holds a concurrency slot for the lease).

        Raises:
            BackendUnavailable: no answer (the charge stays as it was).
        """
        ...

    async def abort(self, keys: Sequence[str], cost: int, request_id: str, now_ms: int | None = None) -> None:
        """The caller gave up waiting for the acquire of `request_id` (`cost` tokens): give back
        what it charged if it ran, else make sure it charges nothing when it runs late (a remote
        backend that stalled with the command queued). Idempotent. A local backend never gives
        up on an acquire: there it only releases the slot and the tokens if the acquire ran.

        Raises:
            BackendUnavailable: no answer (the acquire, if it ran, keeps its charge).
        """
        ...

    async def check(self, scopes: Sequence[ScopeLimit], cost: int, now_ms: int | None = None) -> Decision:
        """Would `cost` tokens and one request fit in every scope now? Charges nothing.

        Raises:
            BackendUnavailable: no answer.
        """
        ...

    async def peek(self, scopes: Sequence[ScopeLimit], now_ms: int | None = None) -> Decision:
        """The scopes' windows now, charging nothing.

        Raises:
            BackendUnavailable: no answer.
        """
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
