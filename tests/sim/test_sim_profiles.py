"""Profiles: KV capacities reproduce the calibration's read numbers; scaling follows DESIGN 5b."""

from __future__ import annotations

import pytest

from extproc.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile


@pytest.mark.parametrize(
    ("name", "tokens"),
    [
        ("h100-qwen3-8b", 366_400),  # LMCache FAQ: Qwen3-8B, 50.32 GB spare (calibration §1)
        ("h100-llama-3.1-70b-tp4", 420_208),  # LMCache FAQ: 70B TP4 on H100 (calibration §1)
        ("h100-llama-3.1-8b", 415_000),  # calibration §1 inference: ≈415k
        ("h100-llama-3.1-70b-tp8", 1_270_000),  # calibration §1 inference: ≈1.27M
    ],
    ids=["qwen3-8b", "llama-70b-tp4", "llama-8b", "llama-70b-tp8"],
)
def test_kv_capacity_matches_calibration(name: str, tokens: int) -> None:
    assert get_profile(name).kv_capacity_tokens() == pytest.approx(tokens, rel=0.005)


def test_issue_profiles_exist_and_default_serves_qwen3_8b_on_h100() -> None:
    for name in ("h100-qwen3-8b", "a100-qwen3-8b", "h100-llama-3.1-8b", "a100-llama-3.1-8b",
                 "h100-llama-3.1-70b-tp4", "a100-llama-3.1-70b-tp4", "h100-qwen3-32b-tp2"):
        assert name in PROFILES
    default = get_profile(DEFAULT_PROFILE)
    assert default.model == "Qwen/Qwen3-8B" and default.gpu.name == "h100"


def test_vllm_scheduler_defaults_per_gpu() -> None:
    # calibration §11: 8192 tokens / 1024 seqs on H100, 2048 / 256 on A100
    assert (get_profile("h100-qwen3-8b").max_num_batched_tokens, get_profile("h100-qwen3-8b").max_num_seqs) == (8192, 1024)
    assert (get_profile("a100-qwen3-8b").max_num_batched_tokens, get_profile("a100-qwen3-8b").max_num_seqs) == (2048, 256)


def test_qwen3_8b_is_scaled_from_llama_8b() -> None:
    q, ll = get_profile("h100-qwen3-8b").coefficients, get_profile("h100-llama-3.1-8b").coefficients
    assert q.b / ll.b == pytest.approx(8_190_735_360 / 8_030_261_248)  # parameters
    assert q.d / ll.d == pytest.approx(147_456 / 131_072)  # KV bytes per token
    assert q.q / ll.q == pytest.approx(36 / 32)  # attention FLOPs: layers × heads × head_dim


def test_every_profile_cites_its_source() -> None:
    for p in PROFILES.values():
        assert "calibration §" in p.source, p.name


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="h100-qwen3-8b"):
        get_profile("h100-gpt-5")
