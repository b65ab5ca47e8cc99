"""vLLM's KV-cache events on the wire: decode a payload into our own dataclasses, and encode
one (the simulator publishes the same bytes).

The format (vLLM `vllm/distributed/kv_events.py`, read at the versions below; msgspec structs
encoded with `msgspec.msgpack`):

* Transport: a ZMQ PUB socket (`KVEventsConfig.endpoint`, default `tcp://*:5557`) sends one
  multipart message per engine step that changed the prefix cache: ``[topic, seq, payload]``,
  `topic` the configured bytes (default empty), `seq` an 8-byte big-endian unsigned counter
  starting at 0 per publisher process, `payload` one msgpack `KVEventBatch`. An optional ROUTER
  socket (`replay_endpoint`) answers ``[b"", start_seq(8 B big-endian)]`` with one
  ``[b"", seq, payload]`` per buffered batch at or after `start_seq` (the last `buffer_steps`),
  then ``[b"", -1 (8 B signed), b""]``. With data parallelism, rank r publishes on port + r.
* Batch: ``[ts, events]`` (vLLM ≤ 0.9), ``[ts, events, data_parallel_rank]`` (0.9.1+): a
  positional array (`array_like=True`). Decoded here also as a map ``{"ts", "events", ...}``,
  in case the envelope follows the events to named fields.
* Event: a msgspec tagged union (`tag=True`, the tag is the class name):
  - up to vLLM 0.2x (`array_like=True`): a *positional array* whose first element is the tag,
    ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]``, then
    `medium` (0.9.2+), `lora_name`, `extra_keys`, `group_idx`, `kv_cache_spec_kind`,
    `kv_cache_spec_sliding_window` as fields were added (trailing defaulted fields omitted);
    ``["BlockRemoved", block_hashes(, medium, group_idx)]``; ``["AllBlocksCleared"]``.
  - since vLLM PR #42892 (mid 2026): a *map* with the tag under ``"type"`` and named fields,
    ``{"type": "BlockStored", "block_hashes": [...], ...}``; fields equal to their default
    (`extra_keys`, `group_idx`, ... when None) may be absent.
* Block hashes: unsigned 64-bit ints by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), raw
  bytes (sha256 digests) when that is 0. `parent_block_hash` is None for a prompt's first block.
  `token_ids` are the tokens of exactly the stored blocks (`len(block_hashes) × block_size`).

Decoding is tolerant by design: fields we do not know are ignored, missing optional ones are
None, and both event shapes may appear in one batch (a fleet mid-upgrade). Anything else that
is wrong raises `KVEventDecodeError` naming what, so a subscriber skips that batch and counts
it instead of crashing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

__all__ = [
    "EngineBlockHash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecodeError",
    "decode_batch",
    "encode_batch",
    "decode_seq",
    "encode_seq",
    "REPLAY_END_SEQ",
    "MEDIUM_GPU",
    "token_span_ok",
]

EngineBlockHash = int | bytes
"""A block hash as the engine publishes it (int, or bytes with sha256 and int hashes off).
It depends on the engine's hash seed, so it only ever names a block *on that engine*."""

MEDIUM_GPU = "GPU"
"""vLLM's `medium` of blocks in GPU memory (offload connectors publish other media)."""

REPLAY_END_SEQ = -1
"""The sequence number of the replay socket's end-of-replay marker."""

_MAX_LIST = 1 << 20  # block hashes / token ids in one event: far above any real batch
_TOKEN_ID_LIMIT = 1 << 32  # vocabularies are far smaller; our block hashes pack ids as uint32


class KVEventDecodeError(ValueError):
    """A payload that is not a vLLM `KVEventBatch` (the message names the first problem)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks the engine added to its prefix cache, a chain continuing `parent_block_hash`.

    Attributes:
        block_hashes: the engine's hashes of the stored blocks, first block first.
        parent_block_hash: the engine hash of the block before the first one (None: the first
            stored block starts the prompt).
        token_ids: the stored blocks' tokens (`len(block_hashes) × block_size` of them).
        block_size: tokens per block.
        lora_id, lora_name: the LoRA adapter whose KV this is (None: the base model).
        medium: where the blocks live (`"GPU"`; None from vLLM before `medium` existed).
        extra_keys: per block, the extra hash inputs (multimodal ids, cache salt, ...), or None.
        group_idx: the KV-cache group (hybrid models have several; None before it existed).
    """

    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted from its prefix cache (engine hashes)."""

    block_hashes: tuple[EngineBlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (`/reset_prefix_cache`)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One engine step's events.

    Attributes:
        ts: the engine's wall clock when the batch was built (Unix seconds).
        events: in the order the engine made them.
        data_parallel_rank: the publishing DP rank (None from vLLM before it existed).
    """

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# -- decoding -------------------------------------------------------------------------------
# Positional field order of each tagged-array event (after the tag), oldest fields first.
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one `KVEventBatch` payload (either event shape, see the module doc).

    Args:
        payload: the third frame of a PUB message (or of a replay answer).

    Returns:
        The batch, events in order. Unknown fields are ignored.

    Raises:
        KVEventDecodeError: not msgpack, not a batch, an unknown event tag, or a field of the
            wrong type (e.g. a token id that is not an int).
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise KVEventDecodeError(f"batch array needs [ts, events(, dp_rank)], got {len(obj)} element(s)")
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        if "events" not in obj:
            raise KVEventDecodeError("batch map has no 'events'")
        ts, events, rank = obj.get("ts"), obj["events"], obj.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"batch is a msgpack {type(obj).__name__}, expected an array")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise KVEventDecodeError(f"batch events must be an array, got {type(events).__name__}")
    out = tuple(_decode_event(ev, i) for i, ev in enumerate(events))
    return KVEventBatch(float(ts), out, _opt_int(rank, "data_parallel_rank"))


def _decode_event(ev: Any, i: int) -> KVEvent:
    if isinstance(ev, list):
        if not ev or not isinstance(ev[0], str):
            raise KVEventDecodeError(f"event {i}: a tagged array must start with its type name")
        tag, fields = ev[0], ev[1:]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        named = dict(zip(names, fields, strict=False))
        if tag == "BlockStored" and len(fields) < 5 or tag == "BlockRemoved" and not fields:
            raise KVEventDecodeError(f"event {i}: {tag} has {len(fields)} field(s), fewer than vLLM ever sent")
    elif isinstance(ev, dict):
        tag = ev.get("type")
        if not isinstance(tag, str):
            raise KVEventDecodeError(f"event {i}: a tagged map needs a string 'type'")
        named = ev
    else:
        raise KVEventDecodeError(f"event {i}: expected an array or a map, got {type(ev).__name__}")
    try:
        if tag == "BlockStored":
            return _stored(named)
        if tag == "BlockRemoved":
            return BlockRemoved(
                _hashes(named, "block_hashes"), _opt_str(named.get("medium"), "medium"), _opt_int(named.get("group_idx"), "group_idx")
            )
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except KVEventDecodeError as exc:
        raise KVEventDecodeError(f"event {i} ({tag}): {exc}") from None
    raise KVEventDecodeError(f"event {i}: unknown event type {tag!r}")


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hashes(f, "block_hashes")
    parent = f.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise KVEventDecodeError(f"parent_block_hash must be an int, bytes or nil, got {type(parent).__name__}")
    tokens = f.get("token_ids")
    if not isinstance(tokens, list) or len(tokens) > _MAX_LIST:
        raise KVEventDecodeError("token_ids must be an array")
    for t in tokens:
        if type(t) is not int or not 0 <= t < _TOKEN_ID_LIMIT:
            raise KVEventDecodeError(f"token_ids must be ints in 0..2^32-1, got {t!r}")
    size = f.get("block_size")
    if type(size) is not int or size <= 0:
        raise KVEventDecodeError(f"block_size must be a positive int, got {size!r}")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise KVEventDecodeError(f"extra_keys must be an array or nil, got {type(extra).__name__}")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(tokens),
        block_size=size,
        lora_id=_opt_int(f.get("lora_id"), "lora_id"),
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=_opt_str(f.get("lora_name"), "lora_name"),
        extra_keys=tuple(_freeze(x) for x in extra) if extra is not None else None,
        group_idx=_opt_int(f.get("group_idx"), "group_idx"),
    )


def _is_hash(v: Any) -> bool:
    return (type(v) is int and v >= 0) or isinstance(v, bytes)


def _hashes(f: dict[str, Any], name: str) -> tuple[EngineBlockHash, ...]:
    v = f.get(name)
    if not isinstance(v, list) or len(v) > _MAX_LIST:
        raise KVEventDecodeError(f"{name} must be an array")
    for h in v:
        if not _is_hash(h):
            raise KVEventDecodeError(f"{name} must hold non-negative ints or bytes, got {h!r}")
    return tuple(v)


def _opt_int(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if type(v) is not int:
        raise KVEventDecodeError(f"{name} must be an int or nil, got {v!r}")
    return v


def _opt_str(v: Any, name: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise KVEventDecodeError(f"{name} must be a string or nil, got {v!r}")
    return v


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


# -- encoding (the simulator's publisher) ---------------------------------------------------
def encode_batch(batch: KVEventBatch, *, event_shape: Literal["map", "array"] = "map") -> bytes:
    """Encode a batch as vLLM does: a positional `[ts, events, data_parallel_rank]` envelope;
    events as tagged maps (`"map"`, vLLM since PR #42892) or as tagged arrays (`"array"`, earlier
    vLLM, up to `medium`). Fields vLLM omits when at their default (None) are omitted.

    Raises:
        ValueError: an unknown `event_shape`.
    """
    if event_shape not in ("map", "array"):
        raise ValueError(f"event_shape must be 'map' or 'array', got {event_shape!r}")
    events = [_encode_event(e, event_shape) for e in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def _encode_event(e: KVEvent, shape: str) -> Any:
    if isinstance(e, BlockStored):
        if shape == "array":
            return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, e.lora_id, e.medium]
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(e.block_hashes),
            "parent_block_hash": e.parent_block_hash,
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "lora_id": e.lora_id,
            "medium": e.medium,
            "lora_name": e.lora_name,
        }
        if e.extra_keys is not None:
            out["extra_keys"] = list(e.extra_keys)
        if e.group_idx is not None:
            out["group_idx"] = e.group_idx
        return out
    if isinstance(e, BlockRemoved):
        if shape == "array":
            return ["BlockRemoved", list(e.block_hashes), e.medium]
        out = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
        if e.group_idx is not None:
            out["group_idx"] = e.group_idx
        return out
    return ["AllBlocksCleared"] if shape == "array" else {"type": "AllBlocksCleared"}


def encode_seq(seq: int) -> bytes:
    """A sequence-number frame: 8 bytes, big-endian, signed (−1 ends a replay)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """The sequence number in a frame (see `encode_seq`).

    Raises:
        KVEventDecodeError: the frame is not 8 bytes.
    """
    if len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def token_span_ok(event: BlockStored) -> bool:
    """Whether a store event's tokens cover exactly its blocks (vLLM always sends that)."""
    return len(event.token_ids) == len(event.block_hashes) * event.block_size

