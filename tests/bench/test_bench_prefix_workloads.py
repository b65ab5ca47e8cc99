"""The prefix benchmark's workloads and the infinite-cache oracle hit rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extproc.bench.prefix_workloads import (
    SharedPromptSpec,
    duplicate_prefills,
    oracle_hit_rate,
    sample_conversations,
    shared_system_prompt_workload,
    sharegpt_conversations,
)
from extproc.bench.prompts import PromptSynthesizer
from extproc.bench.runner import Workload, with_messages
from extproc.bench.traces import TraceRequest
from extproc.pipeline.tokens import TokenCounter


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_oracle_counts_leading_blocks_seen_before(synth: PromptSynthesizer, qwen_counter: TokenCounter) -> None:
    """A prompt sent twice: the second hits every cacheable block, the first none; a prompt that
    shares nothing adds only to the denominator."""
    text = synth.stream_text("a", 400)
    same = TraceRequest(0.0, 0, 1, messages=_user(text))
    other = TraceRequest(0.0, 0, 1, messages=_user(synth.stream_text("b", 400)))
    n = qwen_counter.count_chat(same.messages).count
    assert oracle_hit_rate([same], qwen_counter) == 0.0
    assert oracle_hit_rate([same, same], qwen_counter) == pytest.approx(((n - 1) // 16) * 16 / (2 * n))
    assert oracle_hit_rate([same, other, same], qwen_counter) == pytest.approx(((n - 1) // 16) * 16 / (3 * n))
    # a shared head, then different text: only the full blocks of the common head count
    head = synth.stream_text("head", 160)
    a = TraceRequest(0.0, 0, 1, messages=_user(head + synth.stream_text("x", 200)))
    b = TraceRequest(0.0, 0, 1, messages=_user(head + synth.stream_text("y", 200)))
    rate = oracle_hit_rate([a, b], qwen_counter)
    total = qwen_counter.count_chat(a.messages).count + qwen_counter.count_chat(b.messages).count
    assert rate is not None and 144 / total <= rate <= 176 / total  # the template's few tokens shift the blocks
    with pytest.raises(ValueError, match="messages"):
        oracle_hit_rate([TraceRequest(0.0, 10, 1)], qwen_counter)


def test_duplicate_prefills_counts_a_prefix_prefilled_where_another_endpoint_held_it(
    synth: PromptSynthesizer, qwen_counter: TokenCounter
) -> None:
    """Two system prompts of ~1k tokens: the second request of a prompt sent to the endpoint
    that holds it is no duplicate, sent elsewhere it is (its held blocks counted as tokens);
    a new prompt anywhere is none; a short shared head (< 128 tokens) is none; the order is
    the send time, not the list order; an unnamed endpoint gives None."""
    sys_a, sys_b = synth.stream_text("sys-a", 1000), synth.stream_text("sys-b", 1000)
    short = synth.stream_text("short", 40)

    def req(system: str, q: str) -> TraceRequest:
        return TraceRequest(0.0, 0, 1, messages=[{"role": "system", "content": system}, *_user(synth.stream_text(q, 50))])

    requests = [req(sys_a, "q0"), req(sys_a, "q1"), req(sys_b, "q2"), req(sys_a, "q3"), req(short, "q4"), req(short, "q5")]
    served = [(0, 0.0, "e1"), (1, 1.0, "e1"), (2, 2.0, "e2"), (3, 3.0, "e2"), (4, 4.0, "e1"), (5, 5.0, "e2")]
    dup = duplicate_prefills(requests, served, qwen_counter)
    assert dup is not None and dup.requests == 1  # only request 3: sys_a was on e1, sent to e2
    assert 960 <= dup.tokens <= 1040  # sys_a's full blocks, to a block
    # sent in another order: request 3 first to e2, then 0 and 1 to e1 — 0 is then the duplicate
    reordered = [(3, -1.0, "e2"), *served[:3]]
    assert duplicate_prefills(requests, reordered, qwen_counter).requests == 1  # type: ignore[union-attr]
    assert duplicate_prefills(requests, [(0, 0.0, "e1"), (1, 1.0, None)], qwen_counter) is None
    with pytest.raises(ValueError, match="out of range"):
        duplicate_prefills(requests, [(9, 0.0, "e1")], qwen_counter)


def test_sample_conversations_keeps_whole_conversations_at_the_trace_rate() -> None:
    """Every request opens with block 0 (a common system prompt); conversations are told apart
    by their next block, drawn whole, and the sample arrives at the trace's mean rate."""
    trace = []
    for c in range(100):  # 100 conversations of 3 turns, 1 s apart, turns 0.25 s apart in between
        for turn in range(3):
            blocks = (0, 1000 + c, *range(10_000 + 10 * c, 10_000 + 10 * c + turn + 1))
            trace.append(TraceRequest(c + 0.25 * turn, 512 * len(blocks), 5, prefix_blocks=blocks))
    trace.sort(key=lambda r: r.arrival_s)
    sample = sample_conversations(trace, 30, seed=1)
    assert len(sample) == 30 and len({r.session for r in sample}) == 10
    for session in {r.session for r in sample}:
        turns = [r for r in sample if r.session == session]
        assert [len(r.prefix_blocks or ()) for r in turns] == [3, 4, 5]
    assert sample[0].arrival_s == 0.0
    rate = (len(sample) - 1) / sample[-1].arrival_s
    assert rate == pytest.approx((len(trace) - 1) / trace[-1].arrival_s, rel=0.5)
    assert sample_conversations(trace, 30, seed=1) == sample and sample_conversations(trace, 30, seed=2) != sample


def test_sharegpt_conversations_are_multi_turn_and_share_a_start(tmp_path: Path, qwen_counter: TokenCounter) -> None:
    entries = [
        {"id": "one-turn", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "three", "conversations": [
            {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
            {"from": "human", "value": "q3 " * 50}, {"from": "gpt", "value": "a3"},
        ]},
        {"id": "two", "conversations": [
            {"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}, {"from": "human", "value": "z"},
            {"from": "gpt", "value": "w"},
        ]},
    ]  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(entries))
    out = sharegpt_conversations(path, 100, qwen_counter, conversation_rate=2.0, max_model_len=10_000)
    assert [r.session for r in out] == ["three"] * 3 + ["two"] * 2
    assert len({r.arrival_s for r in out if r.session == "three"}) == 1 and out[0].arrival_s == 0.0
    assert out[3].arrival_s > 0.0
    assert [len(r.messages or []) for r in out[:3]] == [1, 3, 5]  # each turn resends the history
    # a context that only the first two turns of "three" fit cuts it there
    limit = out[1].input_tokens + out[1].output_tokens
    cut = sharegpt_conversations(path, 100, qwen_counter, conversation_rate=2.0, max_model_len=limit)
    assert [r.session for r in cut].count("three") == 2


def test_shared_system_prompt_workload(synth: PromptSynthesizer, qwen_counter: TokenCounter) -> None:
    spec = SharedPromptSpec(requests=40, system_prompts=4, system_tokens=320, question_tokens=64, output_tokens=7,
                            rate_start=1.0, rate_end=20.0)  # fmt: skip
    requests = shared_system_prompt_workload(synth, spec)
    systems = {r.messages[0]["content"] for r in requests if r.messages}
    assert len(requests) == 40 and len(systems) == 4
    assert all(r.output_tokens == 7 and r.input_tokens == qwen_counter.count_chat(r.messages).count for r in requests if r.messages)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:])]
    assert sum(gaps[:10]) > 3 * sum(gaps[-10:])  # the rate ramps up
    oracle = oracle_hit_rate(with_messages(Workload("s", requests), synth).requests, qwen_counter)
    # 36 of 40 requests can reuse their system prompt's 320 tokens (less a partial block) of ~400
    assert oracle is not None and 0.6 < oracle < 0.8
