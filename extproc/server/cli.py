"""`llm-extproc serve`: run the ext_proc server until SIGTERM/SIGINT."""

from __future__ import annotations

import typer

__all__ = ["serve"]


def serve(
    config: str = typer.Option(
        "", "--config", "-c", help="YAML configuration (see deploy/config.example.yaml); default: embedded defaults"
    ),
    endpoint: list[str] = typer.Option(
        [], "--endpoint", "-e", help="ip:port of an endpoint serving the default model (repeatable; only without --config)"
    ),
    log_level: str = typer.Option("info", help="debug, info, warning, error, critical"),
) -> None:
    """Run the ext_proc gRPC server (ext_proc + grpc.health.v1) and the admin HTTP server."""
    import asyncio
    import sys

    from extproc.clitools import fail, setup_logging, stop_on_signals
    from extproc.config import ConfigError, default_config, load_config
    from extproc.pipeline.tokens import TokenizerLoadError
    from extproc.server.app import ExtProcApp

    setup_logging(log_level)
    try:
        if config:
            if endpoint:
                raise ConfigError("--endpoint only applies without --config (list endpoints in the file)")
            cfg = load_config(config)
        else:
            cfg = default_config(endpoint or None)
    except ConfigError as exc:
        raise fail(str(exc)) from None
    from extproc.server.overrides_api import load_admin_token

    try:
        load_admin_token()  # an unreadable token file stops the start with its variable named
    except ValueError as exc:
        raise fail(str(exc)) from None

    async def run() -> None:
        app = ExtProcApp(cfg)
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
        print("shutting down: waiting for in-flight streams", file=sys.stderr, flush=True)
        await app.aclose()

    asyncio.run(run())
