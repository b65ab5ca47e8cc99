"""What the prefix index says about one request, computed once per scheduling cycle."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PrefixMatch"]


@dataclass(slots=True)
class PrefixMatch:
    """One request's prompt blocks and how many of them each endpoint is believed to hold.

    Attributes:
        prompt_tokens: the request's prompt tokens (tokens).
        hashes: block hashes by block size (tokens → the prompt's cacheable block hashes,
            `extproc.prefix.hashing.chain_block_hashes` cut at `cacheable_blocks`).
        matched: endpoint address → leading blocks it holds (blocks; absent = none).
        block_size: endpoint address → its block size (tokens), for those in `matched`.
    """

    prompt_tokens: int
    hashes: dict[int, list[int]] = field(default_factory=dict)
    matched: dict[str, int] = field(default_factory=dict)
    block_size: dict[str, int] = field(default_factory=dict)

    def cached_tokens(self, address: str) -> int:
        """Prompt tokens the endpoint is believed to hold in its prefix cache (tokens)."""
        blocks = self.matched.get(address, 0)
        return blocks * self.block_size.get(address, 0) if blocks else 0

    def uncached_tokens(self, address: str) -> int:
        """Prompt tokens the endpoint would have to prefill (tokens, ≥ 1: the last prompt
        token is always computed)."""
        return max(1, self.prompt_tokens - self.cached_tokens(address))

    def matched_fraction(self, address: str) -> float:
        """Cached share of the prompt on the endpoint (0..1)."""
        if self.prompt_tokens <= 0:
            return 0.0
        return min(1.0, self.cached_tokens(address) / self.prompt_tokens)
