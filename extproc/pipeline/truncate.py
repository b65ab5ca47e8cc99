""""Keep head + tail" truncation of over-long prompts at the gateway (DESIGN section 9 item 5).

The design notes found production prompt lengths to follow a power law and proposed cutting an
over-long prompt by keeping its head (system instructions, the task) and its tail (the newest
turns): on a 70B model it cost 2.3 % QA accuracy for 37 % lower peak memory, far less than
cutting uniformly. Their rule (`truncate_by_tail`) keeps a prefix of `min(512, n / 4)` tokens
and fills the rest of the budget from the tail.

Opt-in per model (`models[].truncation`, `TruncationConfig`) or per request (`x-llm-truncate:
head-tail`, only where the model's mode is `on-request`). A prompt is cut when its tokens plus
the output budget — the request's `max_tokens`, else `min_output_tokens` — exceed
`max_model_len`; the prompt's budget is `max_model_len` minus that output budget.

- **Chat** (`/v1/chat/completions`): every system / developer message is kept, and the last
  user message. The other messages form groups that are kept or dropped whole: before the last
  user message, whole turns (a user message and everything up to the next one, so an assistant
  tool call always goes with its tool results, and the conversation still opens with a user
  turn); after it, an assistant message with the tool results that follow it, or a single
  message. The newest group after the last user message is never dropped. The fewest oldest
  groups are dropped so that the rendered prompt fits (found with exact counts, the chat
  template applied). When dropping every droppable group is not enough, the oldest kept message
  (not system / developer) whose text can absorb the excess is cut inside: the head of its text
  (up to `head_tokens`, at most a quarter) and the tail, the middle dropped. A message whose
  content is an array of parts is cut inside its longest text part; other parts (images) keep
  their bytes. Otherwise the request gets vLLM's 400, saying why.
- **Responses** (`/v1/responses`): not cut; its `input` items and `instructions` are not
  rewritten yet, so an over-long one gets vLLM's context-length 400 as without truncation.
- **Completions** (`/v1/completions`): each prompt over the budget keeps `min(head_tokens,
  n / 4)` tokens of its head (and at most half the budget) and the rest from its tail — token
  ids directly, text through the tokenizer (its ids decoded back to text).

The count after truncation is always the tokenizer's count of the prompt as rewritten (a text
cut is counted again, with the chat template; re-tokenizing a joined text can merge tokens at
the seam, so the count is never assumed). The rewritten body changes only what changed: the
dropped messages leave the `messages` array, a cut text's string is replaced, a cut `prompt`
is replaced; every other byte (numbers, unknown fields, spacing) stays as the client sent it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import orjson

from extproc.config.schema import TruncationConfig
from extproc.errors import BadRequestError, ContextLengthError
from extproc.pipeline.tokens import TokenCounter, TokenizedPrompt
from extproc.protocol.jsonspans import array_items, object_members, skip_ws
from extproc.protocol.openai import ParsedRequest, content_text
from extproc.types import RequestKind

__all__ = [
    "HEAD_TOKENS",
    "TRUNCATE_HEADER",
    "Truncated",
    "Truncation",
    "head_tail_split",
    "prompt_budget",
    "truncate",
    "truncate_head_tail",
    "wanted",
]

HEAD_TOKENS = 512
"""Largest prefix kept (tokens), from the design notes."""

TRUNCATE_HEADER = "x-llm-truncate"
"""Request header asking for (`head-tail`) or declining (`off`) truncation."""

_PINNED_ROLES = frozenset(("system", "developer"))
_CUT_TRIES = 6
"""Re-counts a text cut may take to fit (each a tokenization of the kept text; one is the rule)."""

T = TypeVar("T")


def head_tail_split(length: int, max_len: int, head_tokens: int = HEAD_TOKENS) -> tuple[int, int]:
    """How many leading and trailing tokens a prompt of `length` tokens keeps under `max_len`.

    The head is `min(head_tokens, length // 4)` as in the design notes, and at most half of
    `max_len` (their formula asks for a negative tail when `max_len` is below the prefix).

    Returns:
        `(head, tail)` in tokens; `(length, 0)` when it already fits.

    Raises:
        ValueError: `length` < 0, `max_len` < 1 or `head_tokens` < 0.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1 token, got {max_len}")
    if head_tokens < 0:
        raise ValueError(f"head_tokens must be >= 0, got {head_tokens}")
    if length <= max_len:
        return length, 0
    head = min(head_tokens, length // 4, max_len // 2)
    return head, max_len - head


def truncate_head_tail(tokens: Sequence[T], max_len: int, head_tokens: int = HEAD_TOKENS) -> list[T]:
    """Cut `tokens` to at most `max_len` by keeping its head and its tail (`head_tail_split`).

    Returns:
        a new list: `tokens` itself when it fits, else head + tail (exactly `max_len` items).

    Raises:
        ValueError: `max_len` < 1 or `head_tokens` < 0.
    """
    head, tail = head_tail_split(len(tokens), max_len, head_tokens)
    if tail == 0:
        return list(tokens[:head])
    return list(tokens[:head]) + list(tokens[len(tokens) - tail :])


def wanted(policy: TruncationConfig, header: str | None) -> bool:
    """Whether a request may be truncated: the model's mode, and the `x-llm-truncate` header
    (read only when the mode is not `off`, so without opt-in nothing changes).

    Raises:
        BadRequestError: the header is neither `head-tail` nor `off` (modes other than `off`).
    """
    if policy.mode == "off":
        return False
    if header is not None:
        value = header.strip().lower()
        if value not in ("head-tail", "off"):
            raise BadRequestError(
                f"{TRUNCATE_HEADER} must be 'head-tail' or 'off', got {header[:40]!r}", param=TRUNCATE_HEADER
            )
        return value == "head-tail"
    return policy.mode == "head-tail"


def prompt_budget(max_model_len: int, max_tokens: int | None, policy: TruncationConfig) -> int:
    """Tokens a prompt may keep: `max_model_len` minus the output budget (`max_tokens`, else
    `min_output_tokens`); < 1 when the output budget alone fills the context."""
    return max_model_len - (max_tokens if max_tokens is not None else policy.min_output_tokens)


@dataclass(frozen=True, slots=True)
class Truncation:
    """What a truncation did.

    Attributes:
        cut: `messages` (whole chat messages dropped), `text` (a chat message's text cut inside,
            after dropping `messages_dropped` messages) or `tokens` (completions prompts).
        tokens_before / tokens_after: prompt tokens before and after, summed over the prompts.
        messages_dropped: chat messages removed (0 for completions).
    """

    cut: Literal["messages", "text", "tokens"]
    tokens_before: int
    tokens_after: int
    messages_dropped: int = 0

    @property
    def tokens_dropped(self) -> int:
        """Prompt tokens removed (tokens; what `x-llm-truncated-tokens` carries)."""
        return self.tokens_before - self.tokens_after

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (for the decision log)."""
        return {
            "cut": self.cut,
            "tokens_before": self.tokens_before,
            "tokens_after": self.tokens_after,
            "tokens_dropped": self.tokens_dropped,
            "messages_dropped": self.messages_dropped,
        }


@dataclass(frozen=True, slots=True)
class Truncated:
    """A truncated request.

    Attributes:
        body: the rewritten request body (bytes, UTF-8 JSON).
        prompt_tokens: prompt tokens per prompt after truncation (exact, as counted).
        token_ids: the first prompt's token ids after truncation.
        truncation: what was done.
    """

    body: bytes
    prompt_tokens: list[int]
    token_ids: list[int] | None
    truncation: Truncation


def truncate(
    parsed: ParsedRequest,
    body: bytes,
    counter: TokenCounter,
    prompt_tokens: Sequence[int],
    *,
    max_model_len: int,
    policy: TruncationConfig,
) -> Truncated | None:
    """Cut an over-long request's prompt to fit (see the module doc), or None when it fits, the
    output budget alone fills the context, or it is a /v1/responses request (the caller's
    context check then answers).

    Args:
        parsed: the parsed body (`parse_body`).
        body: the body's bytes, as parsed.
        counter: the model's token counter.
        prompt_tokens: exact prompt tokens per prompt (chat template applied).
        max_model_len: the model's context (tokens).
        policy: the model's truncation settings (head budget, output room).

    Raises:
        ContextLengthError: a chat cannot be made to fit (the message says why).
        BadRequestError: the chat template rejects the shortened conversation.
    """
    if parsed.kind is RequestKind.RESPONSES:
        return None  # not cut (module doc): the context check answers vLLM's 400
    budget = prompt_budget(max_model_len, parsed.max_tokens, policy)
    if budget < 1 or all(n <= budget for n in prompt_tokens):
        return None
    text = body.decode("utf-8")
    if parsed.kind is RequestKind.CHAT:
        return _ChatCut(parsed, text, counter, prompt_tokens[0], budget, policy.head_tokens, max_model_len).run()
    return _truncate_completions(parsed, text, counter, prompt_tokens, budget, policy.head_tokens)


# --------------------------------------------------------------------------- chat


def _groups(roles: Sequence[str]) -> tuple[list[list[int]], int]:
    """Droppable groups of message indexes, oldest first, and the anchor (the last user
    message, else the last message); see the module doc."""
    anchor = max((i for i, r in enumerate(roles) if r == "user"), default=len(roles) - 1)
    groups: list[list[int]] = []
    after_anchor = False
    for i, role in enumerate(roles):
        if role in _PINNED_ROLES or i == anchor:
            if i == anchor:
                after_anchor = True
                groups.append([])  # a boundary: nothing after the anchor joins an earlier turn
            continue
        if not after_anchor:
            if role == "user" or not groups:
                groups.append([i])
            else:
                groups[-1].append(i)
        elif role == "tool" and groups and groups[-1] and roles[groups[-1][0]] == "assistant":
            groups[-1].append(i)
        else:
            groups.append([i])
    tail_group = groups[-1] if groups and groups[-1] and groups[-1][0] > anchor else None
    out = [g for g in groups if g]
    if tail_group is not None:
        out.pop()  # the newest exchange after the last user message stays
    return out, anchor


class _ChatCut:
    """One chat truncation: the drop search, then the text cut when needed."""

    def __init__(
        self,
        parsed: ParsedRequest,
        text: str,
        counter: TokenCounter,
        count: int,
        budget: int,
        head_tokens: int,
        max_model_len: int,
    ) -> None:
        self.parsed = parsed
        self.text = text
        self.counter = counter
        self.before = count
        self.budget = budget
        self.head_tokens = head_tokens
        self.max_model_len = max_model_len
        self.messages = parsed.messages
        self.groups, self.anchor = _groups([str(m.get("role")) for m in self.messages])
        self._counts: dict[int, TokenizedPrompt] = {}
        self._spans: list[tuple[int, int]] | None = None

    def _count(self, messages: Sequence[dict[str, Any]]) -> TokenizedPrompt:
        p = self.parsed
        rendered = self.counter.render_chat(messages, tools=p.tools, chat_template_kwargs=p.chat_template_kwargs)
        return self.counter.complete(self.counter.plan(rendered))

    def _kept(self, k: int) -> list[int]:
        dropped = {i for g in self.groups[:k] for i in g}
        return [i for i in range(len(self.messages)) if i not in dropped]

    def _count_dropping(self, k: int) -> TokenizedPrompt:
        found = self._counts.get(k)
        if found is None:
            found = self._counts[k] = self._count([self.messages[i] for i in self._kept(k)])
        return found

    def _first_guess(self) -> int:
        """Groups to drop by a character estimate (tokens per character of this request)."""
        sizes = [sum(len(orjson.dumps(self.messages[i])) for i in g) for g in self.groups]
        total_chars = sum(len(orjson.dumps(m)) for m in self.messages) or 1
        need = (self.before - self.budget) * total_chars / self.before
        acc = 0
        for k, size in enumerate(sizes, start=1):
            acc += size
            if acc >= need:
                return k
        return len(sizes)

    def _fewest_groups(self) -> int | None:
        """The fewest oldest groups whose dropping fits the budget (exact counts, assuming
        fewer tokens with more dropped), or None when dropping all of them is not enough."""
        n = len(self.groups)
        if n == 0:
            return None
        fits = lambda k: self._count_dropping(k).count <= self.budget  # noqa: E731
        lo, hi = 0, None  # lo: known not to fit (nothing dropped); hi: known to fit
        k = min(max(1, self._first_guess()), n)
        step = 1
        while hi is None:  # up from the guess, doubling the step, until it fits
            if fits(k):
                hi = k
            elif k == n:
                return None
            else:
                lo, k = k, min(n, k + step)
                step *= 2
        step = 1
        while hi - lo > 1:  # down from there while it still fits (the guess is usually right:
            k = max(lo + 1, hi - step)  # one fewer does not fit, two counts in all)
            if not fits(k):
                lo = k
                break
            hi, step = k, step * 2
        while hi - lo > 1:  # bracketed: bisect
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def run(self) -> Truncated:
        k = self._fewest_groups()
        if k is not None:
            kept = self._kept(k)
            result = self._count_dropping(k)
            return self._result("messages", kept, result, None)
        k = len(self.groups)
        kept = self._kept(k)
        return self._cut_text(kept)

    # -- the text cut ----------------------------------------------------------------------

    def _cut_text(self, kept: list[int]) -> Truncated:
        now = self._count_dropping(len(self.groups)).count
        excess = now - self.budget
        for i in kept:
            if self.messages[i].get("role") in _PINNED_ROLES:
                continue
            found = self._try_cut(kept, i, now, excess)
            if found is not None:
                return found
        dropped = len(self.messages) - len(kept)
        raise ContextLengthError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
            f"{self.before} input tokens and leaves room for {self.max_model_len - self.budget} output tokens. "
            f"Head + tail truncation could not make it fit: after dropping {dropped} older messages the "
            f"system/developer messages and the newest turns still need {now} tokens, {excess} over the "
            f"{self.budget} available, and no kept message's text is long enough to cut by that much. "
            "Please reduce the length of the messages or completion.",
            param="messages",
        )

    def _piece(self, i: int) -> tuple[tuple[int, int], str, Callable[[str], Any]] | None:
        """The text of message `i` to cut: the span of its JSON string in the body, the text,
        and how to build the message's content with a new text; None without text."""
        members = self._message_members(i)
        spans = [(s, e) for key, s, e in members if key == "content"]
        if not spans:
            return None
        start, end = spans[-1]
        raw = json.loads(self.text[start:end])
        if isinstance(raw, str):
            return (start, end), raw, lambda new: new
        if not isinstance(raw, list):
            return None
        texts = [(j, p["text"]) for j, p in enumerate(raw) if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if not texts:
            return None
        j, longest = max(texts, key=lambda t: len(t[1]))
        part_start, _ = array_items(self.text, start)[0][j]
        part_members, _ = object_members(self.text, part_start)
        s, e = [(s, e) for key, s, e in part_members if key == "text"][-1]

        def with_text(new: str) -> list[Any]:
            parts = list(raw)
            parts[j] = {**raw[j], "text": new}
            return parts

        return (s, e), longest, with_text

    def _message_members(self, i: int) -> list[tuple[str, int, int]]:
        start, _ = self._message_spans()[i]
        return object_members(self.text, start)[0]

    def _message_spans(self) -> list[tuple[int, int]]:
        spans = self._spans
        if spans is None:
            members, _ = object_members(self.text)
            start = [s for key, s, _ in members if key == "messages"][-1]
            spans, _ = array_items(self.text, start)
            self._spans = spans
        return spans

    def _try_cut(self, kept: list[int], i: int, now: int, excess: int) -> Truncated | None:
        piece = self._piece(i)
        if piece is None:
            return None
        span, text, with_text = piece

        def count_with(new: str) -> TokenizedPrompt:
            msg = {**self.messages[i], "content": content_text(with_text(new), i)}
            return self._count([msg if j == i else self.messages[j] for j in kept])

        # The text's own tokens: the prompt with the text emptied is cached but for one segment.
        own = now - count_with("").count
        margin = 4 + (own - excess) // 100  # the tail is sized from the text's mean density
        keep = own - excess - margin
        if keep < 2 or not text:
            return None
        per_char = own / len(text)
        head = min(self.head_tokens, own // 4, keep // 2)
        head_chars = self._head_chars(text, head, per_char)
        tail_chars = int((keep - head) / per_char)
        for _ in range(_CUT_TRIES):
            if tail_chars <= 0:
                return None
            new = text[:head_chars] + text[max(head_chars, len(text) - tail_chars) :]
            result = count_with(new)
            if result.count <= self.budget:
                return self._result("text", kept, result, (i, span, new))
            tail_chars -= int((result.count - self.budget) / per_char * 1.05) + 1
        return None

    def _head_chars(self, text: str, head: int, per_char: float) -> int:
        """Characters of `text` holding its first `head` tokens (tokenizing only a prefix)."""
        if head <= 0:
            return 0
        region = text[: min(len(text), int(2 * head / per_char) + 64)]
        offsets = self.counter.char_offsets(region)
        return offsets[head][0] if len(offsets) > head else len(region)

    def _result(
        self,
        cut: Literal["messages", "text"],
        kept: list[int],
        result: TokenizedPrompt,
        replace: tuple[int, tuple[int, int], str] | None,
    ) -> Truncated:
        body = self._rewrite(kept, replace)
        truncation = Truncation(cut, self.before, result.count, len(self.messages) - len(kept))
        return Truncated(body, [result.count], result.token_ids, truncation)

    def _rewrite(self, kept: list[int], replace: tuple[int, tuple[int, int], str] | None) -> bytes:
        """The body with only the kept messages (original bytes) and the cut text replaced."""
        text = self.text
        spans = self._message_spans()
        members, _ = object_members(text)
        array_start, array_end = [(s, e) for key, s, e in members if key == "messages"][-1]
        # Keep the array's own layout: its opening, the separator between its first two items,
        # its closing.
        sep = text[spans[0][1] : spans[1][0]] if len(spans) > 1 else ", "
        items = []
        for i in kept:
            start, end = spans[i]
            item = text[start:end]
            if replace is not None and replace[0] == i:
                (s, e), new = replace[1], replace[2]
                item = text[start:s] + json.dumps(new, ensure_ascii=False) + text[e:end]
            items.append(item)
        array = text[array_start : spans[0][0]] + sep.join(items) + text[spans[-1][1] : array_end]
        return (text[:array_start] + array + text[array_end:]).encode("utf-8")


# --------------------------------------------------------------------------- completions


def _cut_prompt_text(counter: TokenCounter, prompt: str, budget: int, head_tokens: int) -> tuple[str, TokenizedPrompt]:
    """A text prompt cut to at most `budget` tokens (special tokens included): its head and
    tail token ids decoded back to text, then counted again (the seam may merge tokens)."""
    ids = counter.encode(prompt)  # cached: the prompt was just counted
    room = budget - (counter.count_text("").count)
    head, tail = head_tail_split(len(ids), max(1, room), head_tokens)
    for _ in range(_CUT_TRIES):
        head_text = counter.decode(ids[:head])
        while head > 0 and not prompt.startswith(head_text):  # a character split by the cut
            head -= 1
            head_text = counter.decode(ids[:head])
        tail_text = counter.decode(ids[len(ids) - tail :]) if tail > 0 else ""
        while tail > 0 and not prompt.endswith(tail_text):
            tail -= 1
            tail_text = counter.decode(ids[len(ids) - tail :]) if tail > 0 else ""
        new = head_text + tail_text
        result = counter.count_text(new)
        if result.count <= budget:
            return new, result
        tail = max(0, tail - (result.count - budget))
    raise ContextLengthError(f"could not cut the prompt to {budget} tokens", param="prompt")


def _truncate_completions(
    parsed: ParsedRequest, text: str, counter: TokenCounter, counts: Sequence[int], budget: int, head_tokens: int
) -> Truncated:
    members, _ = object_members(text)
    start, end = [(s, e) for key, s, e in members if key == "prompt"][-1]
    after: list[int] = list(counts)
    first_ids: list[int] | None = None
    replaced: dict[int, str] = {}  # prompt index → its new JSON text
    if parsed.prompt_token_ids:
        for n, ids in enumerate(parsed.prompt_token_ids):
            if len(ids) > budget:
                ids = truncate_head_tail(ids, budget, head_tokens)
                replaced[n] = orjson.dumps(ids).decode()
                after[n] = len(ids)
            if n == 0:
                first_ids = ids
        flat = text[skip_ws(text, start + 1)] != "["  # [1, 2, 3], not [[1, 2, 3]]
    else:
        for n, prompt in enumerate(parsed.prompts):
            if counts[n] > budget:
                new, result = _cut_prompt_text(counter, prompt, budget, head_tokens)
                replaced[n] = json.dumps(new, ensure_ascii=False)
                after[n] = result.count
                if n == 0:
                    first_ids = result.token_ids
            elif n == 0:
                first_ids = counter.count_text(prompt).token_ids
        flat = text[start] == '"'
    if flat:
        value = replaced[0]
    else:
        items, _ = array_items(text, start)
        value = text[start : items[0][0]]
        for n, (s, e) in enumerate(items):
            value += replaced.get(n, text[s:e]) + (text[e : items[n + 1][0]] if n + 1 < len(items) else "")
        value += text[items[-1][1] : end]
    body = (text[:start] + value + text[end:]).encode("utf-8")
    return Truncated(body, after, first_ids, Truncation("tokens", sum(counts), sum(after)))
