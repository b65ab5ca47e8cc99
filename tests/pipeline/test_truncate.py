"""Head + tail truncation (the design notes' `prefix = min(512, len/4)`, rest from the tail):
the token-level split, and the gateway's cut of chat and completions requests — what is kept,
that it fits, and that the count equals the real tokenizer's count of the rewritten body."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from extproc.config.schema import TruncationConfig
from extproc.errors import BadRequestError, ContextLengthError
from extproc.pipeline.tokens import TokenCounter
from extproc.pipeline.truncate import Truncated, head_tail_split, prompt_budget, truncate, truncate_head_tail, wanted
from extproc.protocol.openai import parse_body
from extproc.types import RequestKind


@pytest.mark.parametrize(
    ("length", "max_len", "head", "tail"),
    [
        (100, 200, 100, 0),  # fits: untouched
        (200, 200, 200, 0),  # exactly the budget: untouched
        (10_000, 4096, 512, 3584),  # long prompt: the full 512-token head
        (1000, 800, 250, 550),  # len/4 = 250 < 512
        (1000, 100, 50, 50),  # the notes' 250-token head would not fit: capped at max_len / 2
        (10, 1, 0, 1),  # a one-token budget keeps the last token
    ],
    ids=["fits", "exact", "long", "quarter-head", "tiny-budget", "one-token"],
)
def test_split(length: int, max_len: int, head: int, tail: int) -> None:
    assert head_tail_split(length, max_len) == (head, tail)


def test_truncate_keeps_head_and_tail_in_order() -> None:
    tokens = list(range(10_000))
    cut = truncate_head_tail(tokens, 4096)
    assert len(cut) == 4096
    assert cut[:512] == list(range(512))
    assert cut[512:] == list(range(10_000 - 3584, 10_000))


def test_truncate_returns_a_copy_when_it_fits() -> None:
    tokens = [5, 6, 7]
    cut = truncate_head_tail(tokens, 8)
    assert cut == tokens and cut is not tokens


def test_truncate_any_sequence() -> None:
    assert truncate_head_tail("abcdefgh", 4) == ["a", "b", "g", "h"]


@pytest.mark.parametrize(("length", "max_len"), [(10, 0), (-1, 5)], ids=["zero-budget", "negative-length"])
def test_bad_arguments(length: int, max_len: int) -> None:
    with pytest.raises(ValueError):
        head_tail_split(length, max_len)


def test_head_budget_is_configurable() -> None:
    assert head_tail_split(10_000, 4096, head_tokens=100) == (100, 3996)
    assert head_tail_split(10_000, 4096, head_tokens=0) == (0, 4096)


# --------------------------------------------------------------------------- the gateway cut

POLICY = TruncationConfig(mode="head-tail", head_tokens=512, min_output_tokens=64)
WORDS = "the quick brown fox jumps over a lazy dog while seven engineers debug kubernetes clusters at night".split()


def prose(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def reference_count(counter: TokenCounter, body: bytes) -> int:
    """The tokenizer's own count of a body: transformers' apply_chat_template / encode, no cache."""
    kind = RequestKind.CHAT if b'"messages"' in body else RequestKind.COMPLETION
    parsed = parse_body(kind, body)
    tok = counter.tokenizer
    if kind is RequestKind.CHAT:
        ids = tok.apply_chat_template(parsed.messages, tools=parsed.tools, tokenize=True, add_generation_prompt=True, return_dict=False)
        return len(ids)
    return len(tok(parsed.prompts[0])["input_ids"]) if parsed.prompts else len(parsed.prompt_token_ids[0])


def cut(
    counter: TokenCounter, body: bytes, max_model_len: int, policy: TruncationConfig = POLICY
) -> tuple[Truncated | None, int]:
    kind = RequestKind.CHAT if b'"messages"' in body else RequestKind.COMPLETION
    parsed = parse_body(kind, body)
    if kind is RequestKind.CHAT:
        counts = [counter.count_chat(parsed.messages, tools=parsed.tools).count]
    elif parsed.prompts:
        counts = [counter.count_text(p).count for p in parsed.prompts]
    else:
        counts = [len(p) for p in parsed.prompt_token_ids]
    budget = prompt_budget(max_model_len, parsed.max_tokens, policy)
    return truncate(parsed, body, counter, counts, max_model_len=max_model_len, policy=policy), budget


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **extra})


def long_chat(turns: int, words: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t}: " + prose(words, t)})
        msgs.append({"role": "assistant", "content": f"answer {t}: " + prose(words, 1000 + t)})
    msgs.append({"role": "user", "content": "And now?"})
    return msgs


def test_chat_drops_the_fewest_oldest_turns_and_counts_exactly(qwen_counter: TokenCounter) -> None:
    msgs = long_chat(turns=12, words=60)
    body = chat_body(msgs, max_tokens=100)
    result, budget = cut(qwen_counter, body, 1500)
    assert result is not None and result.truncation.cut == "messages"
    kept = parse_body(RequestKind.CHAT, result.body).messages
    # Reference: the tokenizer's count with the oldest k turns (user + assistant) dropped; the
    # cut must be the smallest k that fits.
    def count_without(k: int) -> int:
        rest = [msgs[0], *msgs[1 + 2 * k :]]
        return len(qwen_counter.tokenizer.apply_chat_template(rest, tokenize=True, add_generation_prompt=True, return_dict=False))

    k = next(k for k in range(13) if count_without(k) <= budget)
    assert k >= 2 and count_without(k - 1) > budget
    assert kept == [msgs[0], *msgs[1 + 2 * k :]]
    assert result.truncation.messages_dropped == 2 * k
    assert result.prompt_tokens == [count_without(k)] == [reference_count(qwen_counter, result.body)]
    assert result.truncation.tokens_before == reference_count(qwen_counter, body)
    assert result.token_ids is not None and len(result.token_ids) == result.prompt_tokens[0]


def test_chat_that_fits_is_untouched(qwen_counter: TokenCounter) -> None:
    result, _ = cut(qwen_counter, chat_body(long_chat(2, 20), max_tokens=10), 4096)
    assert result is None


def test_chat_rewrite_changes_only_the_messages(qwen_counter: TokenCounter) -> None:
    msgs = long_chat(turns=10, words=60)
    # Spacing, a number's spelling and an unknown field a JSON library would not re-emit so.
    messages_json = orjson.dumps(msgs, option=orjson.OPT_INDENT_2).decode()
    head = '{ "model" : "m",\n  "temperature": 0.70, "x_vendor": {"seed": 1E2, "s": "caf\\u00e9"},\n  "messages": '
    tail = ',  "max_tokens": 100 }\n'
    body = (head + messages_json + tail).encode()
    result, _ = cut(qwen_counter, body, 1500)
    assert result is not None
    new = result.body.decode()
    assert new.startswith(head) and new.endswith(tail)
    # Kept messages keep their bytes, layout included.
    kept_json = new[len(head) : len(new) - len(tail)]
    assert kept_json.startswith("[\n  {") and kept_json.endswith("}\n]")
    for m in parse_body(RequestKind.CHAT, result.body).messages:
        assert orjson.dumps(m, option=orjson.OPT_INDENT_2).decode().replace("\n", "\n  ") in kept_json
    assert result.prompt_tokens == [reference_count(qwen_counter, result.body)]


def agent_messages(calls: int, result_words: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Find the answer, use the search tool as often as needed."},
    ]
    for c in range(calls):
        call_id = f"call_{c}"
        arguments = orjson.dumps({"q": f"query {c}"}).decode()
        msgs.append({
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "search", "arguments": arguments}}],
        })
        msgs.append({"role": "tool", "tool_call_id": call_id, "content": f"result {c}: " + prose(result_words, c)})
    return msgs


TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def assert_tool_calls_answered(messages: list[dict[str, Any]]) -> None:
    """Every tool result follows its own call, and every call is answered."""
    open_calls: set[str] = set()
    for m in messages:
        if m["role"] == "assistant":
            assert not open_calls, f"a call went unanswered: {open_calls}"
            open_calls = {tc["id"] for tc in m.get("tool_calls") or ()}
        elif m["role"] == "tool":
            assert m["tool_call_id"] in open_calls, f"a tool result lost its call: {m['tool_call_id']}"
            open_calls.discard(m["tool_call_id"])
    assert not open_calls


# A call + result pair is ~120 tokens: budgets 16 apart land the cut on every message of a pair.
@pytest.mark.parametrize("max_model_len", range(1600, 1728, 16))
def test_agent_loop_drops_oldest_call_result_pairs_keeping_task_and_newest(
    qwen_counter: TokenCounter, max_model_len: int
) -> None:
    msgs = agent_messages(calls=16, result_words=80)
    body = chat_body(msgs, tools=TOOLS, max_tokens=64)
    result, budget = cut(qwen_counter, body, max_model_len)
    assert result is not None and result.truncation.cut == "messages"
    kept = parse_body(RequestKind.CHAT, result.body).messages
    dropped = result.truncation.messages_dropped
    assert dropped % 2 == 0 and dropped > 0  # call + result pairs, whole
    assert kept == [msgs[0], msgs[1], *msgs[2 + dropped :]]  # system, the task, the newest pairs
    assert_tool_calls_answered(kept)
    assert result.prompt_tokens == [reference_count(qwen_counter, result.body)]
    assert result.prompt_tokens[0] <= budget


def test_a_tool_call_and_its_results_leave_together_with_their_turn(qwen_counter: TokenCounter) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for t in range(8):
        msgs.append({"role": "user", "content": f"turn {t}: " + prose(40, t)})
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"a{t}", "type": "function", "function": {"name": "search", "arguments": "{}"}},
            {"id": f"b{t}", "type": "function", "function": {"name": "search", "arguments": "{}"}},
        ]})
        msgs.append({"role": "tool", "tool_call_id": f"a{t}", "content": prose(60, 100 + t)})
        msgs.append({"role": "tool", "tool_call_id": f"b{t}", "content": prose(60, 200 + t)})
        msgs.append({"role": "assistant", "content": f"done {t}"})
    msgs.append({"role": "user", "content": "last question"})
    result, budget = cut(qwen_counter, chat_body(msgs, tools=TOOLS, max_tokens=64), 1800)
    assert result is not None
    kept = parse_body(RequestKind.CHAT, result.body).messages
    assert result.truncation.messages_dropped % 5 == 0  # whole turns: user, call, 2 results, answer
    assert kept[0] == msgs[0] and kept[1]["role"] == "user" and kept[-1] == msgs[-1]
    assert_tool_calls_answered(kept)
    assert result.prompt_tokens == [reference_count(qwen_counter, result.body)] and result.prompt_tokens[0] <= budget


def test_one_huge_message_is_cut_inside_head_and_tail(qwen_counter: TokenCounter) -> None:
    text = prose(6000, 7)
    body = chat_body([{"role": "system", "content": "Summarise."}, {"role": "user", "content": text}])
    result, budget = cut(qwen_counter, body, 4096)  # no max_tokens: min_output_tokens (64) of room
    assert result is not None and result.truncation.cut == "text" and result.truncation.messages_dropped == 0
    system, user = parse_body(RequestKind.CHAT, result.body).messages
    assert system["content"] == "Summarise."
    new = user["content"]
    # The head: exactly the text's first min(512, n/4) tokens; the rest is a tail of the text.
    n = len(qwen_counter.encode(text))
    head = min(512, n // 4)
    head_chars = qwen_counter.char_offsets(text)[head][0]
    assert new.startswith(text[:head_chars]) and text.endswith(new[head_chars:])
    assert len(new) < len(text)
    count = reference_count(qwen_counter, result.body)
    assert result.prompt_tokens == [count]
    assert budget - 100 <= count <= budget  # fits, and uses the room (within the cut's margin)


def test_content_parts_are_cut_in_their_longest_text_part(qwen_counter: TokenCounter) -> None:
    small = {"type": "text", "text": "Context follows."}
    big = {"type": "text", "text": prose(5000, 3)}
    msgs = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, {"role": "user", "content": [small, big]}]
    body = chat_body(msgs, max_tokens=200)
    result, budget = cut(qwen_counter, body, 2048)
    assert result is not None and result.truncation.cut == "text"
    raw = orjson.loads(result.body)["messages"]
    assert raw[0] == msgs[0] and raw[1]["content"][0] == small  # untouched parts
    assert raw[1]["content"][1]["type"] == "text" and len(raw[1]["content"][1]["text"]) < len(big["text"])
    assert result.prompt_tokens == [reference_count(qwen_counter, result.body)] and result.prompt_tokens[0] <= budget


def test_messages_with_images_are_kept_or_dropped_whole(qwen_counter: TokenCounter) -> None:
    """Image parts (a text model's parse refuses them today, so the messages are parsed without
    them): a dropped message takes its image along, a kept one keeps its image part's bytes,
    and a cut touches only a text part."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for t in range(6):
        msgs.append({"role": "user", "content": [{"type": "text", "text": prose(80, t)}, image]})
        msgs.append({"role": "assistant", "content": prose(80, 50 + t)})
    msgs.append({"role": "user", "content": [image, {"type": "text", "text": "what is in these?"}]})
    body = chat_body(msgs, max_tokens=64)
    text_only = [
        {**m, "content": [p for p in m["content"] if p["type"] == "text"]} if isinstance(m["content"], list) else m for m in msgs
    ]
    parsed = parse_body(RequestKind.CHAT, chat_body(text_only, max_tokens=64))
    count = qwen_counter.count_chat(parsed.messages).count
    result = truncate(parsed, body, qwen_counter, [count], max_model_len=900, policy=POLICY)
    assert result is not None and result.truncation.cut == "messages"
    raw = orjson.loads(result.body)["messages"]
    dropped = result.truncation.messages_dropped
    assert raw == [msgs[0], *msgs[1 + dropped :]]
    assert image in raw[-1]["content"] and dropped % 2 == 0
    assert orjson.dumps(image) in result.body


def test_refuses_when_system_messages_alone_do_not_fit(qwen_counter: TokenCounter) -> None:
    body = chat_body([{"role": "system", "content": prose(3000, 1)}, {"role": "user", "content": "hi"}], max_tokens=16)
    with pytest.raises(ContextLengthError) as err:
        cut(qwen_counter, body, 2048)
    message = str(err.value)
    assert message.startswith("This model's maximum context length is 2048 tokens.")
    assert "Head + tail truncation could not make it fit" in message


def test_completions_text_keeps_head_and_tail_tokens(qwen_counter: TokenCounter) -> None:
    prompt = prose(5000, 11)
    body = orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 96, "logprobs": None, "seed": 7})
    result, budget = cut(qwen_counter, body, 2048)
    assert result is not None and result.truncation.cut == "tokens"
    new = orjson.loads(result.body)
    assert {k: v for k, v in new.items() if k != "prompt"} == {"model": "m", "max_tokens": 96, "logprobs": None, "seed": 7}
    ids, new_ids = qwen_counter.encode(prompt), qwen_counter.encode(new["prompt"])
    head = min(512, len(ids) // 4)
    assert new_ids[:head] == ids[:head]  # the head's tokens, exactly
    assert prompt.endswith(new["prompt"][len(qwen_counter.decode(ids[:head])) :])
    assert result.prompt_tokens == [reference_count(qwen_counter, result.body)]
    assert budget - 4 <= result.prompt_tokens[0] <= budget


def test_completions_token_ids_exactly(qwen_counter: TokenCounter) -> None:
    ids = list(range(100, 5100))
    result, budget = cut(qwen_counter, orjson.dumps({"model": "m", "prompt": ids, "max_tokens": 48}), 2048)
    assert result is not None
    new = orjson.loads(result.body)["prompt"]
    assert new == truncate_head_tail(ids, budget) and len(new) == budget == 2000
    assert new[:512] == ids[:512] and new[512:] == ids[-(budget - 512) :]
    assert result.prompt_tokens == [budget] and result.truncation.tokens_dropped == 5000 - budget


def test_completions_batch_rewrites_only_the_long_prompts(qwen_counter: TokenCounter) -> None:
    body = b'{"model": "m", "max_tokens": 48, "prompt": [[1,  2, 3], ' + orjson.dumps(list(range(3000))) + b", [7]]}"
    result, budget = cut(qwen_counter, body, 2048)
    assert result is not None
    assert result.body.startswith(b'{"model": "m", "max_tokens": 48, "prompt": [[1,  2, 3], [0,1,2,')
    assert result.body.endswith(b", [7]]}")
    assert orjson.loads(result.body)["prompt"][1] == truncate_head_tail(list(range(3000)), budget)
    assert result.prompt_tokens == [3, budget, 1] and result.token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    ("mode", "header", "expected"),
    [
        ("off", None, False),
        ("off", "head-tail", False),  # not opted in: the header is ignored
        ("off", "nonsense", False),
        ("head-tail", None, True),
        ("head-tail", "off", False),  # a client may decline
        ("on-request", None, False),
        ("on-request", "head-tail", True),
        ("on-request", " Head-Tail ", True),
    ],
    ids=["off", "off-header-ignored", "off-bad-header-ignored", "always", "declined", "on-request-absent", "on-request", "case"],
)
def test_opt_in(mode: str, header: str | None, expected: bool) -> None:
    assert wanted(TruncationConfig(mode=mode), header) is expected  # type: ignore[arg-type]


def test_bad_header_is_a_400_where_it_is_read() -> None:
    with pytest.raises(BadRequestError, match="x-llm-truncate must be 'head-tail' or 'off'"):
        wanted(TruncationConfig(mode="on-request"), "yes")
