"""Token counting with the model's real tokenizer, chat template applied.

The count is what the engine will prefill: for chat requests the model's chat template is
rendered (as vLLM does, `add_generation_prompt=True`) and tokenized without adding special
tokens again; for completions the prompt is tokenized with the tokenizer's special tokens.

Caching repeated prefixes: multi-turn chats resend their whole history. A Hugging Face fast
tokenizer splits its input at added tokens (e.g. `<|im_start|>`) *before* normalising and
pre-tokenising, so the text between two added tokens is tokenized independently of the rest.
We therefore cut the rendered prompt into segments at added-token boundaries, look each
segment up in an LRU cache (bounded in bytes), and tokenize only the misses, in one
`encode_batch` call that releases the GIL. The result equals
`apply_chat_template(..., tokenize=True, return_dict=False)` token for token (tested).
Added tokens with `lstrip`/`rstrip`/`normalized` set are not used as cut points, since
they interact with their neighbours.

The encoder: for byte-level BPE tokenizers with a regex split (Qwen2/3, Llama 3, ...) the
segments are encoded by `tiktoken` built from the same `tokenizer.json` (extproc/pipeline/
fastbpe.py, ~7× faster on prose), but only once it gave the same ids as `tokenizers` on a built-in
corpus at load time; otherwise, or for any other tokenizer, `tokenizers` encodes them
(`TokenCounter.encoder` says which, `encoder_note` why). docs/decisions/0200.

Memory: the cache holds each segment's ids as an `array('I')` (4 bytes a token; a list of
Python ints took ~42, measured with tracemalloc) and is bounded in bytes (`limits.token_cache_bytes`,
each entry counted by `cache_entry_bytes`: its text, its ids, the dict's overhead). It was
bounded at 4M tokens, whatever they cost (`scripts/bench_memory.py`, docs/benchmarks/memory.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.errors import BadRequestError
from extproc.models import builtin_tokenizer_dir
from extproc.pipeline.chat_render import DirectChatRenderer
from extproc.pipeline.fastbpe import FastEncoder, UnsupportedTokenizer, build_fast_encoder, cross_check, cross_check_corpus

__all__ = ["DEFAULT_CACHE_BYTES", "EncodePlan", "TokenCounter", "TokenizedPrompt", "TokenizerLoadError", "cache_entry_bytes"]

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
"""The segment cache's default bound per tokenizer (bytes; `limits.token_cache_bytes`): by the
arithmetic of `cache_entry_bytes`, ~7M tokens of prose (4 bytes of ids and ~4 of text a
token, plus ~250 bytes a segment's objects), more than the 4M tokens the old bound held as
lists of ints (~42 bytes a token: ~170 MB)."""

ENTRY_OVERHEAD_BYTES = 112
"""A cache entry's cost besides its text and ids (bytes): the OrderedDict's slot and link (91
in CPython 3.11, measured with tracemalloc over 100k entries) rounded up."""


def cache_entry_bytes(segment: str, ids: array) -> int:
    """What one cache entry holds (bytes): the segment's str object, the ids' array object and
    `ENTRY_OVERHEAD_BYTES`."""
    return sys.getsizeof(segment) + sys.getsizeof(ids) + ENTRY_OVERHEAD_BYTES


class TokenizerLoadError(ValueError):
    """A tokenizer source could not be loaded (names the source and the reason)."""


@dataclass(slots=True)
class EncodePlan:
    """A prompt cut into segments, with the cached ones already resolved.

    Attributes:
        segments: the text pieces (cut before each added token).
        ids: token ids per segment, None where not cached yet.
        missing: indexes of the uncached segments.
        missing_chars: characters still to tokenize (a cost estimate).
        add_special_tokens: prepend the tokenizer's BOS-like special tokens.
        text_chars: length of the whole text (characters).
    """

    segments: list[str]
    ids: list[Sequence[int] | None]
    missing: list[int]
    missing_chars: int
    add_special_tokens: bool
    text_chars: int


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """A prompt as the engine sees it.

    Attributes:
        token_ids: the token ids (list of int).
        text_chars: length of the rendered text (characters), for diagnostics.
    """

    token_ids: list[int]
    text_chars: int

    @property
    def count(self) -> int:
        """Number of tokens."""
        return len(self.token_ids)


_SERVER_SET = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
     "tokenize", "return_dict", "tokenizer_kwargs", "bos_token", "eos_token", "pad_token", "unk_token"}
)  # fmt: skip


def _template_variables(template: str | None) -> frozenset[str]:
    """Top-level variables a Jinja chat template reads that a request may set."""
    if not template:
        return frozenset()
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        names = meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template))
    except TemplateSyntaxError:
        return frozenset()
    return frozenset(names) - _SERVER_SET


_FAST_ENCODERS: dict[bytes, FastEncoder | str] = {}
"""Fast encoders built so far, by a digest of the serialized tokenizer (not the multi-MB text
itself, which an `lru_cache` key would keep alive)."""


def _fast_encoder(tokenizer_json: str) -> FastEncoder | str:
    """The fast encoder for a serialized tokenizer, or why there is none (built once per
    tokenizer and process: ~1 s for Qwen3's 151k-entry vocabulary)."""
    key = hashlib.blake2b(tokenizer_json.encode(), digest_size=16).digest()
    found = _FAST_ENCODERS.get(key)
    if found is None:
        try:
            found = build_fast_encoder(orjson.loads(tokenizer_json))
        except UnsupportedTokenizer as exc:
            found = str(exc)
        _FAST_ENCODERS[key] = found
    return found


class TokenCounter:
    """Counts prompt tokens for one model, with a segment cache.

    Thread-safe: `count_*` may run in worker threads concurrently.

    Args:
        tokenizer: a transformers fast tokenizer (`PreTrainedTokenizerFast` or subclass).
        cache_bytes: bound of the segment cache (bytes held in total, `cache_entry_bytes`
            each entry; 0: no cache).
        encoder: "auto" (tiktoken when the tokenizer is a byte-level BPE with a regex split and
            the load-time cross-check passes, else `tokenizers`) or "tokenizers" (always).

    Raises:
        TokenizerLoadError: no fast backend.
        ValueError: an unknown `encoder`.
    """

    def __init__(self, tokenizer: Any, *, cache_bytes: int = DEFAULT_CACHE_BYTES, encoder: str = "auto") -> None:
        if encoder not in ("auto", "tokenizers"):
            raise ValueError(f"encoder must be 'auto' or 'tokenizers', not {encoder!r}")
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise TokenizerLoadError("tokenizer has no fast (Rust) backend; a tokenizer.json is required")
        self._backend = backend
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cache_tokens = 0
        self._cache_bytes = 0
        self._cache_limit = max(0, cache_bytes)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        cut_tokens = []
        self._added_ids: dict[str, int] = {}
        for token_id, added in backend.get_added_tokens_decoder().items():
            if not (added.lstrip or added.rstrip or added.normalized or added.single_word):
                cut_tokens.append(added.content)
                self._added_ids[added.content] = token_id
        cut_tokens.sort(key=len, reverse=True)
        # A plain alternation scanned with finditer: ~20× faster than splitting on a lookahead
        # (the regex engine can skip ahead to each candidate first character).
        self._cut_re = re.compile("|".join(map(re.escape, cut_tokens))) if cut_tokens else None
        leads = {t[0] for t in cut_tokens}
        self._cut_lead = leads.pop() if len(leads) == 1 else None
        """The first character every cut token starts with (Qwen's all start with "<"), or None:
        `str.find` then skips to the candidates ~5× faster than `finditer` scans for them."""
        self._bos_ids: list[int] = list(backend.encode("", add_special_tokens=True).ids)
        self.template_kwargs = _template_variables(getattr(tokenizer, "chat_template", None))
        """Names a request's `chat_template_kwargs` may set: the variables the model's own chat
        template reads, minus those the server sets itself (messages, tools, ...)."""
        self._renderer: DirectChatRenderer | None = None
        self.renderer = "apply_chat_template"
        """How chat templates are rendered: "direct" (transformers' compiled template, its
        variables prepared once; checked against `apply_chat_template` at load) or
        "apply_chat_template"."""
        self.renderer_note = ""
        """Why `apply_chat_template` renders when it does ("" when the direct render does)."""
        if self.has_chat_template:
            self._try_direct_render()
        self._fast: FastEncoder | None = None
        self.encoder = "tokenizers"
        """The encoder in use: "tiktoken" (the fast one, cross-checked) or "tokenizers"."""
        self.encoder_note = "requested" if encoder == "tokenizers" else ""
        """Why `tokenizers` is used when it is ("" when tiktoken is)."""
        if encoder == "auto":
            self._try_fast(cut_tokens)

    def _try_direct_render(self) -> None:
        """Render the chat template without transformers' per-call wrapping, if it renders a
        built-in corpus exactly as `apply_chat_template` does (docs/decisions/0245)."""
        name = getattr(self._tok, "name_or_path", "") or "tokenizer"
        try:
            renderer = DirectChatRenderer(self._tok)
        except ValueError as exc:
            self.renderer_note = str(exc)
            log.info("%s: chat template rendered by apply_chat_template (%s)", name, exc)
            return
        mismatch = renderer.self_check()
        if mismatch is not None:
            self.renderer_note = f"self-check failed: {mismatch}"
            log.warning("%s: chat template rendered by apply_chat_template (%s)", name, self.renderer_note)
            return
        self._renderer = renderer
        self.renderer = "direct"

    def _try_fast(self, cut_tokens: list[str]) -> None:
        """Build the tiktoken encoder from this tokenizer's own `tokenizer.json` and keep it only
        if it agrees with `tokenizers` on the cross-check corpus (logged once either way)."""
        name = getattr(self._tok, "name_or_path", "") or "tokenizer"
        fast = _fast_encoder(self._backend.to_str())
        if isinstance(fast, str):
            self.encoder_note = f"not a byte-level BPE tiktoken can run: {fast}"
            log.info("%s: token counts by tokenizers (%s)", name, self.encoder_note)
            return
        self._fast = fast
        backend = self._backend
        mismatch = cross_check(
            lambda text: self._encode_fast(self._segments(text)),
            lambda text: list(backend.encode(text, add_special_tokens=False).ids),
            cross_check_corpus(cut_tokens),
        )
        if mismatch is not None:
            self._fast = None
            self.encoder_note = f"cross-check failed: tiktoken {mismatch}"
            log.warning("%s: token counts by tokenizers, not tiktoken (%s)", name, self.encoder_note)
            return
        self.encoder = "tiktoken"
        log.info("%s: token counts by tiktoken (cross-checked against tokenizers)", name)

    def _encode_fast(self, segments: Sequence[str]) -> list[int]:
        """All `segments`' ids by the fast encoder, concatenated (see `_encode_segments`)."""
        out: list[int] = []
        for ids in self._encode_segments(segments):
            out.extend(ids)
        return out

    def _encode_segments(self, segments: Sequence[str]) -> list[list[int]]:
        """Token ids of each segment (no special tokens added): tiktoken for the text after the
        segment's leading added token, else one `encode_batch` by `tokenizers` (both release the
        GIL)."""
        fast = self._fast
        if fast is None:
            return [enc.ids for enc in self._backend.encode_batch(list(segments), add_special_tokens=False)]
        cut = self._cut_re
        out = []
        for seg in segments:
            m = cut.match(seg) if cut is not None else None
            if m is None:
                out.append(fast.encode(seg))
            else:
                ids = [self._added_ids[m.group()]]
                if m.end() < len(seg):
                    ids += fast.encode(seg[m.end():])
                out.append(ids)
        return out

    @classmethod
    def from_source(cls, source: str, *, encoder: str = "auto", cache_bytes: int = DEFAULT_CACHE_BYTES) -> TokenCounter:
        """Load from `builtin:qwen3` or a local directory holding `tokenizer.json` (`~` the
        user's home; a relative path from the working directory, as `architecture`'s) (`encoder`,
        `cache_bytes`: see the class).

        Never touches the network (HF_HUB_OFFLINE, local_files_only).

        Raises:
            TokenizerLoadError: unknown built-in, missing directory or files, or a load failure.
        """
        if source.startswith("builtin:"):
            try:
                path = builtin_tokenizer_dir(source.removeprefix("builtin:"))
            except LookupError as exc:
                raise TokenizerLoadError(str(exc)) from None
        else:
            path = Path(source).expanduser()  # `~` as in a model's `architecture` path
            if not (path / "tokenizer.json").is_file():
                raise TokenizerLoadError(f"tokenizer {source!r}: no tokenizer.json in that directory")
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises many types here
            raise TokenizerLoadError(f"tokenizer {source!r} failed to load: {exc}") from None
        return cls(tok, encoder=encoder, cache_bytes=cache_bytes)

    @property
    def tokenizer(self) -> Any:
        """The underlying transformers tokenizer."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render the chat template to text (what the engine tokenizes).

        Raises:
            BadRequestError: the template rejects the conversation (e.g. a role it does not know).
        """
        kwargs = dict(chat_template_kwargs or {})
        unknown = sorted(set(kwargs) - self.template_kwargs)
        if unknown:
            # Never let a client pass `chat_template` (its own Jinja program, run on our CPU) or
            # override what we set: only variables the model's template actually reads.
            raise BadRequestError(
                f"chat_template_kwargs may only set {sorted(self.template_kwargs) or 'nothing'} for this model; "
                f"got {unknown}",
                param="chat_template_kwargs",
            )
        try:
            if self._renderer is not None:
                return self._renderer.render(
                    messages, tools=tools or None, template_kwargs=kwargs, add_generation_prompt=add_generation_prompt
                )
            return self._tok.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except Exception as exc:  # jinja2 TemplateError, TypeError from odd content
            raise BadRequestError(f"chat template rejected the messages: {exc}", param="messages") from None

    def _segments(self, text: str) -> list[str]:
        """`text` cut just before every added token (non-empty pieces, in order)."""
        cut = self._cut_re
        if cut is None:
            return [text]
        out = []
        last = 0
        lead = self._cut_lead
        if lead is None:
            for m in cut.finditer(text):
                start = m.start()
                if start > last:
                    out.append(text[last:start])
                    last = start
        else:
            # The same cuts as `finditer`: a match can only start at `lead`, and the alternation
            # is tried there in the same order.
            find, match = text.find, cut.match
            start = find(lead)
            while start >= 0:
                m = match(text, start)
                if m is None:
                    start = find(lead, start + 1)
                    continue
                if start > last:
                    out.append(text[last:start])
                    last = start
                start = find(lead, m.end())
        if last < len(text) or not out:
            out.append(text[last:])
        return out

    def plan(self, text: str, *, add_special_tokens: bool = False) -> EncodePlan:
        """Cut `text` into segments and look them up in the cache (cheap: no tokenization).

        `complete()` then tokenizes only the misses; `missing_chars` tells a caller whether
        that is worth a thread hop."""
        segments = self._segments(text)
        ids: list[list[int] | None] = []
        missing: list[int] = []
        missing_chars = 0
        with self._lock:
            for i, seg in enumerate(segments):
                hit = self._cache.get(seg)
                if hit is None:
                    ids.append(None)
                    missing.append(i)
                    missing_chars += len(seg)
                else:
                    self._cache.move_to_end(seg)
                    ids.append(hit)
            self.hits += len(segments) - len(missing)
            self.misses += len(missing)
        return EncodePlan(segments, ids, missing, missing_chars, add_special_tokens, len(text))

    def complete(self, plan: EncodePlan) -> TokenizedPrompt:
        """Tokenize a plan's missing segments (GIL released while encoding), fill the cache,
        and return the whole prompt's ids."""
        ids = plan.ids
        if plan.missing:
            encoded = self._encode_segments([plan.segments[i] for i in plan.missing])
            with self._lock:
                for i, seg_ids in zip(plan.missing, encoded):
                    seg = plan.segments[i]
                    ids[i] = seg_ids
                    if seg in self._cache:
                        continue
                    packed = array("I", seg_ids)
                    size = cache_entry_bytes(seg, packed)
                    if size <= self._cache_limit // 4:  # one segment never takes more than a quarter
                        self._cache[seg] = packed
                        self._cache_tokens += len(packed)
                        self._cache_bytes += size
                while self._cache_bytes > self._cache_limit and self._cache:
                    old_seg, old = self._cache.popitem(last=False)
                    self._cache_tokens -= len(old)
                    self._cache_bytes -= cache_entry_bytes(old_seg, old)
        out: list[int] = list(self._bos_ids) if plan.add_special_tokens else []
        for part in ids:
            out.extend(part)  # type: ignore[arg-type]
        return TokenizedPrompt(out, plan.text_chars)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`, using and filling the segment cache."""
        return self.complete(self.plan(text, add_special_tokens=add_special_tokens)).token_ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens kept and no clean-up (a byte-level BPE gives a
        prompt's text back from its ids; a cut inside a character decodes to U+FFFD)."""
        return self._backend.decode(list(token_ids), skip_special_tokens=False)

    def char_offsets(self, text: str) -> list[tuple[int, int]]:
        """Each token's `(start, end)` character offsets in `text` (no special tokens added,
        no cache: meant for short pieces)."""
        return list(self._backend.encode(text, add_special_tokens=False).offsets)

    def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenizedPrompt:
        """Tokenize a chat conversation as the engine will (template + generation prompt).

        Raises:
            BadRequestError: the chat template rejects the messages.
        """
        text = self.render_chat(messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
        return self.complete(self.plan(text))

    def count_text(self, prompt: str) -> TokenizedPrompt:
        """Tokenize a completions prompt (the tokenizer's own special tokens added, as vLLM does)."""
        return self.complete(self.plan(prompt, add_special_tokens=True))

    def cache_stats(self) -> dict[str, int]:
        """Segment cache figures: entries, tokens and bytes held (`cache_entry_bytes`), its bound
        (bytes), hits and misses (segments)."""
        with self._lock:
            return {
                "entries": len(self._cache), "tokens": self._cache_tokens, "bytes": self._cache_bytes,
                "limit_bytes": self._cache_limit, "hits": self.hits, "misses": self.misses,
            }  # fmt: skip
