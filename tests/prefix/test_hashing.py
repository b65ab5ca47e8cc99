from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from extproc.prefix.hashing import ROOT_HASH, cacheable_blocks, chain_block_hashes


def test_one_hash_per_full_block_chained_on_the_parent():
    ids = list(range(40))
    hashes = chain_block_hashes(ids, 16)
    assert len(hashes) == 2  # the trailing 8 tokens are no block
    assert chain_block_hashes(ids[:32], 16) == hashes
    # the second block's hash depends on the first block: same tokens after another prefix differ
    other = chain_block_hashes([999] + ids[1:32], 16)
    assert other[1] != hashes[1]
    # continuing a chain from a parent equals hashing the whole prompt
    assert chain_block_hashes(ids[16:32], 16, parent=hashes[0]) == hashes[1:]
    assert all(0 <= h < 2**64 for h in hashes)
    assert chain_block_hashes(ids[:15], 16) == [] and chain_block_hashes([], 16) == []


def test_hash_is_the_same_in_two_processes():
    """No Python hash(): two processes with different hash seeds agree on every block."""
    ids = [151644, 872, 198] + list(range(1000, 1200))
    code = "import json,sys; from extproc.prefix.hashing import chain_block_hashes; print(json.dumps(chain_block_hashes(json.loads(sys.argv[1]), 16)))"
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(ids)], capture_output=True, text=True, env=env, check=True)
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1] == chain_block_hashes(ids, 16)


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, ["a"] * 16])
def test_bad_token_ids_are_a_clear_error(bad):
    with pytest.raises(ValueError, match="token ids"):
        chain_block_hashes(bad, 16)
    with pytest.raises(ValueError, match="block_size"):
        chain_block_hashes([1] * 16, 0)


def test_cacheable_blocks_leave_the_last_token_to_compute():
    assert cacheable_blocks(16, 16) == 0  # vLLM computes the last token: a 16-token prompt hits nothing
    assert cacheable_blocks(17, 16) == 1
    assert cacheable_blocks(33, 16) == 2
    assert cacheable_blocks(0, 16) == 0 and cacheable_blocks(1, 16) == 0
    assert ROOT_HASH == 0
