"""`llm-extproc load`: the synthetic workload against a running server (here one simulator)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.bench.load_cli import gateway_base
from extproc.stack.fleet import SimProcess


def _load(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", "load", *args], capture_output=True, text=True, timeout=120, check=False)


async def test_load_sends_the_workload_and_reports(tmp_path: Path):
    sim = SimProcess("h100-qwen3-8b", name="sim", workdir=tmp_path, speed=20.0)
    await sim.start()
    try:
        # The API URL as `up` prints it, with /v1: the generator adds /v1 itself, once.
        done = _load("--url", sim.url + "/v1/", "--rate", "50", "--requests", "6")
    finally:
        await sim.aclose()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sent 6 in" in done.stdout and "ok 6" in done.stdout


@pytest.mark.parametrize("args", [["--url", "localhost:8080"], ["--url", "http://127.0.0.1:9/v1?x=1"], ["--rate", "0"]])
def test_bad_arguments_are_clear_errors(args: list[str]):
    done = _load(*args, "--requests", "1")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and ("http://" in done.stderr + done.stdout or "rate" in done.stderr + done.stdout)


@pytest.mark.parametrize("timeout", ["inf", "nan", "0"])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(timeout: str):
    """`--timeout inf` was taken and every request then failed inside aiohttp (OverflowError
    converting the deadline); `nan` was taken as well. Both are refused before anything is sent."""
    done = _load("--url", "http://127.0.0.1:9", "--timeout", timeout, "--requests", "1")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == f"error: --timeout must be a finite number > 0 (seconds), got {float(timeout)}"


def test_the_gateway_base_drops_one_trailing_v1_only():
    assert gateway_base("http://gw:8080/v1") == gateway_base("http://gw:8080/v1/") == "http://gw:8080"
    assert gateway_base("http://gw:8080/") == "http://gw:8080"
    assert gateway_base("http://gw:8080/prefix/v1") == "http://gw:8080/prefix"
    assert gateway_base("http://gw:8080/v1x") == "http://gw:8080/v1x"


@pytest.mark.parametrize(
    "url",
    ["http://gw:8080/V1", "http://gw:8080/v1/chat/completions", "http://gw:8080/v1/completions/", "http://gw:8080/V1/Chat/Completions"],
)
def test_the_gateway_base_drops_the_openai_path_in_any_case(url: str):
    """`/V1` and a full endpoint path were kept and doubled into `/V1/v1/chat/completions`."""
    assert gateway_base(url) == "http://gw:8080"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://gw:8080/v1?x=1", "without a query string or fragment"),  # was kept: '/v1?x=1/v1/chat/completions'
        ("http://gw:8080/#top", "without a query string or fragment"),
        ("http://gw:8080/v1/models", "is not a gateway base path"),
        ("http://gw:8080/v1/v1", "is not a gateway base path"),
        ("http://gw:8080/chat/completions", "is not a gateway base path"),
        ("localhost:8080", "http:// or https:// URL with a host"),
        ("http://gw:80x/", "invalid port"),
        ("http://gw:0", "invalid port \\(1-65535"),  # taken: every request then failed to connect
        ("http://gw:65536/", "invalid port"),
        ("http://[::1:8080/", "invalid host"),  # urllib's own 'Invalid IPv6 URL', naming no option
        ("http://[gw]:8080/", "invalid host"),
    ],
)
def test_a_url_that_is_not_a_gateway_base_is_refused_naming_the_option(url: str, message: str):
    with pytest.raises(ValueError, match=message) as info:
        gateway_base(url)
    assert str(info.value).startswith("--url")


async def test_a_run_where_nothing_succeeded_says_so(tmp_path: Path):
    """Every request refused (a model the server does not serve): `served by:` was printed empty."""
    sim = SimProcess("h100-qwen3-8b", name="sim", workdir=tmp_path, speed=20.0)
    await sim.start()
    try:
        done = _load("--url", sim.url, "--rate", "50", "--requests", "2", "--model", "no-such-model")
    finally:
        await sim.aclose()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "served by: none (no request succeeded)" in done.stdout


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:s3cr3t-pw@gw:0/",
        "http://alice:s3cr3t-pw@gw:8080/v1?x=1",
        "ftp://alice:s3cr3t-pw@gw:8080/",
        "http://alice:s3cr3t-pw@gw:8080/v1/models",
        "http://gw:8080/?api_key=s3cr3t-pw",
    ],
)
def test_a_refused_url_is_shown_without_its_credentials(url: str):
    """`load --url http://user:password@gw/...` echoed the password in its own error."""
    with pytest.raises(ValueError) as info:
        gateway_base(url)
    assert "s3cr3t-pw" not in str(info.value) and "***" in str(info.value)
    done = _load("--url", url, "--requests", "1")
    assert done.returncode == 2 and "s3cr3t-pw" not in done.stdout + done.stderr, done.stderr
