"""`extproc.bench.seeds.run_seeded` end to end: a real simulator behind a real Envoy, two seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from extproc.bench.policies import POLICIES
from extproc.bench.runner import ReplayOptions, Workload
from extproc.bench.seeds import SeededOptions, aggregate, run_seeded
from extproc.bench.stacks import StackSettings
from extproc.bench.steady import SteadySettings
from extproc.bench.workload import WorkloadSpec, synthetic_workload
from tests.bench.stack_helpers import FLEET_1

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_every_seed_gets_its_own_sample_and_fleet_and_a_judged_steady_run(tmp_path: Path, synth) -> None:
    """Seed k draws its own requests (a different sample) and seeds the simulators; the warm-up's
    requests are sent but not counted; one endpoint takes everything: hotspot 1 (even over one)."""
    made: list[int] = []

    def make(seed: int):  # type: ignore[no-untyped-def]
        made.append(seed)
        return Workload("synthetic", synthetic_workload(WorkloadSpec(requests=8, rate=4.0, seed=seed))), synth

    options = SeededOptions(
        policies=[POLICIES["envoy-least-request"]], seeds=[3, 4],
        stack=StackSettings(profiles=(FLEET_1,), speed=4.0, stream_interval=8),
        replay=ReplayOptions(speed=4.0, progress=False), steady=SteadySettings(warmup_s=0.5, min_steady_s=300.0),
        workdir=tmp_path,
    )  # fmt: skip
    seen: list[int] = []
    runs = await run_seeded(options, make, Console(width=200), on_run=lambda r: seen.append(r.seed))
    assert made == [3, 4] and seen == [3, 4]
    assert [r.seed for r in runs] == [3, 4] and {r.policy for r in runs} == {"envoy-least-request"}
    for run in runs:
        assert run.summary.successes == run.summary.requests < 8  # the warm-up's first requests left out
        assert run.hotspot == pytest.approx(1.0) and run.endpoint_source == "header"
        # valid unless this shared machine made the client late (then said, never silently counted)
        assert run.valid == (not run.invalid_reasons)
        assert run.valid or all("behind its schedule" in r or "of a core" in r for r in run.invalid_reasons)
        assert any("< 300 s" in n for n in run.notes)  # a few seconds of arrivals: said, not refused
        assert run.achieved_rps is not None and run.client_cpu >= 0
    assert runs[0].summary.ttft_ms.p50 != runs[1].summary.ttft_ms.p50  # different samples
    assert aggregate(runs)["envoy-least-request"]["ttft_p99_ms"].n == 2
