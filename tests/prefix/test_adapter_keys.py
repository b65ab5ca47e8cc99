"""The prefix index is keyed by LoRA adapter and cache salt: the same prompt cached for adapter A
must not attract adapter B (nor the base model, nor another salt) — in the approximate index
(picks) and in the precise one (KV events' `lora_name` / `extra_keys`)."""

from __future__ import annotations

from extproc.config.schema import EndpointConfig, PrefixConfig
from extproc.datastore.endpoints import Datastore
from extproc.prefix.hashing import ROOT_HASH, chain_block_hashes, root_hash
from extproc.prefix.kv_events import BlockStored, KVEventBatch
from extproc.prefix.precise import PreciseIndexer
from extproc.prefix.tracker import PrefixTracker
from extproc.types import LLMRequest, RequestKind, TokenCount

BS = 16
PROMPT = list(range(2000, 2000 + 8 * BS + 3))  # eight full blocks and a partial one


def _request(adapter: str | None = None, salt: str | None = None) -> LLMRequest:
    return LLMRequest(
        kind=RequestKind.COMPLETION, model=adapter or "m", served_model="m", prompt_tokens=TokenCount(len(PROMPT)),
        token_ids=PROMPT, adapter=adapter, cache_salt=salt,
    )


def test_roots_differ_by_adapter_and_salt_and_the_base_keeps_the_old_root():
    roots = {root_hash(), root_hash("A"), root_hash("B"), root_hash(None, "s"), root_hash("A", "s")}
    assert len(roots) == 5 and root_hash() == ROOT_HASH
    assert root_hash("A") == root_hash("A")  # stable across calls (and processes: BLAKE2b)


def test_approximate_index_adapter_a_does_not_attract_adapter_b():
    store = Datastore([EndpointConfig(address=f"10.0.0.{i}:8000", models=["m"]) for i in (1, 2)])
    a_ep, other = store.all()
    tracker = PrefixTracker(PrefixConfig(min_match_tokens=0))
    match_a = tracker.lookup(_request("A"), store.all(), lambda ep: BS)
    assert match_a is not None and not match_a.matched
    tracker.on_pick(a_ep, BS, match_a, None, candidates=store.all(), token_ids=PROMPT, model="A")
    again = tracker.lookup(_request("A"), store.all(), lambda ep: BS)
    assert again is not None and again.matched == {a_ep.address: 8}
    for req in (_request("B"), _request(None), _request("A", salt="tenant-2")):
        other_match = tracker.lookup(req, store.all(), lambda ep: BS)
        assert other_match is not None and other_match.matched == {}, req


def test_precise_index_keys_stored_blocks_by_lora_name_and_salt():
    tracker = PrefixTracker(PrefixConfig(min_match_tokens=0))
    idx = PreciseIndexer(tracker)
    ep = "10.0.0.1:8000"
    idx.register(ep)
    ids = tuple(PROMPT[: 8 * BS])
    # vLLM: every block of an adapter carries its name in extra_keys, the first also the salt
    extra = (("A", "tenant-1"), *(("A",),) * 7)
    ev = BlockStored(tuple(range(901, 909)), None, ids, BS, medium="GPU", lora_name="A", extra_keys=extra)
    idx.apply(ep, KVEventBatch(0.0, (ev,), 0))
    as_a = chain_block_hashes(PROMPT, BS, root_hash("A", "tenant-1"))
    assert tracker.index.match(as_a) == {ep: 8}
    for other in (root_hash("B", "tenant-1"), root_hash("A"), ROOT_HASH):
        assert tracker.index.match(chain_block_hashes(PROMPT, BS, other)) == {}
    # a run continuing the chain keys on its parent: the adapter stays in it
    more = list(range(5000, 5000 + BS))
    ev2 = BlockStored((909,), 908, tuple(more), BS, medium="GPU", lora_name="A", extra_keys=(("A",),))
    idx.apply(ep, KVEventBatch(0.1, (ev2,), 1))
    assert tracker.index.match(chain_block_hashes(PROMPT[: 8 * BS] + more, BS, root_hash("A", "tenant-1"))) == {ep: 9}
