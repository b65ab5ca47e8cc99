"""`llm-extproc sim`: run one simulated vLLM server until SIGTERM/SIGINT.

Prints one line when ready: `sim listening on http://HOST:PORT profile=NAME model=NAME`.
"""

from __future__ import annotations

import typer

from extproc.sim.profiles import DEFAULT_PROFILE, PROFILES, SIM_TOKENIZER

__all__ = ["sim"]

_PROFILE_HELP = "engine profile (GPU × model); one of: " + ", ".join(PROFILES)
_OPTION_OF = {"kv_events_replay": "kv-events-replay-endpoint"}
"""`SimServer` arguments whose option is not the argument's name with dashes."""


def sim(
    port: int = typer.Option(8000, min=0, max=65535, help="listen port (0 = any free port)"),
    host: str = typer.Option("127.0.0.1", help="listen address"),
    profile: str = typer.Option(DEFAULT_PROFILE, help=_PROFILE_HELP),
    model: str | None = typer.Option(None, help="served model name (default: the profile's model)"),
    tokenizer: str = typer.Option(
        SIM_TOKENIZER, help="tokenizer it counts with (/tokenize, usage): builtin:qwen3 or a directory with tokenizer.json"
    ),
    speed: float = typer.Option(1.0, help="simulated seconds per wall second (10 = 10× faster)"),
    stream_interval: int = typer.Option(1, help="output tokens per streamed chunk (vLLM --stream-interval)"),
    num_gpu_blocks: int | None = typer.Option(
        None, min=1, help="KV pool size in blocks (default: from GPU memory and --gpu-memory-utilization; not with it)"
    ),
    max_num_seqs: int | None = typer.Option(None, min=1, help="most running requests (default: vLLM's per-GPU default)"),
    max_num_batched_tokens: int | None = typer.Option(None, min=1, help="token budget per step (default: per GPU)"),
    block_size: int | None = typer.Option(None, min=1, help="KV block size in tokens (default 16)"),
    max_model_len: int | None = typer.Option(None, min=1, help="context limit in tokens (default: the model's)"),
    gpu_memory_utilization: float | None = typer.Option(
        None, help="fraction of HBM vLLM may use, which sizes the KV pool (default 0.9; not with --num-gpu-blocks)"
    ),
    max_waiting: int | None = typer.Option(None, min=0, help="reject new requests while this many wait"),
    queue_full_status: int = typer.Option(429, help="status for those rejections: 429 or 503"),
    legacy_metrics: bool = typer.Option(False, help="emit vllm:gpu_cache_usage_perc / time_per_output_token"),
    load_shape: str = typer.Option("sglang", help="/get_load body: sglang (array) or vllm-router ({load})"),
    seed: int = typer.Option(0, help="seed for output lengths and fault coin flips"),
    fault_error_rate: float = typer.Option(0.0, help="fault: fraction of requests answered 500"),
    fault_die_after_chunks: int | None = typer.Option(None, help="fault: abort streams after N chunks"),
    fault_metrics_hang: bool = typer.Option(False, help="fault: /metrics never answers"),
    fault_health_fail: bool = typer.Option(False, help="fault: /health answers 503"),
    fault_refuse_connections: bool = typer.Option(False, help="fault: do not accept connections"),
    fault_jitter_ms: float = typer.Option(0.0, help="fault: random extra delay per chunk (simulated ms)"),
    kv_events_port: int | None = typer.Option(
        None, min=0, max=65535, help="publish vLLM KV-cache events (ZMQ PUB) on tcp://HOST:PORT (0 = any free port)"
    ),
    kv_events_endpoint: str | None = typer.Option(None, help="publish KV-cache events on this ZMQ endpoint (tcp://...)"),
    kv_events_replay_endpoint: str | None = typer.Option(
        None, help="serve vLLM's KV-event replay (ZMQ ROUTER) on this endpoint (tcp://...)"
    ),
    role: str = typer.Option("both", help="P/D role: prefill (holds KV for a decode engine), decode (pulls it) or both"),
    kv_link_gbytes_per_s: float = typer.Option(25.0, help="KV transfer bandwidth a pull is charged at (GB/s)"),
    kv_hold_timeout_s: float = typer.Option(480.0, help="how long a finished prefill holds its KV for a pull (simulated s)"),
    lora_modules: str = typer.Option("", help="LoRA adapter names served on the model, comma-separated (vLLM --lora-modules)"),
    max_loras: int = typer.Option(0, min=0, help="GPU LoRA slots; a batch holds at most this many adapters (default 1 with adapters)"),
    max_cpu_loras: int = typer.Option(0, min=0, help="LoRA adapters kept in host memory (default --max-loras)"),
    lora_rank: int = typer.Option(16, help="the adapters' rank (sizes their load time)"),
    lora_load_scale: float = typer.Option(1.0, help="factor on every adapter load time (slower storage)"),
    lora_metrics: str = typer.Option("residency", help="LoRA metrics exported: residency (new and old) or activity (lora_requests_info only)"),
) -> None:
    """Run an OpenAI-compatible vLLM simulator with a calibrated engine model."""
    import asyncio

    from pydantic import ValidationError

    from extproc.clitools import fail, skip_final_collection, stop_on_signals
    from extproc.sim.faults import Faults
    from extproc.pipeline.tokens import TokenCounter, TokenizerLoadError
    from extproc.sim.server import SimOptionError, SimServer

    if kv_events_port is not None and kv_events_endpoint is not None:
        raise fail("give --kv-events-port or --kv-events-endpoint, not both")
    if kv_events_port is not None:
        kv_events_endpoint = f"tcp://{host}:{kv_events_port or '*'}"
    try:
        faults = Faults(
            error_rate=fault_error_rate,
            die_after_chunks=fault_die_after_chunks,
            metrics_hang=fault_metrics_hang,
            health_fail=fault_health_fail,
            refuse_connections=fault_refuse_connections,
            jitter_ms=fault_jitter_ms,
        )
    except ValidationError as exc:  # one line naming the option, not pydantic's dump
        first = exc.errors(include_url=False)[0]
        raise fail(f"--fault-{str(first['loc'][0]).replace('_', '-')} {first['msg'].replace('Input should be', 'must be')}, got {first['input']!r}") from None
    counter = None
    if tokenizer != SIM_TOKENIZER:  # the default one is shared by every simulator in a process
        try:
            counter = TokenCounter.from_source(tokenizer)
        except TokenizerLoadError as exc:
            raise fail(f"--tokenizer: {exc}") from None
    try:
        server = SimServer(
            host=host, port=port, profile=profile, model=model, speed=speed, stream_interval=stream_interval,
            num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            max_waiting=max_waiting, queue_full_status=queue_full_status, legacy_metrics=legacy_metrics,
            load_shape=load_shape, faults=faults, seed=seed, tokenizer=counter,
            kv_events_endpoint=kv_events_endpoint, kv_events_replay=kv_events_replay_endpoint,
            role=role, kv_link_gbytes_per_s=kv_link_gbytes_per_s, kv_hold_timeout_s=kv_hold_timeout_s,
            lora_modules=[n.strip() for n in lora_modules.split(",") if n.strip()], max_loras=max_loras,
            max_cpu_loras=max_cpu_loras, lora_rank=lora_rank, lora_load_scale=lora_load_scale, lora_metrics=lora_metrics,
        )
    except SimOptionError as exc:
        option = _OPTION_OF.get(exc.option, exc.option.replace("_", "-"))
        problem = exc.problem.replace("needs kv_events_endpoint", "needs --kv-events-endpoint or --kv-events-port")
        raise fail(f"--{option} {problem.replace('which num_gpu_blocks', 'which --num-gpu-blocks')}") from None

    async def main() -> None:
        stop = stop_on_signals()
        import zmq

        try:
            await server.start()
        except OSError as exc:
            raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}", 1) from None
        except zmq.ZMQError as exc:
            raise fail(f"cannot publish KV events on {kv_events_endpoint}: {exc}", 1) from None
        pub = server.kv_events
        events = f" kv_events={pub.endpoint}" if pub is not None else ""
        if pub is not None and pub.replay_endpoint:
            events += f" kv_replay={pub.replay_endpoint}"
        role_note = f" role={server.role}" if server.role != "both" else ""
        typer.echo(f"sim listening on {server.url} profile={server.profile.name} model={server.model}{events}{role_note}")
        try:
            await stop.wait()
        finally:
            await server.aclose()

    asyncio.run(main())
    skip_final_collection()
