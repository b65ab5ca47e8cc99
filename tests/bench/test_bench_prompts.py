"""Synthesized prompts: exact token counts and shared prefixes under the real Qwen3 tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from extproc.bench.prompts import BLOCK_TOKENS, PromptSynthesizer, WordVocabulary
from extproc.bench.traces import TraceRequest
from extproc.pipeline.tokens import TokenCounter


def _blocks_for(n: int, first: int = 0) -> tuple[int, ...]:
    return tuple(range(first, first + -(-n // BLOCK_TOKENS)))


def test_vocabulary_words_are_single_tokens(synth: PromptSynthesizer, qwen_counter: TokenCounter) -> None:
    words = synth.vocabulary.words
    assert len(words) > 10_000
    assert list(words) == sorted(words)  # deterministic order
    rng = np.random.default_rng(0)
    sample = [words[i] for i in rng.integers(0, len(words), 300)]
    for word in sample:
        assert word.startswith(" ") and len(qwen_counter.encode(word)) == 1, word
    # ...and they stay one token each when run together.
    assert len(qwen_counter.encode("".join(sample))) == len(sample)


def test_vocabulary_is_the_same_when_derived_again(synth: PromptSynthesizer, qwen_counter: TokenCounter) -> None:
    assert WordVocabulary.from_counter(qwen_counter).words == synth.vocabulary.words


def test_too_small_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 256"):
        WordVocabulary([" a", " b"])


def test_overhead_is_the_qwen3_single_message_template(synth: PromptSynthesizer) -> None:
    # <|im_start|> user \n ... <|im_end|> \n <|im_start|> assistant \n
    assert synth.overhead == 8


@pytest.mark.parametrize("target", [9, 10, 100, 511, 512, 513, 1500, 6758, 32768], ids=lambda n: f"{n}tok")
@pytest.mark.parametrize("kind", ["blocks", "session", "unique"])
def test_templated_prompt_has_exactly_the_target_tokens(
    synth: PromptSynthesizer, qwen_counter: TokenCounter, target: int, kind: str
) -> None:
    request = TraceRequest(
        arrival_s=0.0,
        input_tokens=target,
        output_tokens=10,
        prefix_blocks=_blocks_for(target) if kind == "blocks" else None,
        session="s1" if kind == "session" else None,
    )
    messages = synth.messages_for(request, key="r1")
    assert qwen_counter.count_chat(messages).count == target


def test_target_below_the_template_gets_one_content_token(
    synth: PromptSynthesizer, qwen_counter: TokenCounter
) -> None:
    messages = synth.messages_for(TraceRequest(0.0, 3, 1), key="tiny")
    assert qwen_counter.count_chat(messages).count == synth.overhead + 1


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_shared_leading_hash_ids_share_leading_tokens(synth: PromptSynthesizer, qwen_counter: TokenCounter) -> None:
    # Mooncake rows: both start with blocks 0 and 1, then differ (2 vs 9).
    a = TraceRequest(0.0, 1400, 5, prefix_blocks=(0, 1, 2))
    b = TraceRequest(1.0, 1300, 5, prefix_blocks=(0, 1, 9))
    ids_a = qwen_counter.count_chat(synth.messages_for(a, key="a")).token_ids
    ids_b = qwen_counter.count_chat(synth.messages_for(b, key="b")).token_ids
    template_head = 3  # <|im_start|> user \n
    assert _common_prefix(ids_a, ids_b) == template_head + 2 * BLOCK_TOKENS


def test_a_block_is_the_same_text_every_time(synth: PromptSynthesizer, qwen_counter: TokenCounter) -> None:
    fresh = PromptSynthesizer(qwen_counter, synth.vocabulary, cache_blocks=1)
    assert fresh.blocks_text([7, 3], 700) == synth.blocks_text([7, 3], 700)
    # Block 3 in second place reads as block 3 in first place: ids name text, not positions.
    assert synth.blocks_text([7, 3], 1024)[len(synth.blocks_text([7], 512)) :] == synth.blocks_text([3], 512)


def test_session_turns_resend_the_earlier_prompt(synth: PromptSynthesizer) -> None:
    turn1 = synth.user_content(TraceRequest(0.0, 600, 5, session="chat-42"), key="x")
    turn2 = synth.user_content(TraceRequest(9.0, 1500, 5, session="chat-42"), key="y")
    other = synth.user_content(TraceRequest(9.0, 1500, 5, session="chat-43"), key="y")
    assert turn2.startswith(turn1)
    assert not other.startswith(turn1[:200])


def test_requests_without_blocks_or_session_get_their_own_text(synth: PromptSynthesizer) -> None:
    a = synth.user_content(TraceRequest(0.0, 300, 5), key="1")
    b = synth.user_content(TraceRequest(0.0, 300, 5), key="2")
    assert a != b
    assert a == synth.user_content(TraceRequest(5.0, 300, 7), key="1")


def test_more_tokens_than_blocks_is_refused(synth: PromptSynthesizer) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        synth.blocks_text([1], 600)


def test_real_messages_pass_through(synth: PromptSynthesizer) -> None:
    messages = [{"role": "user", "content": "hello"}]
    assert synth.messages_for(TraceRequest(0.0, 9, 5, messages=messages), key="k") is messages
