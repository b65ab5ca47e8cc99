"""`llm-extproc load`: the bench's synthetic workload, sent open-loop to a running gateway.

For stacks this process did not start (the docker compose demo's load generator, a staging
gateway): `bench` owns its fleet, this only sends. One line per `--report-every` seconds of
progress, a summary at the end; exit 0 when at least one request succeeded.
"""

from __future__ import annotations

import urllib.parse

import typer

from extproc.config.secrets import mask_urls

__all__ = ["gateway_base", "load"]


_API_PATHS = (("v1", "chat", "completions"), ("v1", "completions"), ("v1",))
"""The OpenAI paths a pasted URL may end with (any case): the generator adds its own."""


def gateway_base(url: str) -> str:
    """The gateway's base URL for the load generator, which adds `/v1/...` itself: `url`
    without a trailing slash and without a trailing `/v1`, `/v1/chat/completions` or
    `/v1/completions` (`v1` in any case). `up` and `demo` print the API URL with `/v1`, and
    pasting that doubled it into `/v1/v1/chat/completions` and a 404 for every request. A path
    before those (a gateway mounted under `/gw`) is kept.

    Raises:
        ValueError: not an http(s) URL with a host, an invalid [IPv6] host, a port outside
            1-65535, a query string or a fragment, or another OpenAI path (`/v1/models`,
            `/v1/v1`, `/chat/completions`): the message names `--url`, and shows the URL with
            its user information masked (`http://***@gw:8080`: a credential typed into
            `--url` never reaches the terminal or a CI log).
    """
    shown = mask_urls(url)
    try:
        parts = urllib.parse.urlsplit(url.strip())  # a bad [IPv6] host raises here
    except ValueError as exc:
        raise ValueError(f"--url has an invalid host ({exc}): {shown!r}") from None
    try:
        port = parts.port  # urllib checks the port only when it is read (0..65535)
    except ValueError:
        raise ValueError(f"--url has an invalid port: {shown!r}") from None
    if port == 0:  # urllib takes it; no server listens on it and every request failed to connect
        raise ValueError(f"--url has an invalid port (1-65535, or none for the scheme's): {shown!r}")
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be an http:// or https:// URL with a host (http://127.0.0.1:8080), got {shown!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"--url takes the gateway's base URL, without a query string or fragment, got {shown!r}")
    segments = [s for s in parts.path.split("/") if s]
    for api in _API_PATHS:
        if tuple(s.lower() for s in segments[-len(api) :]) == api:
            segments = segments[: -len(api)]
            break
    if any(s.lower() in {"v1", "chat", "completions"} for s in segments):
        raise ValueError(
            f"--url path {parts.path!r} is not a gateway base path: give the base URL, with or without /v1, /v1/chat/completions"
            f" or /v1/completions, got {shown!r}"
        )
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/".join(["", *segments]) if segments else "", "", ""))


def load(
    url: str = typer.Option("http://127.0.0.1:8080", "--url", help="the gateway's URL (Envoy's listener), with or without the /v1 that `up` prints (or a full /v1/chat/completions)"),
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

    if not (0 < timeout < float("inf")):  # also refuses NaN; aiohttp failed every request at inf
        raise fail(f"--timeout must be a finite number > 0 (seconds), got {timeout}")
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
    typer.echo("served by: " + (", ".join(f"{k} {v}" for k, v in endpoints.most_common()) or "none (no request succeeded)"))
    raise typer.Exit(0 if outcomes.get("ok") else 1)
