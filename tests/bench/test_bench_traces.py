"""Trace readers on the hand-written fixtures in tests/testdata/traces."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from extproc.bench.chat_traces import read_sharegpt
from extproc.bench.traces import TraceFormatError, TraceRequest, detect_format, load_trace
from extproc.pipeline.tokens import TokenCounter


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("mooncake.jsonl", "mooncake"),
        ("azure.csv", "azure"),
        ("burstgpt1.csv", "burstgpt"),
        ("burstgpt3.csv", "burstgpt"),
        ("sharegpt.json", "sharegpt"),
        ("mtbench.jsonl", "mtbench"),
    ],
    ids=["mooncake", "azure", "burstgpt1", "burstgpt3", "sharegpt", "mtbench"],
)
def test_detect_format_by_content(traces_dir: Path, tmp_path: Path, name: str, fmt: str) -> None:
    assert detect_format(traces_dir / name) == fmt
    # The extension plays no part: the same bytes under a misleading name are detected alike.
    disguised = tmp_path / "trace.txt"
    shutil.copy(traces_dir / name, disguised)
    assert detect_format(disguised) == fmt


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("hello,world\n1,2\n", "unknown format"),
        ('{"foo": 1}\n', "unknown keys"),
        ("[1, 2, 3]", "unknown format"),
        ("{not json\n", "not one JSON object"),
    ],
    ids=["empty", "csv-unknown-header", "jsonl-unknown-keys", "json-array-not-sharegpt", "broken-json"],
)
def test_unknown_or_broken_files_name_the_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "mystery.dat"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path)
    assert str(path) in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_mooncake_rows_blocks_and_skips(traces_dir: Path) -> None:
    trace = load_trace(traces_dir / "mooncake.jsonl")
    assert trace.format == "mooncake"
    # 5 rows; the last asks for 0 output tokens and cannot be replayed.
    assert trace.skipped == {"zero_output_tokens": 1}
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 1.5, 2.0]  # ms → s
    assert trace.requests[1] == TraceRequest(0.5, 1200, 10, prefix_blocks=(0, 1, 2))
    assert not trace.synthesized_arrivals


def test_mooncake_malformed_row_names_file_and_line(traces_dir: Path) -> None:
    with pytest.raises(TraceFormatError) as info:
        load_trace(traces_dir / "mooncake_bad.jsonl")
    assert str(info.value).startswith(f"{traces_dir / 'mooncake_bad.jsonl'}:3: ")
    assert "input_length" in str(info.value)
    assert info.value.line == 3


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"timestamp": 1, "input_length": 5, "output_length": 2, "hash_ids": "x"}', "hash_ids"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 2}', "timestamp"),
        ('{"timestamp": 1, "input_length": 5.5, "output_length": 2}', "input_length"),
        ('{"timestamp": 1, "input_length": 5}', "output_length"),
        ("[1]", "JSON object"),
    ],
    ids=["hash-ids-not-list", "negative-time", "fractional-tokens", "missing-field", "not-an-object"],
)
def test_mooncake_bad_fields(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n' + row + "\n")
    with pytest.raises(TraceFormatError, match=message) as info:
        load_trace(path, format="mooncake")
    assert info.value.line == 2


def test_azure_wall_clock_keeps_seven_fractional_digits(traces_dir: Path) -> None:
    trace = load_trace(traces_dir / "azure.csv")
    assert trace.skipped == {"zero_output_tokens": 1}
    arrivals = [r.arrival_s for r in trace.requests]
    # 10:00:00.1234567 → .1754567 is 52 ms; → 10:00:03.1234567 is exactly 3 s.
    assert arrivals[1] == pytest.approx(0.052, abs=1e-6)
    assert arrivals[2] == pytest.approx(3.0, abs=1e-6)
    assert [(r.input_tokens, r.output_tokens) for r in trace.requests] == [(4000, 12), (3000, 8), (512, 40)]


def test_azure_bad_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-02 10:00:00.1,5,5\nyesterday,5,5\n")
    with pytest.raises(TraceFormatError, match="TIMESTAMP") as info:
        load_trace(path)
    assert info.value.line == 3


def test_burstgpt1_skips_failed_rows_and_counts_them(traces_dir: Path) -> None:
    trace = load_trace(traces_dir / "burstgpt1.csv")
    assert trace.skipped == {"zero_tokens": 2}
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in trace.requests] == [
        (0.0, 400, 20),
        (30.0, 1000, 200),
        (120.0, 2048, 100),
    ]
    assert all(r.session is None for r in trace.requests)


def test_burstgpt3_reads_sessions_by_column_name(traces_dir: Path) -> None:
    trace = load_trace(traces_dir / "burstgpt3.csv")
    assert [r.session for r in trace.requests] == [
        "aaaaaaaa-0000-4000-8000-000000000001",
        "bbbbbbbb-0000-4000-8000-000000000002",
        "aaaaaaaa-0000-4000-8000-000000000001",
        None,  # API-log rows have no session
    ]
    assert [r.arrival_s for r in trace.requests] == [0.0, 50.0, 90.5, 200.0]
    assert trace.requests[2].input_tokens == 1400


def test_csv_wrong_column_count(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,GPT-4,5,5\n")
    with pytest.raises(TraceFormatError, match="expected 6 columns") as info:
        load_trace(path)
    assert info.value.line == 2


def test_explicit_format_that_does_not_fit(traces_dir: Path) -> None:
    with pytest.raises(TraceFormatError, match="CSV header lacks"):
        load_trace(traces_dir / "burstgpt1.csv", format="azure")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(traces_dir / "burstgpt1.csv", format="parquet")


@pytest.mark.parametrize(
    ("options", "arrivals"),
    [
        ({}, [0.0, 0.5, 1.5, 2.0]),
        ({"limit": 2}, [0.0, 0.5]),
        ({"rate_scale": 2.0}, [0.0, 0.25, 0.75, 1.0]),
        ({"start_offset": 1.0}, [0.5, 1.0]),
        ({"start_offset": 0.5, "rate_scale": 0.5, "limit": 2}, [0.0, 2.0]),
    ],
    ids=["plain", "limit", "rate-scale-2x", "start-offset", "all-three"],
)
def test_options_rescale_and_cut(traces_dir: Path, options: dict, arrivals: list[float]) -> None:
    trace = load_trace(traces_dir / "mooncake.jsonl", **options)
    assert [r.arrival_s for r in trace.requests] == pytest.approx(arrivals)


@pytest.mark.parametrize(
    "options",
    [{"limit": -1}, {"rate_scale": 0}, {"start_offset": -1.0}, {"rate": 0}],
    ids=["negative-limit", "zero-rate-scale", "negative-offset", "zero-rate"],
)
def test_bad_options(traces_dir: Path, options: dict) -> None:
    with pytest.raises(ValueError):
        load_trace(traces_dir / "mooncake.jsonl", **options)


def test_sharegpt_turns_become_requests(traces_dir: Path, qwen_counter: TokenCounter) -> None:
    trace = load_trace(traces_dir / "sharegpt.json", counter=qwen_counter, rate=2.0, seed=3)
    assert trace.synthesized_arrivals
    assert trace.skipped == {"empty_conversation": 1}
    # conv_0: two answered human turns; conv_2: its leading gpt message is dropped, one answered
    # human turn ("Thanks!" has no answer, so no request).
    assert [r.session for r in trace.requests] == ["conv_0", "conv_0", "conv_2"]
    first, second, third = trace.requests
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]
    assert third.messages == [{"role": "user", "content": "Summarise it in one line."}]
    for r in trace.requests:
        assert r.input_tokens == qwen_counter.count_chat(r.messages).count
    assert second.output_tokens == len(qwen_counter.encode("Green, orange and purple, each mixed from two primaries."))
    assert first.arrival_s == 0.0 and first.arrival_s < second.arrival_s < third.arrival_s


def test_sharegpt_arrivals_are_seeded_poisson(traces_dir: Path, qwen_counter: TokenCounter) -> None:
    a = load_trace(traces_dir / "sharegpt.json", counter=qwen_counter, rate=2.0, seed=3)
    b = load_trace(traces_dir / "sharegpt.json", counter=qwen_counter, rate=2.0, seed=3)
    c = load_trace(traces_dir / "sharegpt.json", counter=qwen_counter, rate=2.0, seed=4)
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in c.requests]


def test_sharegpt_limit_stops_early(traces_dir: Path, qwen_counter: TokenCounter) -> None:
    trace = load_trace(traces_dir / "sharegpt.json", counter=qwen_counter, limit=1)
    assert len(trace.requests) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[{"id": "x"}]', "entry 0: expected an object with a 'conversations' list"),
        ('[{"id": "x", "conversations": [{"from": "human"}]}]', "needs a string 'value'"),
        ('[{"id": "x", "conversations": [{"from": "robot", "value": "hi"}]}]', "unknown 'from'"),
        ('[{"id": "x", "conversations": [\n', "invalid JSON"),
    ],
    ids=["no-conversations", "no-value", "unknown-role", "truncated-json"],
)
def test_sharegpt_malformed(tmp_path: Path, qwen_counter: TokenCounter, content: str, message: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match=message):
        list(read_sharegpt(path, counter=qwen_counter))


def test_mtbench_two_turns_with_synthesized_answer(traces_dir: Path, qwen_counter: TokenCounter) -> None:
    trace = load_trace(traces_dir / "mtbench.jsonl", counter=qwen_counter, mtbench_output_tokens=64)
    assert [r.session for r in trace.requests] == ["mtbench-81", "mtbench-81", "mtbench-82", "mtbench-82"]
    turn1, turn2 = trace.requests[:2]
    assert [m["role"] for m in turn1.messages] == ["user"]
    assert [m["role"] for m in turn2.messages] == ["user", "assistant", "user"]
    # The stand-in answer is exactly the output length the first turn asked for.
    assert len(qwen_counter.encode(turn2.messages[1]["content"])) == 64
    assert all(r.output_tokens == 64 for r in trace.requests)
    assert turn2.input_tokens == qwen_counter.count_chat(turn2.messages).count


def test_mtbench_malformed_line(tmp_path: Path, qwen_counter: TokenCounter) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["a", "b"]}\n{"question_id": 2, "turns": "oops"}\n')
    with pytest.raises(TraceFormatError, match="turns") as info:
        load_trace(path, counter=qwen_counter)
    assert info.value.line == 2
