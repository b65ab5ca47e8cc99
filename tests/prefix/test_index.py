from __future__ import annotations

import random
import tracemalloc

import pytest

from extproc.prefix.hashing import chain_block_hashes
from collections import OrderedDict

from extproc.prefix import index as index_module
from extproc.prefix.index import BYTES_PER_ENTRY, PrefixIndex


def _prompt(seed: int, blocks: int, shared: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    return (shared or []) + [rng.randrange(150_000) for _ in range(blocks * 16)]


def test_match_counts_leading_blocks_per_endpoint():
    idx = PrefixIndex(1000, 1000)
    system = _prompt(1, 4)
    a = chain_block_hashes(_prompt(2, 2, system), 16)
    b = chain_block_hashes(_prompt(3, 3, system), 16)
    idx.add("a", a)
    idx.add("b", b[:5])
    assert idx.match(a) == {"a": 6, "b": 4}
    assert idx.match(b) == {"a": 4, "b": 5}
    assert idx.match(chain_block_hashes(_prompt(9, 3), 16)) == {}
    assert idx.match([]) == {}
    # a hole in the chain ends the match, as in the engine's lookup
    idx.remove("a", [a[1]])
    assert idx.match(a) == {"a": 1, "b": 4}


def test_per_endpoint_capacity_evicts_deepest_blocks_of_the_oldest_prompt_first():
    idx = PrefixIndex(10_000, 10)
    old = chain_block_hashes(_prompt(1, 6), 16)
    new = chain_block_hashes(_prompt(2, 6), 16)
    idx.add("a", old)
    idx.add("a", new)
    assert idx.blocks("a") == 10
    assert idx.match(new) == {"a": 6}
    assert idx.match(old) == {"a": 4}  # its last two blocks went first
    idx.set_capacity("a", 3)
    assert idx.blocks("a") == 3 and idx.match(new) == {"a": 3}


def test_index_stays_under_its_bound_under_unique_prompts():
    idx = PrefixIndex(max_entries=5_000, default_capacity=100_000)
    for i in range(2_000):
        idx.add(f"ep{i % 4}", chain_block_hashes(_prompt(i, 8), 16))
        assert len(idx) <= 5_000
    assert len(idx) == 5_000 and idx.evictions == 2_000 * 8 - 5_000
    assert max(idx.blocks(f"ep{i}") for i in range(4)) - min(idx.blocks(f"ep{i}") for i in range(4)) <= 1


def test_clear_forgets_an_endpoint_and_reuses_its_bit():
    idx = PrefixIndex(1000, 1000)
    h = chain_block_hashes(_prompt(1, 3), 16)
    idx.add("a", h)
    idx.add("b", h)
    assert idx.clear("a") == 3 and idx.match(h) == {"b": 3} and len(idx) == 3
    idx.add("c", h)
    assert idx.match(h) == {"b": 3, "c": 3}
    assert idx.clear("nope") == 0


def test_bytes_per_entry_measured():
    """BYTES_PER_ENTRY (the memory budget's unit) is what the index really costs."""
    hashes = [chain_block_hashes(_prompt(i, 25), 16) for i in range(400)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = PrefixIndex(10**7, 10**7)
        for i, h in enumerate(hashes):
            idx.add(f"ep{i % 4}", h)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_entry = used / len(idx)
    assert len(idx) == 10_000
    assert 0.5 * BYTES_PER_ENTRY < per_entry <= 1.25 * BYTES_PER_ENTRY, per_entry


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(0, 10)


def test_a_full_index_of_many_endpoints_scans_them_once_per_eviction_run(monkeypatch):
    # The global bound used to rescan every endpoint for each entry evicted: with 256
    # endpoints a 512-block prompt cost 131k len() calls, ~10 ms per pick on the event loop.
    calls = 0

    class Counting(OrderedDict):
        def __len__(self) -> int:
            nonlocal calls
            calls += 1
            return super().__len__()

    monkeypatch.setattr(index_module, "OrderedDict", Counting)
    idx = PrefixIndex(max_entries=256 * 64, default_capacity=10**6)
    eps = [f"10.0.0.{i}:8000" for i in range(256)]
    for n, ep in enumerate(eps):
        idx.add(ep, list(range(n * 64, (n + 1) * 64)))
    assert len(idx) == idx.max_entries
    calls = 0
    idx.add(eps[0], list(range(10**6, 10**6 + 512)))
    assert len(idx) == idx.max_entries
    assert calls < 20 * len(eps)
    # Still the biggest endpoint that pays: eps[0] holds the new prompt, 512 - 64 of it evicted
    # from itself until it is no bigger than the others.
    assert idx.blocks(eps[0]) <= 64 + 1 and all(idx.blocks(ep) >= 63 for ep in eps[1:])
