"""The KV block pool: allocation, LRU eviction of cached blocks, prefix hits, usage."""

from __future__ import annotations

import pytest

from extproc.sim.blocks import BlockPool, NoFreeBlocksError, chain_block_hashes


def test_hashes_chain_on_the_parent() -> None:
    a = chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2  # the trailing partial block has no hash
    assert a[1] != b[1]  # same tokens in block 1, different parents


def test_freed_blocks_stay_findable_until_reused() -> None:
    pool = BlockPool(4, 2)
    hashes = chain_block_hashes([1, 2, 3, 4], 2)
    blocks = pool.allocate(2)
    for bid, h in zip(blocks, hashes, strict=True):
        pool.register(bid, h)
    pool.free(blocks)
    assert pool.num_free == 4 and pool.usage == 0.0  # cached blocks count as free
    hit, in_free = pool.find_cached_prefix(hashes, 2)
    assert hit == blocks and in_free == 2
    pool.touch(hit)
    assert pool.num_free == 2 and pool.usage == 0.5


def test_allocation_evicts_least_recently_freed_first() -> None:
    pool = BlockPool(3, 1)
    first = pool.allocate(3)
    for i, bid in enumerate(first):
        pool.register(bid, i + 100)
    pool.free([first[0]])
    pool.free([first[1]])
    pool.free([first[2]])
    assert pool.allocate(1) == [first[0]]  # the oldest free block goes first, losing its hash
    assert pool.find_cached_prefix([100], 1)[0] == []
    assert pool.find_cached_prefix([101], 1)[0] == [first[1]]


def test_request_frees_tail_first_so_its_prefix_survives_longest() -> None:
    pool = BlockPool(3, 1)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.allocate(1) == [blocks[2]]


def test_over_allocation_raises() -> None:
    pool = BlockPool(2, 16)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)


@pytest.mark.parametrize(("blocks", "size"), [(0, 16), (4, 0)], ids=["no-blocks", "no-size"])
def test_sizes_must_be_positive(blocks: int, size: int) -> None:
    with pytest.raises(ValueError):
        BlockPool(blocks, size)
