"""LoRA in the simulator: GPU slots and a host cache (LRU), a batch of at most `max_loras`
adapters, load times from rank and size, per-adapter prefix caching, KV events carrying
`lora_name`, both metric generations read back by the router's scraper, `/v1/models` listing."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from extproc.datastore.engine_check import listed_adapters
from extproc.datastore.scraper import parse_vllm_metrics
from extproc.sim.engine import Engine, EngineConfig, SimRequest
from extproc.sim.lora import LoraLoadModel, LoraSlots
from extproc.sim.profiles import DEFAULT_PROFILE, get_profile

PROMPT = list(range(100, 100 + 64))


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(num_gpu_blocks=4000, **kw), get_profile(DEFAULT_PROFILE).coefficients)


def test_load_time_from_rank_and_size():
    m = LoraLoadModel(rank=16)
    assert m.adapter_bytes == 16 * 75_776 * 36 * 2  # 87 MB: every projection of Qwen3-8B, bf16
    assert m.seconds(from_host=False) == pytest.approx(0.030 + 87.3e6 / 1e9 + 87.3e6 / 25e9, rel=1e-3)
    assert m.seconds(from_host=True) < 0.04 < m.seconds(from_host=False)
    assert LoraLoadModel(rank=64).seconds(False) > 3 * LoraLoadModel(rank=16).seconds(False) - 0.1


def test_slots_evict_the_least_recently_used_idle_adapter_and_keep_it_in_host_memory():
    slots = LoraSlots(2, 3)
    assert slots.activate(["a", "b"], {"a", "b"}) > 0 and slots.loads_from_disk == 2
    assert slots.activate(["a"], {"a"}) == 0  # resident: no load; a is now most recent
    slots.activate(["c"], {"a", "c"})  # b is the LRU idle one
    assert list(slots.gpu) == ["a", "c"] and slots.host_only() == ["b"] and slots.evictions == 1
    t = slots.activate(["b"], {"b"})
    assert slots.loads_from_host == 1 and t == pytest.approx(LoraLoadModel().seconds(True))
    with pytest.raises(RuntimeError):
        slots.activate(["d"], {"b", "c", "d"})


def test_a_batch_holds_at_most_max_loras_adapters_and_skips_to_the_next_request():
    eng = _engine(max_loras=2)
    reqs = [SimRequest(PROMPT, 20, 0.0, lora=name) for name in ("a", "b", "c", "a")]
    for r in reqs:
        eng.add_request(r)
    plan = eng.plan()
    assert {r.lora for r, _ in plan.items} == {"a", "b"} and len(plan.items) == 3  # c skipped, the second a admitted
    assert [r.lora for r in eng.waiting] == ["c"]
    eng.commit(plan)
    eng.run()
    assert all(r.finished for r in reqs) and reqs[2].first_scheduled > 0
    assert eng.lora.loads == 3


def test_a_load_delays_the_step_and_a_resident_adapter_does_not():
    eng = _engine(max_loras=1)
    first = SimRequest(PROMPT, 2, 0.0, lora="a")
    eng.add_request(first)
    eng.run()
    again = SimRequest(list(range(5000, 5064)), 2, eng.now, lora="a")
    eng.add_request(again)
    eng.run()
    load = LoraLoadModel().seconds(False)
    assert first.ttft > load and again.ttft < load


def test_prefix_cache_is_per_adapter_and_kv_events_carry_the_adapter():
    eng = _engine(max_loras=2, enable_kv_cache_events=True)
    a = SimRequest(PROMPT, 2, 0.0, lora="a")
    eng.add_request(a)
    eng.run()
    events = eng.take_kv_events()
    assert events and all(e.lora_name == "a" and e.extra_keys == (("a",),) * len(e.block_hashes) for e in events)
    b = SimRequest(PROMPT, 2, eng.now, lora="b")
    a2 = SimRequest(PROMPT, 2, eng.now, lora="a")
    eng.add_request(b)
    eng.add_request(a2)
    eng.run()
    assert b.cached_tokens == 0 and a2.cached_tokens == 48  # 3 of 4 blocks: the last token is computed


def test_lora_request_on_an_engine_without_lora_is_refused():
    with pytest.raises(ValueError, match="without LoRA"):
        _engine().add_request(SimRequest(PROMPT, 2, 0.0, lora="a"))


@pytest.mark.parametrize("generation", ["residency", "activity"])
async def test_server_lists_adapters_serves_them_and_exports_the_chosen_metrics(start_sim, generation) -> None:
    sim = await start_sim(lora_modules=["sql", "chat"], max_loras=1, max_cpu_loras=2, lora_metrics=generation)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{sim.url}/v1/models") as resp:
            assert listed_adapters(await resp.json()) == {"sql": sim.model, "chat": sim.model}
        for model in ("sql", "chat"):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            async with http.post(f"{sim.url}/v1/chat/completions", data=orjson.dumps(body)) as resp:
                assert resp.status == 200 and (await resp.json())["model"] == model  # vLLM echoes the adapter
        async with http.post(f"{sim.url}/v1/completions", data=orjson.dumps({"model": "nope", "prompt": "x"})) as resp:
            assert resp.status == 404
        async with http.get(f"{sim.url}/metrics") as resp:
            lora = parse_vllm_metrics(await resp.text()).lora
        async with http.get(f"{sim.url}/sim/state") as resp:
            state = (await resp.json())["lora"]
    assert state["requests"] == {"sql": 1, "chat": 1} and state["loads"] == 2 and state["evictions"] == 1
    assert lora is not None and lora.generation == generation and lora.max_gpu == 1
    if generation == "residency":
        assert lora.gpu == {"chat"} and lora.cpu == {"sql"}
    else:
        assert lora.gpu == frozenset() and lora.running == frozenset()  # idle: the old metric shows nothing
