"""How many output tokens a model's requests really produce, learned from completed responses.

Clients often send a `max_tokens` far above what they get back (4096, 32768, the model's whole
context, for answers of a few hundred tokens). `max_tokens` stays what the KV cache is reserved
for (vLLM reserves for it: `kv-fit-filter`, KV admission), but as the expected decode length it
made the scheduler's decode terms (`ttft-estimate-scorer`: the per-step floor and the context
read, both × output tokens) dominate the cost, and requests piled onto the fastest GPUs whatever
their queues. The decode terms use `min(max_tokens, estimate)` instead, the estimate being a high
quantile (default p95) of the model's recent completed output lengths (`OutputLengthWindow`).

A quantile, not the mean: a workload whose clients set `max_tokens` to the real length (most
benchmarks, agents with tight budgets) is capped only on its longest ~5 % of requests, and only
down to what 95 % of its requests stay under. Before `min_samples` completions there is no cap
(`max_tokens`, as before); a request without `max_tokens` keeps the model's
`default_output_tokens` estimate.

Fed only from completed responses (`StreamObserver` outcome `complete`): an aborted or failed
stream stopped early and would bias the quantile low. Only observed responses feed it
(`telemetry.sample_rate` of them), so at the default 0.1 the first cap comes after about
10 × `min_samples` requests. Each replica (`extproc.replicas`) learns its own estimate from the
responses it observes; replicas see statistically alike traffic, so the estimates agree closely
and nothing is synchronised.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable

from extproc.config.schema import OutputEstimateConfig

__all__ = ["OutputEstimates", "OutputLengthWindow"]


class OutputLengthWindow:
    """A quantile of the last `window` output lengths (tokens per sequence).

    Memory: two containers of at most `window` ints (the arrival order, and the same values
    sorted). An update costs O(log window) comparisons plus one list shift of at most `window`
    pointers (a memmove: ~1 µs at 1000); reading the quantile is O(1).

    Args:
        quantile: in (0, 1]; 1 is the window's maximum.
        window: how many recent lengths are kept (≥ 1).
        min_samples: lengths needed before `estimate` gives a value (1 ≤ min_samples ≤ window).

    Raises:
        ValueError: a parameter out of range.
    """

    __slots__ = ("_order", "_sorted", "window", "quantile", "min_samples", "seen")

    def __init__(self, quantile: float, window: int, min_samples: int) -> None:
        if not (0 < quantile <= 1) or math.isnan(quantile):
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1:
            raise ValueError(f"window must be ≥ 1, got {window}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window={window}], got {min_samples}")
        self.quantile = quantile
        self.min_samples = min_samples
        self.window = window
        self._order: deque[int] = deque()
        self._sorted: list[int] = []
        self.seen = 0
        """Lengths observed in all (count), the evicted ones included."""

    def observe(self, tokens: int) -> None:
        """Add one completed sequence's output length (tokens, ≥ 0); the oldest leaves when the
        window is full.

        Raises:
            ValueError: a negative length.
        """
        if tokens < 0:
            raise ValueError(f"an output length is ≥ 0 tokens, got {tokens}")
        if len(self._order) == self.window:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(tokens)
        bisect.insort(self._sorted, tokens)
        self.seen += 1

    def __len__(self) -> int:
        return len(self._sorted)

    def estimate(self) -> int | None:
        """The quantile of the window (tokens: the smallest length with at least `quantile` of
        the window at or below it; at least 1), or None before `min_samples` lengths."""
        n = len(self._sorted)
        if n < self.min_samples:
            return None
        rank = max(1, math.ceil(self.quantile * n))  # nearest-rank quantile
        return max(1, self._sorted[rank - 1])


class OutputEstimates:
    """Per configured model (canonical name), its `OutputLengthWindow`.

    Args:
        models: (canonical model name, its `output_estimate` settings) pairs; a model whose
            settings have `enabled: false` gets no window and is never capped.
    """

    def __init__(self, models: Iterable[tuple[str, OutputEstimateConfig]]) -> None:
        self._windows = {
            name: OutputLengthWindow(cfg.quantile, cfg.window, cfg.min_samples) for name, cfg in models if cfg.enabled
        }

    def observe(self, model: str, tokens: int, n: int = 1) -> int | None:
        """Record a completed response of `model` that produced `tokens` output tokens over `n`
        sequences (each counts `tokens / n`, rounded). An unknown or disabled model, or a
        negative count, is ignored. Returns the model's estimate afterwards (tokens), or None.
        """
        window = self._windows.get(model)
        if window is None or tokens < 0:
            return None
        window.observe(round(tokens / max(1, n)))
        return window.estimate()

    def cap(self, model: str) -> int | None:
        """The model's current estimate (tokens per sequence), or None: not learned yet (fewer
        than `min_samples` completions), disabled or unknown."""
        window = self._windows.get(model)
        return None if window is None else window.estimate()

    def decode_tokens(self, model: str, max_tokens: int | None, expected: int) -> int:
        """The output count for the decode terms (tokens): `min(max_tokens, estimate)` when the
        request set `max_tokens` and the model's estimate is learned, else `expected` (the
        request's `max_tokens`, or the model's `default_output_tokens` estimate without one)."""
        if max_tokens is None:
            return expected
        cap = self.cap(model)
        return expected if cap is None else min(expected, cap)

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        """Per model: the estimate (tokens or None), its quantile, window and min_samples,
        lengths held, and completions seen in all — for the admin API."""
        return {
            name: {
                "estimate_tokens": w.estimate(),
                "quantile": w.quantile,
                "window": w.window,
                "min_samples": w.min_samples,
                "samples": len(w),
                "completions_seen": w.seen,
            }
            for name, w in sorted(self._windows.items())
        }
