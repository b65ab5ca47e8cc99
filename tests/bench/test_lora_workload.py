"""The multi-LoRA workload (Zipf adapters, per-adapter system prompts) and the `lora` named fleet
as the bench stacks configure it (simulator options, the router's adapters and slots)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from extproc.bench.lora_workload import LoraWorkloadSpec, adapter_popularity, lora_workload
from extproc.bench.policies import POLICIES
from extproc.bench.prompts import PromptSynthesizer
from extproc.bench.stacks import StackSettings, policy_server_config
from extproc.config.loader import config_from_mapping
from extproc.stack.fleet import NAMED_FLEETS, Fleet


def test_zipf_popularity_and_a_hot_adapter():
    p = adapter_popularity(32, 1.1)
    assert p.sum() == pytest.approx(1.0) and np.all(np.diff(p) < 0)
    assert 0.25 < p[0] < 0.32  # the most popular of 32 at s = 1.1
    hot = adapter_popularity(32, 1.1, hot_share=0.4)
    assert hot[0] == pytest.approx(0.4) and hot.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        adapter_popularity(1, 1.1, hot_share=0.4)


def test_requests_name_their_adapter_and_carry_its_own_system_prompt(qwen_counter):
    prompts = PromptSynthesizer(qwen_counter)
    reqs = lora_workload(prompts, LoraWorkloadSpec(requests=300, adapters=8, system_tokens=64, user_tokens=16, seed=3))
    counts = Counter(r.model for r in reqs)
    assert counts.most_common(1)[0][0] == "adapter-00" and set(counts) <= {f"adapter-0{i}" for i in range(8)}
    system = {r.model: r.messages[0]["content"] for r in reqs}
    assert len(set(system.values())) == len(system)  # one system prompt per adapter
    assert all(r.arrival_s <= s.arrival_s for r, s in zip(reqs, reqs[1:]))
    shared = lora_workload(prompts, LoraWorkloadSpec(requests=50, adapters=4, system_tokens=64, user_tokens=16, shared_system_prompt=True))
    assert len({r.messages[0]["content"] for r in shared}) == 1


def test_lora_fleet_configures_simulators_and_the_router(tmp_path: Path):
    profiles, lora = NAMED_FLEETS["lora"].profiles, NAMED_FLEETS["lora"].lora
    assert lora is not None and len(lora.adapters) == 32 and lora.max_loras == 4
    fleet = Fleet(profiles, workdir=tmp_path, lora=lora)
    argv = fleet.sims[0].argv()
    assert argv[argv.index("--max-loras") + 1] == "4" and "adapter-31" in argv[argv.index("--lora-modules") + 1]
    settings = StackSettings(profiles=profiles, lora=lora)
    addresses = {f"127.0.0.1:{9000 + i}": p for i, p in enumerate(profiles)}
    for name in ("llm-extproc-lora", "llm-extproc-lora-activity", "llm-extproc"):
        cfg = config_from_mapping(policy_server_config(POLICIES[name], settings, addresses), env={})
        assert cfg.models[0].adapters == list(lora.adapters) and cfg.scheduling.lora_max_loras == 4
