"""The tokenizer threads' admission: bounded by the time the queued work would take."""

from __future__ import annotations

import pytest

from extproc.pipeline.offload import OffloadGate


def test_a_job_that_finds_a_thread_free_is_admitted_whatever_its_size():
    gate = OffloadGate(workers=2, max_wait_s=0.5, chars_per_s=1e6)
    assert gate.admit(10**9)  # alone, a huge prompt still gets its exact count
    assert gate.admit(10**9)  # the second thread is free: it waits for nobody
    assert (gate.jobs, gate.queued_chars) == (2, 2 * 10**9)
    assert not gate.admit(1)  # the third would queue behind 1,000 s of work


def test_a_job_that_would_queue_is_bounded_by_its_wait_and_its_budget():
    gate = OffloadGate(workers=2, max_wait_s=0.5, max_queue_s=0.05, chars_per_s=1e6)
    assert gate.admit(40_000) and gate.admit(40_000)
    assert gate.queue_s() == pytest.approx(0.04)  # 80k characters ahead on 2 threads at 1M/s
    assert gate.admit(10_000)  # starts after 40 ms, done after 50
    assert not gate.admit(500_000)  # would start in time but finish after the 0.5 s budget
    assert gate.admit(20_000)  # 90k ahead: 45 ms
    assert gate.queue_s() == pytest.approx(0.055)
    assert not gate.admit(1)  # past the 50 ms queue bound
    assert (gate.jobs, gate.queued_chars, gate.refused) == (4, 110_000, 2)
    gate.done(40_000, 0.04)
    assert gate.admit(1)  # the work ahead shrank: room again


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


@pytest.mark.parametrize(
    "kwargs", [{"workers": 0}, {"max_wait_s": 0}, {"max_queue_s": -1}, {"chars_per_s": 0}, {"alpha": 0}, {"alpha": 1.5}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        OffloadGate(**{"workers": 1, "max_wait_s": 1.0, **kwargs})
