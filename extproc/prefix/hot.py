"""The hottest shared prefixes over a sliding window (design notes 3.3: warm hot prefixes onto
cold instances).

A request's *shared prefix* is the part of its prompt some endpoint already held when it was
routed (the longest match in the prefix index), named by its last block's hash. The table counts
requests per shared prefix in `buckets` buckets spanning `window_s` seconds; a prefix seen at
least `min_count` times in the window is hot. The routing itself needs no special case: the TTFT
estimate sends a request with a hot prefix to a cold endpoint as soon as every warm one's queue
outweighs the prefill it would save (a *seed*). This table names what is hot, for metrics and
`/api/v1/endpoints`, and tells a seed from an ordinary miss.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["HotPrefixes", "HotPrefix"]


@dataclass(slots=True)
class HotPrefix:
    """One tracked prefix: its size (tokens) and counts per bucket."""

    tokens: int
    counts: list[int]
    bucket_at: list[int]


class HotPrefixes:
    """Request counts per shared prefix over a sliding window.

    Args:
        window_s: window length (seconds, > 0).
        buckets: buckets in the window (≥ 1).
        min_count: requests in the window that make a prefix hot (≥ 1).
        max_tracked: most prefixes tracked (least recently seen out first).
    """

    def __init__(self, window_s: float = 60.0, buckets: int = 12, min_count: int = 8, max_tracked: int = 4096) -> None:
        if window_s <= 0 or buckets < 1 or min_count < 1 or max_tracked < 1:
            raise ValueError("window_s > 0, buckets >= 1, min_count >= 1 and max_tracked >= 1 are required")
        self.bucket_s = window_s / buckets
        self.buckets = buckets
        self.min_count = min_count
        self.max_tracked = max_tracked
        self._items: OrderedDict[int, HotPrefix] = OrderedDict()

    def _slot(self, now: float) -> int:
        return int(now / self.bucket_s)

    def record(self, prefix_hash: int, tokens: int, now: float) -> int:
        """Count one request with this shared prefix; returns its count in the window."""
        slot = self._slot(now)
        item = self._items.get(prefix_hash)
        if item is None:
            item = self._items[prefix_hash] = HotPrefix(tokens, [0] * self.buckets, [-1] * self.buckets)
            while len(self._items) > self.max_tracked:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(prefix_hash)
            item.tokens = max(item.tokens, tokens)
        i = slot % self.buckets
        if item.bucket_at[i] != slot:
            item.bucket_at[i] = slot
            item.counts[i] = 0
        item.counts[i] += 1
        return self._count(item, slot)

    def _count(self, item: HotPrefix, slot: int) -> int:
        return sum(c for c, at in zip(item.counts, item.bucket_at) if slot - at < self.buckets)

    def count(self, prefix_hash: int, now: float) -> int:
        """Requests with this prefix in the window ending at `now` (count)."""
        item = self._items.get(prefix_hash)
        return 0 if item is None else self._count(item, self._slot(now))

    def is_hot(self, prefix_hash: int, now: float) -> bool:
        return self.count(prefix_hash, now) >= self.min_count

    def hottest(self, now: float, limit: int = 10) -> list[tuple[int, int, int]]:
        """The hot prefixes (at least `min_count` requests in the window): (hash, tokens, count
        in window), most requests first."""
        slot = self._slot(now)
        rows = [(h, it.tokens, self._count(it, slot)) for h, it in self._items.items()]
        rows = [r for r in rows if r[2] >= self.min_count]
        rows.sort(key=lambda r: (-r[2], -r[1]))
        return rows[:limit]
