"""Admission to the tokenizer threads: a decision never queues behind work it cannot outlast.

Long prompts are rendered and tokenized in a small thread pool (`RequestPipeline._count`). An
unbounded queue in front of it turns a flood of huge prompts into a wait for everybody: each
new request's count lands behind all the others, runs out of its budget, and is routed on the
character estimate anyway — after waiting the whole budget, while the threads burn CPU on counts
nobody waits for any more. `OffloadGate` bounds the queue by *time*: a job that finds a thread
free is admitted (it waits for nobody); one that would queue is admitted only when the work
already admitted (characters still to tokenize, at the measured rate of the threads) would let
it start within `max_queue_s` (50 ms by default: an ordinary burst of 8k-token prompts queues
a few milliseconds) and finish within the count budget; otherwise the caller routes on the
estimate at once. Measured under a flood of 200 KB prompts: docs/benchmarks.md, decision 0202.

Event-loop only (not thread-safe): `admit` and `done` are called from the loop.
"""

from __future__ import annotations

__all__ = ["OffloadGate"]


class OffloadGate:
    """Time-bounded admission of counting jobs to the tokenizer threads.

    Args:
        workers: threads in the pool (jobs run this many at a time).
        max_wait_s: the longest a queued job may expect to take, queue included (seconds): the
            count budget, past which the decision would use the estimate anyway.
        max_queue_s: the longest a job may expect to wait behind other jobs before it starts
            (seconds).
        chars_per_s: the starting service rate of one thread (characters per second; learned
            from finished jobs as an exponential moving average, weight `alpha`). 1e6 is
            `tokenizers` on Qwen3 prose on this machine; tiktoken is ~5× faster.
        alpha: weight of the newest job in the rate average (0..1].

    Raises:
        ValueError: non-positive workers, wait or rate, or alpha outside (0, 1].
    """

    def __init__(
        self, workers: int, max_wait_s: float, *, max_queue_s: float = 0.05, chars_per_s: float = 1e6, alpha: float = 0.2
    ) -> None:
        if workers < 1 or max_wait_s <= 0 or max_queue_s < 0 or chars_per_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("OffloadGate needs workers >= 1, max_wait_s > 0, max_queue_s >= 0, chars_per_s > 0 and 0 < alpha <= 1")
        self._workers = workers
        self._max_wait_s = max_wait_s
        self._max_queue_s = max_queue_s
        self._alpha = alpha
        self.chars_per_s = chars_per_s
        """The learned service rate of one thread (characters per second)."""
        self.jobs = 0
        """Jobs admitted and not finished."""
        self.queued_chars = 0
        """Characters of those jobs."""
        self.refused = 0
        """Jobs refused so far (routed on the estimate instead)."""

    def queue_s(self) -> float:
        """Seconds a job admitted now should wait before a thread takes it (0 with one free;
        else the work ahead spread over the threads)."""
        if self.jobs < self._workers:
            return 0.0
        return self.queued_chars / self._workers / self.chars_per_s

    def admit(self, chars: int) -> bool:
        """Admit a job of `chars` characters (True: submit it, then call `done`), or refuse it
        (False: route on the estimate): a job that would queue is refused when it should wait
        more than `max_queue_s` or finish after `max_wait_s`."""
        wait = self.queue_s()
        if wait > 0 and (wait > self._max_queue_s or wait + chars / self.chars_per_s > self._max_wait_s):
            self.refused += 1
            return False
        self.jobs += 1
        self.queued_chars += chars
        return True

    def done(self, chars: int, service_s: float | None) -> None:
        """A job admitted with `chars` finished (or failed, `service_s` None); `service_s` is
        the time it took in its thread (seconds), which updates the learned rate."""
        self.jobs -= 1
        self.queued_chars -= chars
        if service_s is not None and service_s > 0 and chars >= 1000:  # small jobs measure overhead, not rate
            rate = chars / service_s
            self.chars_per_s += self._alpha * (rate - self.chars_per_s)
