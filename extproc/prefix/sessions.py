"""Session bindings: a conversation's key → the endpoint its last request went to.

The key is a configured header's value (default `x-session-id`) or the request's OpenAI `user`
field. Neither is kept in clear: the table holds a BLAKE2b digest of it (the `user` field may
name a person). Bounded in count (least recently used out first) and in age (`ttl_s`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

__all__ = ["SessionTable", "session_key"]


def session_key(value: str | None) -> bytes | None:
    """The table key of a session id or user (a 16-byte digest), or None for none/empty."""
    if not value:
        return None
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SessionTable:
    """Session key → endpoint address, LRU- and age-bounded.

    Args:
        max_sessions: most sessions kept (count, > 0).
        ttl_s: a binding unused this long is forgotten (seconds, > 0).

    Raises:
        ValueError: a bound is not positive.
    """

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        if max_sessions <= 0 or ttl_s <= 0:
            raise ValueError(f"max_sessions and ttl_s must be positive, got {max_sessions}, {ttl_s}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._table: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._per_endpoint: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._table)

    def get(self, key: bytes | None, now: float) -> str | None:
        """The endpoint bound to `key`, or None (unknown or expired; `now`: monotonic seconds)."""
        if key is None:
            return None
        found = self._table.get(key)
        if found is None:
            return None
        if now - found[1] > self.ttl_s:
            del self._table[key]
            self._uncount(found[0])
            return None
        return found[0]

    def bind(self, key: bytes | None, address: str, now: float) -> None:
        """Bind `key` to `address` as most recently used (`now`: monotonic seconds)."""
        if key is None:
            return
        old = self._table.get(key)
        if old is not None:
            self._uncount(old[0])
        self._table[key] = (address, now)
        self._table.move_to_end(key)
        self._per_endpoint[address] = self._per_endpoint.get(address, 0) + 1
        while len(self._table) > self.max_sessions:
            _, (gone, _) = self._table.popitem(last=False)
            self._uncount(gone)

    def drop_endpoint(self, address: str) -> int:
        """Forget every binding to `address` (it left the fleet). Returns how many."""
        gone = [k for k, (a, _) in self._table.items() if a == address]
        for k in gone:
            del self._table[k]
        self._per_endpoint.pop(address, None)
        return len(gone)

    def count_for(self, address: str) -> int:
        """Sessions bound to `address` (count; O(1): the admin API asks for every endpoint, and
        scanning 100k sessions per endpoint held the event loop for seconds)."""
        return self._per_endpoint.get(address, 0)

    def _uncount(self, address: str) -> None:
        n = self._per_endpoint.get(address, 0) - 1
        if n > 0:
            self._per_endpoint[address] = n
        else:
            self._per_endpoint.pop(address, None)
