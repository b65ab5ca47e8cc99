"""A log line that may repeat on every cycle of a loop (a backend down, bad input arriving again
and again), written at most once per interval: shared by the rate limiter, replica sync and
endpoint discovery."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["WarnEvery"]


class WarnEvery:
    """Logs at most once per `interval_s` (seconds); the next line that gets through says how
    many were suppressed meanwhile.

    Args:
        logger: where the lines go.
        interval_s: least time between two lines (seconds).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last = float("-inf")
        self.suppressed = 0
        """Lines not logged since the last one that was (count)."""

    def log(self, level: int, msg: str, *args: object, exc_info: bool = False) -> bool:
        """`logger.log(level, msg, *args)` unless a line was logged less than `interval_s` ago.
        Returns whether it was logged."""
        now = self._clock()
        if now - self._last < self._interval_s:
            self.suppressed += 1
            return False
        if self.suppressed:
            msg, args = msg + " (%d similar lines suppressed)", (*args, self.suppressed)
        self._last, self.suppressed = now, 0
        self._log.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, msg: str, *args: object, exc_info: bool = False) -> bool:
        """`log(logging.WARNING, ...)`."""
        return self.log(logging.WARNING, msg, *args, exc_info=exc_info)
