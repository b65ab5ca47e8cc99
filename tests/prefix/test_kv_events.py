"""KV events decoded from bytes in vLLM's wire format (`extproc.prefix.kv_events`).

vLLM encodes its msgspec structs with `msgspec.msgpack`: an `array_like` struct is a msgpack
array of its fields in declaration order (trailing defaulted fields omitted), a tagged struct
carries its class name first (array) or under "type" (map), floats are float64 and ints take
their smallest msgpack form — exactly what `msgpack.packb` produces for the same Python values,
so the payloads below are built with it from the documented layouts. Two are also spelled out
byte by byte, so a change of format (ours or theirs) fails here.
"""

from __future__ import annotations

import msgpack
import pytest

from extproc.prefix.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

# [1.5, [["BlockStored", [123], nil, [1, 2, 3, 4], 4, nil, "GPU"]], 0]: vLLM 0.9.2–0.2x, one
# BlockStored of one 4-token block, DP rank 0, spelled out per the msgpack spec.
LEGACY_STORED_BATCH = bytes.fromhex(
    "93"  # fixarray(3): the batch [ts, events, data_parallel_rank]
    "cb3ff8000000000000"  # float64 1.5
    "91"  # fixarray(1): events
    "97"  # fixarray(7): the event, tag first
    "ab" + b"BlockStored".hex() +  # fixstr(11)
    "917b"  # block_hashes [123]
    "c0"  # parent_block_hash nil
    "9401020304"  # token_ids [1, 2, 3, 4]
    "04"  # block_size 4
    "c0"  # lora_id nil
    "a3" + b"GPU".hex() +  # medium
    "00"  # data_parallel_rank 0
)

# [2.0, [{"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU"}], 1]: vLLM after
# PR #42892 (events as tagged maps), a removal of a hash at the top of the uint64 range.
MAP_REMOVED_BATCH = bytes.fromhex(
    "93" "cb4000000000000000" "91"
    "83"  # fixmap(3)
    "a4" + b"type".hex() + "ac" + b"BlockRemoved".hex() +
    "ac" + b"block_hashes".hex() + "91" "cfffffffffffffffff" +  # uint64
    "a6" + b"medium".hex() + "a3" + b"GPU".hex() +
    "01"
)


def test_legacy_array_bytes_decode() -> None:
    batch = decode_batch(LEGACY_STORED_BATCH)
    assert batch == KVEventBatch(1.5, (BlockStored((123,), None, (1, 2, 3, 4), 4, None, "GPU"),), 0)


def test_map_bytes_decode() -> None:
    batch = decode_batch(MAP_REMOVED_BATCH)
    assert batch == KVEventBatch(2.0, (BlockRemoved((2**64 - 1,), "GPU"),), 1)


def test_our_encoder_writes_the_pinned_bytes() -> None:
    # The simulator publishes with encode_batch: it must write exactly vLLM's bytes.
    stored = BlockStored((123,), None, (1, 2, 3, 4), 4, None, "GPU")
    assert encode_batch(KVEventBatch(1.5, (stored,), 0), event_shape="array") == LEGACY_STORED_BATCH
    removed = BlockRemoved((2**64 - 1,), "GPU")
    assert encode_batch(KVEventBatch(2.0, (removed,), 1)) == MAP_REMOVED_BATCH


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        pytest.param(
            # vLLM 0.9.0: 5-field BlockStored, 1-field BlockRemoved, 2-element batch below
            [["BlockStored", [7, 8], 6, list(range(32)), 16, None], ["BlockRemoved", [6]], ["AllBlocksCleared"]],
            (BlockStored((7, 8), 6, tuple(range(32)), 16), BlockRemoved((6,)), AllBlocksCleared()),
            id="v0.9.0-arrays",
        ),
        pytest.param(
            # lora_name, extra_keys, group_idx appended (0.11+), unknown trailing fields ignored
            [["BlockStored", [7], None, list(range(16)), 16, 3, "GPU", "adapter", [None], 0, "full_attention", None]],
            (BlockStored((7,), None, tuple(range(16)), 16, 3, "GPU", "adapter", (None,), 0),),
            id="newest-arrays",
        ),
        pytest.param(
            # tagged maps with sha256 (bytes) hashes, omitted defaults and an unknown key
            [
                {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32,
                 "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
                 "lora_name": None, "kv_cache_spec_kind": "full_attention", "cache_salt": None},
                {"type": "AllBlocksCleared"},
            ],
            (BlockStored((b"\x01" * 32,), b"\x02" * 32, tuple(range(16)), 16, None, "GPU"), AllBlocksCleared()),
            id="maps-bytes-hashes",
        ),
        pytest.param(
            # a fleet mid-upgrade: both shapes in one batch
            [["BlockRemoved", [1], "GPU"], {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU", "group_idx": 1}],
            (BlockRemoved((1,), "GPU"), BlockRemoved((2,), "CPU", 1)),
            id="mixed",
        ),
    ],
)
def test_vllm_versions_decode(events: list, expected: tuple) -> None:
    for envelope in ([12.5, events], [12.5, events, None], {"ts": 12.5, "events": events}):
        batch = decode_batch(msgpack.packb(envelope))
        assert batch.events == expected
        assert batch.ts == 12.5


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        pytest.param(b"\xc1", "not msgpack", id="reserved-byte"),
        pytest.param(b"\x93\x01", "not msgpack", id="truncated"),
        pytest.param(msgpack.packb("hello"), "expected an array", id="not-a-batch"),
        pytest.param(msgpack.packb([1.0]), "batch array needs", id="short-batch"),
        pytest.param(msgpack.packb(["x", []]), "ts must be a number", id="ts-type"),
        pytest.param(msgpack.packb([1.0, {}]), "events must be an array", id="events-type"),
        pytest.param(msgpack.packb([1.0, [["BlockMoved", [1]]]]), "unknown event type 'BlockMoved'", id="unknown-tag"),
        pytest.param(msgpack.packb([1.0, [[7, [1]]]]), "must start with its type name", id="untagged"),
        pytest.param(msgpack.packb([1.0, [{"block_hashes": [1]}]]), "needs a string 'type'", id="map-untagged"),
        pytest.param(msgpack.packb([1.0, [["BlockStored", [1], None, [1]]]]), "fewer than vLLM ever sent", id="short-stored"),
        pytest.param(msgpack.packb([1.0, [["BlockStored", [1], None, [1, "a"], 2, None]]]), "token_ids", id="token-type"),
        pytest.param(msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2**32], 2, None]]]), "token_ids", id="token-range"),
        pytest.param(msgpack.packb([1.0, [["BlockStored", [-1], None, [1, 2], 2, None]]]), "block_hashes", id="negative-hash"),
        pytest.param(msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 0, None]]]), "block_size", id="zero-block"),
        pytest.param(msgpack.packb([1.0, [["BlockStored", [1], 1.5, [1, 2], 2, None]]]), "parent_block_hash", id="parent-type"),
        pytest.param(msgpack.packb([1.0, [["BlockRemoved"]]]), "fewer than vLLM ever sent", id="empty-removed"),
        pytest.param(msgpack.packb([1.0, [["BlockRemoved", [1], 5]]]), "medium", id="medium-type"),
        pytest.param(msgpack.packb([1.0, [1, 2]]), "expected an array or a map", id="event-type"),
    ],
)
def test_malformed_payloads_raise_a_clear_error(payload: bytes, match: str) -> None:
    with pytest.raises(KVEventDecodeError, match=match):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert encode_seq(5) == b"\x00\x00\x00\x00\x00\x00\x00\x05"  # vLLM: seq.to_bytes(8, "big")
    assert decode_seq(b"\xff" * 8) == -1  # the replay's end marker
    with pytest.raises(KVEventDecodeError, match="8 bytes"):
        decode_seq(b"\x00")
