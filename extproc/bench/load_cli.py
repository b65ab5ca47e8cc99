"""`llm-extproc load`: the bench's synthetic workload, sent open-loop to a running gateway.

For stacks this process did not start (the docker compose demo's load generator, a staging
gateway): `bench` owns its fleet, this only sends. One line per `--report-every` seconds of
progress, a summary at the end; exit 0 when at least one request succeeded.
"""

from __future__ import annotations

import typer

__all__ = ["gateway_base", "load"]


def gateway_base(url: str) -> str:
    """The gateway's base URL without a trailing slash or the OpenAI `/v1` (the generator adds
    `/v1/...` itself); `up` and `demo` print the API URL with `/v1`, and pasting that doubled it
    into `/v1/v1/chat/completions` and a 404 for every request."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def load(
    url: str = typer.Option("http://127.0.0.1:8080", "--url", help="the gateway's URL (Envoy's listener), with or without the /v1 that `up` prints"),
    rate: float = typer.Option(2.0, "--rate", help="mean arrival rate (requests/s, Poisson)"),
    requests: int = typer.Option(600, "--requests", min=1, help="requests to send"),
    model: str = typer.Option("Qwen/Qwen3-8B", "--model", help="the model field sent"),
    seed: int = typer.Option(0, "--seed", help="workload seed"),
    timeout: float = typer.Option(300.0, "--timeout", help="per-request limit (seconds)"),
) -> None:
    """Send the synthetic workload (the demo's and bench's mix of prompt lengths, shared system
    prompts and multi-turn sessions) to URL and print what came back."""
    import asyncio
    from collections import Counter

    from extproc.bench.commands import _prepare
    from extproc.bench.loadgen import LoadGenConfig, LoadGenerator
    from extproc.bench.runner import Workload
    from extproc.bench.workload import WorkloadSpec, synthetic_workload
    from extproc.clitools import fail

    try:
        spec = WorkloadSpec(requests=requests, rate=rate, seed=seed)
        config = LoadGenConfig(base_url=gateway_base(url), model=model, request_timeout_s=timeout)
    except ValueError as exc:
        raise fail(str(exc)) from None
    _, workload = _prepare(Workload("synthetic", synthetic_workload(spec)))
    record = asyncio.run(LoadGenerator(config).run(workload.requests, handle_signals=True))
    outcomes = Counter(r.error or "ok" for r in record.results)
    endpoints = Counter(r.endpoint for r in record.results if r.error is None)
    typer.echo(f"sent {len(record.results)} in {record.wall_duration_s:.1f} s: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    typer.echo("served by: " + ", ".join(f"{k} {v}" for k, v in endpoints.most_common()))
    raise typer.Exit(0 if outcomes.get("ok") else 1)
