"""The KV block pool with automatic prefix caching, shaped like vLLM V1's `KVCacheManager`.

* `num_blocks` blocks of `block_size` tokens; each has a reference count and, once full, a hash.
* Block hashes chain on the parent block: ``h_i = hash((h_{i-1}, tokens of block i))``, so a
  hash names the whole prefix up to and including its block (vLLM's `hash_block_tokens`).
* Free blocks sit in one LRU queue (an `OrderedDict`, O(1) at both ends and for removal from
  the middle; a plain dict degrades when popped from the front): allocation takes from the head
  and, if the block still carries a hash, evicts that cache entry. Blocks released by a finished
  request go to the tail *with their hash kept*, so a later request with the same prefix can
  take them back (a "hit") until they are evicted. A request frees its blocks tail-first, so a
  prefix's last blocks are evicted before its first ones, as in vLLM.
* Usage (vLLM's `kv_cache_usage_perc`) = 1 − free/total, where cached-but-free blocks count as
  free.

KV-cache events (vLLM's `KVEventsConfig.enable_kv_cache_events`), when `record_events` is on:
the engine announces the blocks it registers (`BlockStored`, built by the engine, which knows
the tokens); the pool records `BlockRemoved` when an announced block's cache entry is evicted and
`AllBlocksCleared` on `reset_prefix_cache`. `take_events()` hands them over once per engine step.
Only a block that became the cache entry for its hash is announced, so every store is matched
by exactly one removal. On the wire a hash is its unsigned 64-bit value (`wire_hash`).

Everything is synchronous and O(blocks touched); no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from extproc.prefix.kv_events import AllBlocksCleared, BlockRemoved, KVEvent
from extproc.types import BlockHash

__all__ = ["BlockPool", "NoFreeBlocksError", "chain_block_hashes", "wire_hash"]

_U64 = (1 << 64) - 1


def wire_hash(h: BlockHash) -> int:
    """A simulator block hash as vLLM publishes hashes: an unsigned 64-bit int."""
    return h & _U64


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free (callers check first)."""


def chain_block_hashes(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, each chained on its parent's.

    Args:
        token_ids: the prompt's token ids.
        block_size: tokens per block.
        seed: the chain's root (vLLM uses a fixed `NONE_HASH`); 0 by default.

    Returns:
        One hash per *full* block (a trailing partial block has none).
    """
    out: list[BlockHash] = []
    parent = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(BlockHash(parent))
    return out


class BlockPool:
    """A pool of KV blocks with an LRU prefix cache.

    Args:
        num_blocks: pool size (blocks), > 0.
        block_size: tokens per block, > 0.
        enable_caching: keep freed full blocks findable by hash (vLLM's prefix caching).
        record_events: keep KV-cache events for `take_events` (see the module doc).

    Raises:
        ValueError: a size is not positive.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._announced = [False] * num_blocks
        self.events: list[KVEvent] | None = [] if record_events else None

    # -- queries --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now, cached-but-unreferenced ones included (blocks)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request (blocks)."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1 (vLLM's `kv_cache_usage_perc`)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (referenced or not)."""
        return len(self._cached)

    def find_cached_prefix(self, hashes: Sequence[BlockHash], max_blocks: int) -> tuple[list[int], int]:
        """The longest run of leading blocks whose hashes are cached, without taking them.

        Args:
            hashes: the request's chained block hashes.
            max_blocks: look at most this many blocks (vLLM leaves the last prompt token to
                compute, so callers pass ``(prompt_tokens − 1) // block_size``).

        Returns:
            (block ids, how many of them are currently free, i.e. would leave the free queue).
        """
        if not self.enable_caching:
            return [], 0
        ids: list[int] = []
        in_free = 0
        for h in hashes[:max_blocks]:
            bid = self._cached.get(h)
            if bid is None:
                break
            ids.append(bid)
            if self._ref[bid] == 0:
                in_free += 1
        return ids, in_free

    # -- mutations ------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks found by `find_cached_prefix` (a prefix hit)."""
        for bid in block_ids:
            if self._ref[bid] == 0:
                del self._free[bid]
            self._ref[bid] += 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue, evicting their cache entries.

        Raises:
            NoFreeBlocksError: fewer than `n` blocks are free.
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out: list[int] = []
        free = self._free
        evicted: list[int] = []
        for _ in range(n):
            bid = free.popitem(last=False)[0]
            h = self._hash[bid]
            if h is not None:
                if self._cached.get(h) == bid:
                    del self._cached[h]
                    if self._announced[bid]:
                        evicted.append(wire_hash(h))
                self._hash[bid] = None
                self._announced[bid] = False
            self._ref[bid] = 1
            out.append(bid)
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(tuple(evicted), medium="GPU"))
        return out

    def register(self, block_id: int, block_hash: BlockHash, *, announce: bool = False) -> bool:
        """Mark a block full with `block_hash` so later requests can hit it.

        If another block already holds that hash (two requests computed the same prefix at
        once), the first one stays the cache entry, as in vLLM.

        Args:
            announce: the caller publishes a `BlockStored` for it if this returns True (its
                eviction is then published as `BlockRemoved`).

        Returns:
            Whether the block became the cache entry for `block_hash`.
        """
        if not self.enable_caching or self._hash[block_id] is not None:
            return False
        self._hash[block_id] = block_hash
        if self._cached.setdefault(block_hash, block_id) != block_id:
            return False
        self._announced[block_id] = announce and self.events is not None
        return True

    def take_events(self) -> list[KVEvent]:
        """The KV-cache events recorded since the last call (empty when not recording)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry, as vLLM's `/reset_prefix_cache`: only when no block is in
        use (vLLM refuses otherwise). Records `AllBlocksCleared`. Returns whether it reset."""
        if self.num_used:
            return False
        self._hash = [None] * self.num_blocks
        self._announced = [False] * self.num_blocks
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, tail first; unreferenced blocks join the free queue."""
        for bid in reversed(block_ids):
            self._ref[bid] -= 1
            if self._ref[bid] == 0:
                self._free[bid] = None

    def reset(self) -> None:
        """Forget everything: all blocks free, no cache entries (an engine restart)."""
        self._ref = [0] * self.num_blocks
        self._hash = [None] * self.num_blocks
        self._cached.clear()
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._announced = [False] * self.num_blocks
        if self.events is not None:
            self.events = []  # a restarted engine's publisher starts afresh
