"""Workloads for the prefix-cache benchmark (`scripts/bench_prefix.py`) and their oracle hit rate.

    sample = sample_conversations(trace.requests, 150, seed=0)         # Mooncake: whole conversations
    chats = sharegpt_conversations(path, 150, counter, conversation_rate=1.5)
    shared = shared_system_prompt_workload(prompts, SharedPromptSpec(requests=150))
    oracle_hit_rate(with_messages(workload, prompts).requests, counter)  # 0..1 of prompt tokens

- **Conversations of a Mooncake trace.** The first N requests of a Mooncake trace hold few of
  its shared prefixes (the first 150 of the conversation trace: 5 % of prompt tokens reusable at
  512-token blocks, against 37 % over the whole hour): a conversation's turns are minutes apart.
  So we sample whole conversations, not a time window: requests are grouped by their first
  `hash_ids` block shared by fewer than `rare_share` of all requests (the conversation trace
  opens every prompt with the same block, a system prompt, so the first block alone would make
  one group), groups are drawn at random until N requests, and every request keeps its
  conversation as `session`. Arrival times are scaled so the sample arrives at the trace's own
  mean request rate; replayed with `closed_loop_sessions`, a turn still waits for the answer
  to the turn before it.
- **ShareGPT multi-turn.** Conversations with at least two answered human turns, in file order;
  each turn resends the history (the dataset's own answers) and waits for the previous answer
  (closed loop). Conversations start as a Poisson process; every turn of a conversation carries
  the conversation's start as its arrival time (the load generator sends it later).
- **Shared system prompts.** `system_prompts` prompts of `system_tokens` tokens, each request one
  of them (uniform) plus a unique question, fixed output length, arrival rate ramped linearly.

The **oracle hit rate** is what an infinite prefix cache shared by the whole fleet would serve:
the share of prompt tokens covered by leading full blocks (engine block size) that some earlier
request already carried, on the token ids the engine sees (chat template applied). As in vLLM,
at most `(prompt − 1) // block` blocks of a prompt can hit (`cacheable_blocks`), and the
denominator counts every prompt token (vLLM's `prefix_cache_queries`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from extproc.bench.chat_traces import read_sharegpt
from extproc.bench.traces import TraceRequest
from extproc.prefix.hashing import cacheable_blocks, chain_block_hashes

if TYPE_CHECKING:
    from extproc.bench.prompts import PromptSynthesizer
    from extproc.pipeline.tokens import TokenCounter

__all__ = [
    "SharedPromptSpec",
    "oracle_hit_rate",
    "sample_conversations",
    "sharegpt_conversations",
    "shared_system_prompt_workload",
]


def _conversation_key(request: TraceRequest, frequency: Counter, rare: float) -> int | None:
    """The first block of `request` carried by fewer than `rare` requests, else its last block."""
    blocks = request.prefix_blocks or ()
    for block in blocks:
        if frequency[block] < rare:
            return block
    return blocks[-1] if blocks else None


def sample_conversations(
    requests: Sequence[TraceRequest], count: int, *, seed: int = 0, rare_share: float = 0.02
) -> list[TraceRequest]:
    """Whole conversations of a Mooncake-style trace, about `count` requests, at the trace's rate.

    Args:
        requests: the whole trace, sorted by arrival (with `prefix_blocks`).
        count: stop drawing conversations once this many requests are in (the last one drawn is
            kept whole, so the result may hold a few more).
        seed: which conversations are drawn.
        rare_share: a block carried by at least this share of all requests is a common prefix
            (a system prompt), not a conversation's own.

    Returns:
        the sampled requests sorted by arrival, first at 0 s, `session` = `"c<key block>"`,
        arrival gaps divided by `len(requests) / len(sample)` so that the sample's mean rate is
        the trace's. A request without blocks is a conversation of its own.

    Raises:
        ValueError: `count` < 1 or an empty trace.
    """
    if count < 1 or not requests:
        raise ValueError(f"need count >= 1 and a non-empty trace (count={count}, {len(requests)} requests)")
    frequency = Counter(b for r in requests for b in set(r.prefix_blocks or ()))
    rare = rare_share * len(requests)
    groups: dict[object, list[TraceRequest]] = defaultdict(list)
    for i, request in enumerate(requests):
        key = _conversation_key(request, frequency, rare)
        groups[key if key is not None else f"single-{i}"].append(request)
    keys = list(groups)
    order = np.random.default_rng(seed).permutation(len(keys))
    chosen: list[TraceRequest] = []
    for k in order:
        if len(chosen) >= count:
            break
        key = keys[int(k)]
        chosen += [dataclasses.replace(r, session=f"c{key}") for r in groups[key]]
    chosen.sort(key=lambda r: r.arrival_s)
    scale = len(requests) / len(chosen)
    origin = chosen[0].arrival_s
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - origin) / scale) for r in chosen]


def sharegpt_conversations(
    path: str | Path,
    count: int,
    counter: TokenCounter,
    *,
    conversation_rate: float,
    max_model_len: int,
    min_turns: int = 2,
    seed: int = 0,
) -> list[TraceRequest]:
    """ShareGPT conversations of at least `min_turns` turns, about `count` requests in all.

    A conversation is cut before its first turn whose prompt + answer exceed `max_model_len`
    (later turns would only grow); it is kept if `min_turns` remain. Conversations start at
    `conversation_rate` per second (Poisson, `seed`); each turn's `arrival_s` is its
    conversation's start (replay with `closed_loop_sessions`).

    Raises:
        TraceFormatError: the file is not ShareGPT.
        ValueError: `count` < 1 or `conversation_rate` not > 0.
    """
    if count < 1 or not (conversation_rate > 0 and math.isfinite(conversation_rate)):
        raise ValueError(f"need count >= 1 and conversation_rate > 0 (got {count}, {conversation_rate})")
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    start = 0.0
    for turns in _sessions(read_sharegpt(path, counter=counter)):
        fitting: list[TraceRequest] = []
        for turn in turns:
            if turn.input_tokens + turn.output_tokens > max_model_len:
                break
            fitting.append(turn)
        if len(fitting) < min_turns:
            continue
        out += [dataclasses.replace(t, arrival_s=start) for t in fitting]
        start += float(rng.exponential(1.0 / conversation_rate))
        if len(out) >= count:
            break
    return out


def _sessions(requests: Iterable[TraceRequest]) -> Iterable[list[TraceRequest]]:
    """Consecutive requests of one session, grouped (ShareGPT yields a conversation's turns together)."""
    current: list[TraceRequest] = []
    for request in requests:
        if current and request.session != current[0].session:
            yield current
            current = []
        current.append(request)
    if current:
        yield current


@dataclass(frozen=True, slots=True)
class SharedPromptSpec:
    """The shared-system-prompt workload.

    Attributes:
        requests: number of requests.
        system_prompts: distinct system prompts (each request picks one uniformly).
        system_tokens: length of each system prompt's text (tokens).
        question_tokens: length of each request's unique question (tokens).
        output_tokens: tokens generated per request.
        rate_start / rate_end: arrival rate of the first and the last request (requests/s); in
            between the rate grows linearly with the request's index (exponential gaps).
        seed: system-prompt choice and gaps.
    """

    requests: int = 150
    system_prompts: int = 15
    system_tokens: int = 6000
    question_tokens: int = 1200
    output_tokens: int = 1000
    rate_start: float = 2.0
    rate_end: float = 12.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.requests, self.system_prompts, self.system_tokens, self.question_tokens, self.output_tokens) < 1:
            raise ValueError("requests, system_prompts and every token count must be >= 1")
        if not (self.rate_start > 0 and self.rate_end > 0 and math.isfinite(self.rate_start + self.rate_end)):
            raise ValueError("rates must be positive numbers of requests/s")


def shared_system_prompt_workload(prompts: PromptSynthesizer, spec: SharedPromptSpec) -> list[TraceRequest]:
    """Requests of a system prompt (one of `spec.system_prompts`) plus a unique question.

    Returns:
        requests sorted by arrival (first at 0 s) with `messages` set and `input_tokens`
        counted with the chat template; `prefix_blocks` None (the text is the prefix).
    """
    rng = np.random.default_rng(spec.seed)
    systems = [prompts.stream_text(f"system:{k}", spec.system_tokens) for k in range(spec.system_prompts)]
    choice = rng.integers(0, spec.system_prompts, size=spec.requests)
    rates = np.linspace(spec.rate_start, spec.rate_end, spec.requests)
    gaps = rng.exponential(1.0 / rates)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    out = []
    for i in range(spec.requests):
        messages = [
            {"role": "system", "content": systems[int(choice[i])]},
            {"role": "user", "content": prompts.stream_text(f"question:{i}", spec.question_tokens)},
        ]
        tokens = prompts.counter.count_chat(messages).count
        out.append(TraceRequest(float(arrivals[i]), tokens, spec.output_tokens, messages=messages))
    return out


def oracle_hit_rate(requests: Sequence[TraceRequest], counter: TokenCounter, block_size: int = 16) -> float | None:
    """Share of prompt tokens an infinite, fleet-wide prefix cache would serve (0..1).

    Requests are taken in the order given (the order they are sent: arrival order, a session's
    turns in order); each must carry `messages`. None for no prompt tokens.

    Raises:
        ValueError: a request without messages, or `block_size` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[int] = set()
    hit = total = 0
    for request in requests:
        if request.messages is None:
            raise ValueError("oracle_hit_rate needs every request's messages (build them with with_messages)")
        ids = counter.count_chat(request.messages).token_ids
        hashes = chain_block_hashes(ids, block_size)
        usable = hashes[: cacheable_blocks(len(ids), block_size)]
        matched = 0
        for h in usable:
            if h not in seen:
                break
            matched += 1
        hit += matched * block_size
        total += len(ids)
        seen.update(hashes)
    return hit / total if total else None


@dataclass(frozen=True)
class DuplicatePrefills:
    """Prefills a cache-aware router could have avoided (`duplicate_prefills`).

    Attributes:
        requests: requests sent to an endpoint that held less of their prefix than another
            endpoint did, by at least the threshold (count).
        tokens: prompt tokens those requests prefilled that another endpoint held (tokens).
    """

    requests: int
    tokens: int


def duplicate_prefills(
    requests: Sequence[TraceRequest],
    served: Sequence[tuple[int, float, str | None]],
    counter: TokenCounter,
    block_size: int = 16,
    min_tokens: int = 128,
) -> DuplicatePrefills | None:
    """Count requests prefilled again where another endpoint already held their prefix.

    Replays the sends in order (`served`: `(index into requests, send time s, endpoint)` per
    request actually sent) against one infinite prefix cache per endpoint holding every block
    sent there: a request is a duplicate when some endpoint held at least `min_tokens` more of
    its leading blocks (at most `cacheable_blocks` of them, as vLLM) than the one it was sent
    to. Every prefill of a shared-system-prompt request that misses its system prompt while
    another engine holds it is one. Eviction is not modelled, so on a fleet whose KV cannot
    hold the working set this counts too many.

    Returns:
        the count and the tokens, or None when any send does not name its endpoint (peer
        routers do not say which engine served).

    Raises:
        ValueError: a request without messages, an index out of range, or `block_size` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if any(ep is None for _, _, ep in served):
        return None
    held: dict[str, set[int]] = defaultdict(set)
    count = tokens = 0
    for index, _, endpoint in sorted(served, key=lambda s: s[1]):
        if not 0 <= index < len(requests):
            raise ValueError(f"request index {index} out of range (0..{len(requests) - 1})")
        request = requests[index]
        if request.messages is None:
            raise ValueError("duplicate_prefills needs every request's messages (build them with with_messages)")
        ids = counter.count_chat(request.messages).token_ids
        hashes = chain_block_hashes(ids, block_size)
        usable = hashes[: cacheable_blocks(len(ids), block_size)]
        own = _leading(usable, held[endpoint])
        best = max((_leading(usable, blocks) for blocks in held.values()), default=0)
        if (best - own) * block_size >= min_tokens:
            count += 1
            tokens += (best - own) * block_size
        held[endpoint].update(hashes)
    return DuplicatePrefills(count, tokens)


def _leading(hashes: Sequence[int], held: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n
