"""`llm-extproc pd-sidecar`: run the P/D sidecar in front of a decode engine until SIGTERM/SIGINT.

Prints one line when ready: `pd-sidecar listening on http://HOST:PORT decode=URL allow=SOURCE`.
"""

from __future__ import annotations

from pathlib import Path

import typer

__all__ = ["pd_sidecar"]


def pd_sidecar(
    decode: str = typer.Option(..., help="the local decode engine, http://host:port"),
    listen: str = typer.Option("127.0.0.1:8000", help="host:port to listen on (where the router's destination points)"),
    config: Path | None = typer.Option(
        None, help="the router's config: prefill endpoints (role prefill or both) from its endpoints and discovery are allowed"
    ),
    allow: list[str] = typer.Option([], help="an allowed prefill endpoint host:port (repeatable; instead of --config)"),
    prefill_retries: int = typer.Option(2, min=0, help="retries of a prefill answered 502/503/504 or unreachable"),
    prefill_timeout_s: float = typer.Option(60.0, help="time limit of one prefill attempt (seconds); one that runs out is not retried"),
    local_fallback: bool = typer.Option(False, help="after a failed prefill, decode locally instead of answering 502"),
) -> None:
    """Run the two-step prefill/decode protocol (vLLM NIXL connector) in front of a decode engine."""
    import asyncio

    from extproc.clitools import fail, skip_final_collection, stop_on_signals
    from extproc.config.schema import parse_host_port
    from extproc.pd.sidecar import PDSidecar, static_prefillers

    if (config is None) == (not allow):
        raise fail("give --config (the router's discovery) or --allow host:port, one of them")
    if not decode.startswith("http://"):
        raise fail(f"--decode must be http://host:port, got {decode!r}")
    try:
        host, port = parse_host_port(listen)
        allows = static_prefillers(allow) if allow else None
        sidecar = PDSidecar(
            decode, allows or (lambda _: False), host=host, port=port, prefill_retries=prefill_retries,
            prefill_timeout_s=prefill_timeout_s, local_fallback=local_fallback,
        )  # fmt: skip
    except ValueError as exc:
        raise fail(str(exc)) from None

    async def main() -> None:
        stop = stop_on_signals()
        discovery = None
        if config is not None:
            discovery = await _discovery(config)
            from extproc.pd.sidecar import discovered_prefillers

            sidecar.allows = discovered_prefillers(discovery[0])
            await discovery[1].start()
        try:
            await sidecar.start()
        except OSError as exc:
            raise fail(f"cannot listen on {listen}: {exc.strerror or exc}", 1) from None
        source = str(config) if config is not None else ",".join(allow)
        typer.echo(f"pd-sidecar listening on http://{host}:{sidecar.port} decode={decode} allow={source}")
        try:
            await stop.wait()
        finally:
            await sidecar.aclose()
            if discovery is not None:
                await discovery[1].aclose()

    asyncio.run(main())
    skip_final_collection()


async def _discovery(path: Path):
    """The router's endpoints and discovery sources from its config: a datastore and the
    `Discovery` that keeps it current (not started)."""
    from extproc.clitools import fail
    from extproc.config.loader import ConfigError, load_config
    from extproc.datastore.endpoints import Datastore
    from extproc.discovery.base import SourceContext
    from extproc.discovery.manager import Discovery
    from extproc.discovery.registry import build_source

    try:
        cfg = load_config(path)
    except (ConfigError, OSError) as exc:
        raise fail(f"--config: {exc}") from None
    store = Datastore(cfg.endpoints)
    d = cfg.discovery
    ctx = SourceContext(cfg, path)
    return store, Discovery(store, [build_source(p, ctx) for p in d.sources], drain_timeout_s=d.drain_timeout_s, initial_wait_s=d.initial_wait_s)
