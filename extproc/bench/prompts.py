"""Synthesize chat prompts with an exact token count under the default tokenizer.

Token-length traces (Mooncake, Azure, BurstGPT, the synthetic workload) carry lengths, not text.
To replay them we build text from words that are each exactly one token with a leading space
(`" apple"`). A byte-level BPE tokenizer (Qwen3's) pre-splits text at word boundaries before
merging, so `n` such words concatenated are exactly `n` tokens; the vetted vocabulary is checked
for that property against the real tokenizer when it is built (individually, and all words
joined).

Text is deterministic: a *stream* named by a string key is a sequence of 512-word blocks, block
`j` drawn by a generator seeded from `blake2b(key, j)`. So:
  - a Mooncake hash id `h` always maps to the same 512 tokens (stream `block:h`); requests that
    share leading `hash_ids` share the same leading tokens, as the trace intends;
  - a session's prompt is the first `n` tokens of its stream (`session:<id>`), so a later turn
    with a longer prompt starts with the whole earlier prompt, as a resent history does;
  - a request with neither gets its own stream (`request:<key>`).

The final prompt is one user message; the chat template adds a fixed number of tokens
(`PromptSynthesizer.overhead`, 8 for Qwen3), subtracted from the target so that the templated
prompt has exactly `input_tokens` tokens (when `input_tokens > overhead`).
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from extproc.bench.records import TraceRequest
    from extproc.pipeline.tokens import TokenCounter

__all__ = ["BLOCK_TOKENS", "PromptSynthesizer", "WordVocabulary"]

BLOCK_TOKENS = 512
"""Words per stream block; equal to Mooncake's block size so one hash id is one block."""

_WORD_RE = re.compile(r"[a-z]{3,10}")
_SPACE_MARKERS = ("Ġ", "▁")  # byte-level BPE (GPT-2/Qwen) and SentencePiece spellings of a leading space


class WordVocabulary:
    """Words `w` such that `" " + w` is exactly one token, and so is each in any sequence.

    Built from the tokenizer's own vocabulary at run time: candidates are vocabulary entries that
    are a space marker plus 3-10 lowercase ASCII letters; each is kept only if the tokenizer
    encodes `" " + w` to one id, and the whole kept list, joined, must encode to exactly one id
    per word. Sorted, so deterministic for a given tokenizer.

    Attributes:
        words: the vetted words, each with its leading space (e.g. `" apple"`).
    """

    def __init__(self, words: Sequence[str]) -> None:
        if len(words) < 256:
            raise ValueError(f"a prompt vocabulary needs at least 256 words, got {len(words)}")
        self.words: tuple[str, ...] = tuple(words)
        self._array = np.array(self.words, dtype=object)

    @classmethod
    def from_counter(cls, counter: TokenCounter) -> WordVocabulary:
        """Derive and vet the vocabulary for `counter`'s tokenizer.

        Raises:
            ValueError: the tokenizer does not split at word boundaries, or has too few words.
        """
        vocab = counter.tokenizer.get_vocab()
        candidates = sorted(
            {
                token[1:]
                for token in vocab
                if token[:1] in _SPACE_MARKERS and _WORD_RE.fullmatch(token[1:])
            }
        )
        spaced = [" " + w for w in candidates]
        encoded = counter.tokenizer.backend_tokenizer.encode_batch(spaced, add_special_tokens=False)
        kept = [w for w, enc in zip(spaced, encoded) if len(enc.ids) == 1]
        joined = counter.encode("".join(kept), add_special_tokens=False)
        if len(joined) != len(kept):
            raise ValueError(
                f"tokenizer merges across word boundaries ({len(kept)} words gave {len(joined)} tokens); "
                "exact-length prompts are not possible with it"
            )
        return cls(kept)

    def __len__(self) -> int:
        return len(self.words)

    def text(self, indices: np.ndarray) -> str:
        """Concatenate the words at `indices` (one token each)."""
        return "".join(self._array[indices])


def _seed(key: str, block: int) -> int:
    digest = hashlib.blake2b(f"{key}\x00{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class PromptSynthesizer:
    """Build exact-length chat messages for token-length trace requests.

    Args:
        counter: the tokenizer the target engine uses (default model: `builtin:qwen3`).
        vocabulary: a vetted vocabulary (default: derived from `counter`).
        cache_blocks: how many stream blocks (word-index arrays) to keep (LRU).

    Loading the vocabulary tokenizes ~20k words once (well under a second); building a prompt
    never calls the tokenizer.
    """

    def __init__(
        self, counter: TokenCounter, vocabulary: WordVocabulary | None = None, *, cache_blocks: int = 8192
    ) -> None:
        self.counter = counter
        self.vocabulary = vocabulary if vocabulary is not None else WordVocabulary.from_counter(counter)
        self._blocks: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._cache_blocks = cache_blocks
        self._overhead: int | None = None

    @property
    def overhead(self) -> int:
        """Tokens the chat template adds around one user message (8 for Qwen3)."""
        if self._overhead is None:
            one = self.vocabulary.words[0]
            self._overhead = self.counter.count_chat([{"role": "user", "content": one}]).count - 1
        return self._overhead

    def _block(self, key: str, block: int) -> np.ndarray:
        cache_key = (key, block)
        hit = self._blocks.get(cache_key)
        if hit is not None:
            self._blocks.move_to_end(cache_key)
            return hit
        rng = np.random.default_rng(_seed(key, block))
        indices = rng.integers(0, len(self.vocabulary), size=BLOCK_TOKENS)
        self._blocks[cache_key] = indices
        if len(self._blocks) > self._cache_blocks:
            self._blocks.popitem(last=False)
        return indices

    def stream_text(self, key: str, n_tokens: int) -> str:
        """The first `n_tokens` tokens of stream `key` (text of exactly `n_tokens` tokens)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        parts = []
        for block in range(-(-n_tokens // BLOCK_TOKENS)):
            take = min(BLOCK_TOKENS, n_tokens - block * BLOCK_TOKENS)
            parts.append(self.vocabulary.text(self._block(key, block)[:take]))
        return "".join(parts)

    def blocks_text(self, blocks: Sequence[int], n_tokens: int) -> str:
        """Text of `n_tokens` tokens laid over hash blocks: block id `h` is always the same 512 tokens.

        Raises:
            ValueError: `n_tokens` exceeds `len(blocks) * 512`.
        """
        if n_tokens > len(blocks) * BLOCK_TOKENS:
            raise ValueError(f"{n_tokens} tokens do not fit in {len(blocks)} blocks of {BLOCK_TOKENS}")
        parts = []
        for i, block_id in enumerate(blocks):
            take = min(BLOCK_TOKENS, n_tokens - i * BLOCK_TOKENS)
            if take <= 0:
                break
            parts.append(self.vocabulary.text(self._block(f"block:{block_id}", 0)[:take]))
        return "".join(parts)

    def user_content(self, request: TraceRequest, *, key: str) -> str:
        """The user message text for a token-length request (its content tokens: input − overhead).

        Args:
            request: the request; its `prefix_blocks`, else `session`, else `key` picks the stream.
            key: a name unique to this request within the run (e.g. its index), used when the
                request has neither blocks nor a session.
        """
        n = max(1, request.input_tokens - self.overhead)
        if request.prefix_blocks:
            if n <= len(request.prefix_blocks) * BLOCK_TOKENS:
                return self.blocks_text(request.prefix_blocks, n)
            # More tokens than blocks (not seen in Mooncake): the blocks, then unique text.
            head = self.blocks_text(request.prefix_blocks, len(request.prefix_blocks) * BLOCK_TOKENS)
            return head + self.stream_text(f"request:{key}", n - len(request.prefix_blocks) * BLOCK_TOKENS)
        if request.session:
            return self.stream_text(f"session:{request.session}", n)
        return self.stream_text(f"request:{key}", n)

    def messages_for(self, request: TraceRequest, *, key: str) -> list[dict[str, Any]]:
        """Chat messages to send for `request`: its real messages, or one synthesized user message.

        With synthesized text the templated prompt has exactly `request.input_tokens` tokens
        (at least `overhead + 1`).
        """
        if request.messages is not None:
            return request.messages
        return [{"role": "user", "content": self.user_content(request, key=key)}]
