"""`scripts/bench_prefix.py`'s option checks (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_bad_extproc_config_exits_2_with_one_error_before_anything_runs(tmp_path):
    """`--extproc-config` was checked inside each run, after the first workload was prepared,
    and its failure (the bench CLI's `typer.Exit`) escaped the argparse script as a traceback.
    Now it is checked first: the bench CLI's error line, exit 2, nothing prepared or written."""
    bad = tmp_path / "variant.yaml"
    bad.write_text("scheduling:\n  profile: nope\n")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "scripts/bench_prefix.py", "--extproc-config", str(bad), "--workloads", "shared-system", "--requests", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --extproc-config: invalid configuration in"), done.stderr
    assert "scheduling.profile: profile 'nope' is not defined" in done.stderr
    assert "Traceback" not in done.stderr and "oracle hit rate" not in done.stderr
    assert not any(out.iterdir())
