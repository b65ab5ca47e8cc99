"""The tokenizer threads' admission: bounded by the time the queued work would take."""

from __future__ import annotations

import pytest

from extproc.pipeline.offload import OffloadGate


def test_an_idle_pool_admits_any_job():
    gate = OffloadGate(workers=2, max_wait_s=0.5, chars_per_s=1e6)
    assert gate.admit(10**9)  # alone, a huge prompt still gets its exact count
    assert (gate.jobs, gate.queued_chars) == (1, 10**9)


def test_a_job_that_could_not_finish_within_the_budget_is_refused():
    gate = OffloadGate(workers=2, max_wait_s=0.5, chars_per_s=1e6)
    assert gate.admit(400_000)
    # (400k / 2 threads + 200k) / 1M chars/s = 0.4 s: fits; then (600k / 2 + 250k) / 1M = 0.55 s does not.
    assert gate.admit(200_000)
    assert not gate.admit(250_000)
    assert (gate.jobs, gate.queued_chars, gate.refused) == (2, 600_000, 1)
    gate.done(400_000, 0.4)
    assert gate.admit(250_000)  # the work ahead finished: room again


def test_the_rate_is_learned_from_finished_jobs():
    gate = OffloadGate(workers=1, max_wait_s=1.0, chars_per_s=1e6, alpha=0.5)
    gate.admit(100_000)
    gate.done(100_000, 0.01)  # 10M chars/s measured
    assert gate.chars_per_s == pytest.approx(5.5e6)
    gate.admit(500)
    gate.done(500, 1.0)  # small jobs measure overhead, not rate: ignored
    gate.admit(5_000)
    gate.done(5_000, None)  # failed or cancelled: no measurement
    assert gate.chars_per_s == pytest.approx(5.5e6)
    assert (gate.jobs, gate.queued_chars) == (0, 0)


@pytest.mark.parametrize("kwargs", [{"workers": 0}, {"max_wait_s": 0}, {"chars_per_s": 0}, {"alpha": 0}, {"alpha": 1.5}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        OffloadGate(**{"workers": 1, "max_wait_s": 1.0, **kwargs})
