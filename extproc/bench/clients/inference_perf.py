"""inference-perf (the Kubernetes serving working group's benchmark client, PyPI `inference-perf`,
pinned 0.7.0; llm-d and the inference extension report with it) against a running stack.

The same requests as our load generator's, written as an Azure LLM inference trace (CSV:
`TIMESTAMP` as a date with 7 decimals, `ContextTokens`, `GeneratedTokens`) and replayed by its
`trace_replay` load type with the `random` data type, which draws each prompt as random token
ids of the trace's length (so no prefix is shared: use it on prefix-free workloads such as Azure,
not on Mooncake). It sends completions (`/v1/completions`, streaming): its `random` data type
has no chat form in 0.7.0. The tokenizer is the built-in Qwen3 one by local path.

What differs from our client, by construction:
  - prompt text: random token ids (often not round-tripping through the tokenizer to the same
    count), ours synthesized text; completions, not chat (no chat template around the prompt);
  - `time_per_output_token` is per request, (E2E − TTFT) / (output tokens − 1) as ours;
    `inter_token_latency` is per token: with 8 tokens per streamed chunk (the bench's
    `--stream-interval`) seven of every eight gaps are 0, so its p50 ITL reads 0.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from extproc.bench.clients import ClientError, offsets, run_client
from extproc.bench.traces import TraceRequest

__all__ = ["config", "parse_report", "run_inference_perf", "write_trace"]

INFERENCE_PERF_VERSION = "0.7.0"
_EPOCH = dt.datetime(2023, 11, 16, 18, 0, 0)


def write_trace(requests: Sequence[TraceRequest], path: Path, *, stretch: float = 1.0) -> int:
    """Write `requests` as an Azure-2023-format CSV trace (arrival times kept, from a fixed epoch).

    `stretch` multiplies every gap (`clients.offsets`).

    Returns:
        how many rows were written.

    Raises:
        ValueError: no request.
    """
    rows = offsets(requests, stretch)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for at, r in rows:
        stamp = _EPOCH + dt.timedelta(seconds=at)
        lines.append(f"{stamp.strftime('%Y-%m-%d %H:%M:%S.%f')}0,{r.input_tokens},{r.output_tokens}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(rows)


def config(base_url: str, model: str, trace: Path, tokenizer_dir: Path, out_dir: Path, *, duration_s: int) -> dict[str, Any]:
    """inference-perf's `--config_file` document: replay `trace` once against `base_url`.

    `duration_s` bounds the stage (the trace's span plus its drain, seconds).
    """
    return {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir)},
        "data": {"type": "random", "trace": {"file": str(trace), "format": "AzurePublicDataset"}},
        "load": {
            "type": "trace_replay", "trace": {"file": str(trace), "format": "AzurePublicDataset"},
            "num_workers": 1, "stages": [{"rate": 1, "duration": duration_s}],
        },
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": False}},
        "storage": {"local_storage": {"path": str(out_dir)}},
    }  # fmt: skip


def run_inference_perf(executable: Path, cfg: dict[str, Any], workdir: Path, *, timeout_s: float) -> Path:
    """Run `inference-perf --config_file` with `cfg` (see `config`); returns its summary's path.

    Raises:
        ClientError: a non-zero exit, a time-out, or no summary written.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "inference-perf.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    report = Path(cfg["storage"]["local_storage"]["path"]) / "summary_lifecycle_metrics.json"
    return run_client([str(executable), "--config_file", str(path)], workdir=workdir, report=report, timeout_s=timeout_s)


def _ms(node: dict[str, Any], key: str) -> float | None:
    value = node.get(key)
    return float(value) * 1000 if isinstance(value, (int, float)) else None


def parse_report(path: Path) -> dict[str, Any]:
    """The figures the page puts beside ours, from `summary_lifecycle_metrics.json`.

    Keys as `guidellm.parse_report`'s: ok, errored, ttft_p50_ms, ttft_p99_ms, tpot_p50_ms,
    tpot_p99_ms (its per-request `time_per_output_token`), itl_p50_ms (per token),
    output_tokens_per_s, rps, duration_s.

    Raises:
        ClientError: not an inference-perf summary.
    """
    import json

    doc = json.loads(path.read_text(encoding="utf-8"))
    ok = doc.get("successes") if isinstance(doc, dict) else None
    if not isinstance(ok, dict) or "latency" not in ok:
        raise ClientError(f"{path}: not an inference-perf lifecycle summary")
    lat = ok["latency"]
    ttft, tpot, itl = (lat.get(k) or {} for k in ("time_to_first_token", "time_per_output_token", "inter_token_latency"))
    thr = ok.get("throughput") or {}
    return {
        "ok": ok.get("count"),
        "errored": (doc.get("failures") or {}).get("count"),
        "ttft_p50_ms": _ms(ttft, "median"),
        "ttft_p99_ms": _ms(ttft, "p99"),
        "tpot_p50_ms": _ms(tpot, "median"),
        "tpot_p99_ms": _ms(tpot, "p99"),
        "itl_p50_ms": _ms(itl, "median"),
        "output_tokens_per_s": thr.get("output_tokens_per_sec"),
        "rps": thr.get("requests_per_sec"),
        "duration_s": doc.get("benchmark_time_seconds"),
    }
