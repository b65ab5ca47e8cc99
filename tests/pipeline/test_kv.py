"""KV arithmetic against the worked examples in DESIGN section 5."""

from __future__ import annotations

import os

import pytest

from extproc.models import ARCHITECTURES_DIR
from extproc.pipeline.kv import MAX_CONFIG_JSON_BYTES, ModelArchitecture, blocks_for_prompts, blocks_for_request, blocks_for_tokens, load_architecture


@pytest.mark.parametrize(
    ("name", "bytes_per_token"),
    [
        ("qwen3-8b", 2 * 36 * 8 * 128 * 2),  # 147,456 B
        ("qwen3-32b", 2 * 64 * 8 * 128 * 2),  # 262,144 B
        ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),  # 131,072 B (head_dim derived: 4096 / 32)
        ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),  # 327,680 B
    ],
)
def test_builtin_architectures(name, bytes_per_token):
    arch = load_architecture(ARCHITECTURES_DIR / f"{name}.json")
    assert arch.kv_bytes_per_token() == bytes_per_token


def test_dtype_and_tensor_parallel():
    arch = load_architecture(ARCHITECTURES_DIR / "llama-3.1-70b.json")
    assert arch.kv_bytes_per_token("fp8") == 327_680 // 2
    assert arch.kv_bytes_per_token(tensor_parallel=4) == 327_680 // 4  # 80 KiB per GPU (calibration §1)
    with pytest.raises(ValueError, match="unknown dtype"):
        arch.kv_bytes_per_token("int3")


def test_mla():
    # DeepSeek-V3: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64, bf16 → 61·576·2 = 70,272 B
    arch = ModelArchitecture.from_hf_config(
        {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    )
    assert arch.kv_bytes_per_token() == 70_272


def test_missing_field_is_named():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelArchitecture.from_hf_config({"hidden_size": 1, "num_attention_heads": 1})


def test_unreadable_config_json_is_a_value_error_not_a_hang_or_a_crash(tmp_path):
    # A FIFO blocked the config load for ever, /dev/zero read until memory ran out, and JSON
    # nested past the parser's recursion limit escaped as a RecursionError (a traceback).
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_architecture(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        load_architecture("/dev/zero")
    big = tmp_path / "model.safetensors"
    big.write_bytes(b" " * (MAX_CONFIG_JSON_BYTES + 1))
    with pytest.raises(ValueError, match="over"):
        load_architecture(big)
    deep = tmp_path / "config.json"
    deep.write_text("[" * 200_000)
    with pytest.raises(ValueError, match="nested too deep"):
        load_architecture(tmp_path)  # the directory: its config.json
    deep.write_bytes(b"{\"num_hidden_layers\": \"\xff\"}")  # Latin-1, not UTF-8
    with pytest.raises(ValueError, match="UTF-8"):
        load_architecture(deep)
    with pytest.raises(FileNotFoundError):
        load_architecture(tmp_path / "absent.json")


@pytest.mark.parametrize(
    ("prompt", "output", "n", "expected"),
    [
        (0, 0, 1, 0),  # nothing to hold
        (16, 0, 1, 1),  # one full prompt block
        (16, 1, 1, 2),  # the first output token opens a new block
        (100, 28, 1, 8),  # 6 full prompt blocks (96) + tail 4 + 28 = 32 tokens → 2 blocks
        (100, 29, 1, 9),  # tail 4 + 29 = 33 tokens → 3 blocks
        (100, 28, 4, 14),  # n=4: full prompt blocks shared once, each choice its own 2 tail blocks
    ],
    ids=["empty", "one-block", "first-output-token", "tail-fits", "tail-spills", "n4"],
)
def test_blocks_for_request(prompt, output, n, expected):
    assert blocks_for_request(prompt, output, 16, n) == expected


def test_blocks_for_prompts_counts_each_prompt_of_a_batch():
    # 4 prompts of 20 tokens, 10 output tokens, n=1, blocks of 16: each 1 full prompt block +
    # ceil((4 + 10) / 16) = 2 blocks; all 8, the largest 2. As one 80-token prompt with one
    # output it was 5 + 1 = 6.
    assert blocks_for_prompts([20, 20, 20, 20], 10, 16) == (8, 2)
    assert blocks_for_prompts([100, 20], 10, 16, n=2) == (blocks_for_request(100, 10, 16, 2) + blocks_for_request(20, 10, 16, 2), blocks_for_request(100, 10, 16, 2))
    assert blocks_for_prompts([100], 28, 16) == (8, 8)  # one prompt: the same number twice
    with pytest.raises(ValueError, match="at least one prompt"):
        blocks_for_prompts([], 10, 16)


def test_blocks_for_tokens():
    assert [blocks_for_tokens(t, 16) for t in (0, 1, 16, 17)] == [0, 1, 1, 2]
