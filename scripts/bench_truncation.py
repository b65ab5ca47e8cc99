#!/usr/bin/env python3
"""What head + tail truncation adds to a decision: ~64k-token requests cut to the default
model's 40,960-token context, through the real request pipeline (`RequestPipeline.route`,
the real Qwen3 tokenizer and chat template, the tokenizer threads the server uses), in process.

Shapes (each iteration's text is new, so the token cache never holds a cut text already):

  chat-turns    a system prompt and ~100 user/assistant turns of ~640 tokens: the oldest turns
                are dropped whole (only template renders; every segment is cached)
  agent-tools   a task, then ~150 tool calls with their results, tools declared: the oldest
                call + result pairs go
  chat-one-msg  a system prompt and one ~64k-token user message: cut inside (head + tail),
                the kept ~39k tokens tokenized again to count them exactly
  completion    a ~64k-token text prompt: head + tail token ids decoded, then counted again
  token-ids     a 64k token-id prompt: list slicing

For each, side by side in one run on the same request: with truncation off, the decision
refused with the 400 after counting — once cold (the prompt new to the token cache) and once
warm (its segments cached, as for a chat that resends its history); then with truncation on
(warm: only a cut text is new): the whole decision (p50) and the pipeline's own `truncate`
phase (p50 / p95). Added latency = on − off (warm).

    .venv/bin/python scripts/bench_truncation.py [--iterations 15] [--markdown]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from extproc.config.loader import config_from_mapping
from extproc.datastore.endpoints import Datastore
from extproc.errors import ContextLengthError
from extproc.metrics import Metrics
from extproc.pipeline.request import ModelRuntime, RequestPipeline
from extproc.pipeline.tokens import TokenCounter
from extproc.server.app import TOKENIZE_THREADS
from extproc.types import RequestKind

MODEL = "Qwen/Qwen3-8B"
CONTEXT = 40960
VOCAB = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they you "
    "were her she there been one all we their has would when if so what more can who about out up into only other time "
    "cluster engine token cache latency request endpoint model prompt gateway scheduler memory batch decode prefill "
    "kubernetes network storage server client routing policy tenant budget window queue metric signal harbour boat"
).split()


def prose(words: int, rng: random.Random) -> str:
    out = []
    for i in range(words):
        w = rng.choice(VOCAB)
        out.append(w.capitalize() + "." if i % 17 == 16 else w)
    return " ".join(out)


def chat_turns(rng: random.Random) -> tuple[RequestKind, dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant. " + prose(80, rng)}]
    for t in range(52):
        msgs.append({"role": "user", "content": f"Question {t}: " + prose(560, rng)})
        msgs.append({"role": "assistant", "content": f"Answer {t}: " + prose(560, rng)})
    msgs.append({"role": "user", "content": "Summarise the discussion so far."})
    return RequestKind.CHAT, {"model": MODEL, "messages": msgs, "max_tokens": 512}


def agent_tools(rng: random.Random) -> tuple[RequestKind, dict[str, Any]]:
    tools = [
        {"type": "function", "function": {"name": "search", "description": "Search the index.",
         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
    ]  # fmt: skip
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. Use tools."},
        {"role": "user", "content": "Investigate the outage. " + prose(200, rng)},
    ]
    for c in range(150):
        arguments = orjson.dumps({"q": prose(6, rng)}).decode()
        call = {"id": f"call_{c}", "type": "function", "function": {"name": "search", "arguments": arguments}}
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{c}", "content": prose(360, rng)})
    return RequestKind.CHAT, {"model": MODEL, "messages": msgs, "tools": tools, "max_tokens": 512}


def chat_one_msg(rng: random.Random) -> tuple[RequestKind, dict[str, Any]]:
    msgs = [{"role": "system", "content": "Summarise the document."}, {"role": "user", "content": prose(59_000, rng)}]
    return RequestKind.CHAT, {"model": MODEL, "messages": msgs, "max_tokens": 512}


def completion(rng: random.Random) -> tuple[RequestKind, dict[str, Any]]:
    return RequestKind.COMPLETION, {"model": MODEL, "prompt": prose(59_000, rng), "max_tokens": 512}


def token_ids(rng: random.Random) -> tuple[RequestKind, dict[str, Any]]:
    ids = [rng.randrange(100, 150_000) for _ in range(64_000)]
    return RequestKind.COMPLETION, {"model": MODEL, "prompt": ids, "max_tokens": 512}


SHAPES = {
    "chat-turns": chat_turns,
    "agent-tools": agent_tools,
    "chat-one-msg": chat_one_msg,
    "completion": completion,
    "token-ids": token_ids,
}


def pipeline(counter: TokenCounter, mode: str) -> tuple[RequestPipeline, Metrics]:
    cfg = config_from_mapping(
        {
            "limits": {"max_body_bytes": 8 * 1024 * 1024, "grpc_max_message_bytes": 9 * 1024 * 1024, "max_json_values": 100_000},
            "models": [{"name": MODEL, "max_model_len": CONTEXT, "truncation": {"mode": mode}}],
            "endpoints": [{"address": "127.0.0.1:18001", "models": [MODEL]}, {"address": "127.0.0.1:18002", "models": [MODEL]}],
            "scheduling": {"health_check": {"enabled": False}},
        }
    )
    metrics = Metrics(CollectorRegistry())
    runtime = ModelRuntime(cfg.models[0], counter)
    return RequestPipeline(cfg, Datastore(cfg.endpoints), {MODEL: runtime}, metrics, tokenize_threads=TOKENIZE_THREADS), metrics


async def refusal(pipe: RequestPipeline, kind: RequestKind, body: bytes, name: str) -> float:
    """Seconds to the context-length refusal (truncation off)."""
    t0 = time.perf_counter()
    try:
        await pipe.route(kind, body)
    except ContextLengthError:
        return time.perf_counter() - t0
    raise SystemExit(f"{name}: expected a context-length refusal with truncation off")


async def run(iterations: int) -> list[dict[str, Any]]:
    counter = TokenCounter.from_source("builtin:qwen3")
    on, _ = pipeline(counter, "head-tail")
    off, _ = pipeline(counter, "off")
    rows = []
    for name, make in SHAPES.items():
        cut_ms, total_ms, refuse_ms, cold_ms, before, after = [], [], [], [], [], []
        for i in range(iterations + 1):
            kind, request = make(random.Random(f"{name}-{i}"))
            body = orjson.dumps(request)
            cold = await refusal(off, kind, body, name)  # fills the token cache with the prompt
            refused = await refusal(off, kind, body, name)
            t0 = time.perf_counter()
            routed = await on.route(kind, body)
            total = time.perf_counter() - t0
            if i == 0:
                continue  # warm-up: imports, template compilation
            assert routed.truncation is not None
            cut_ms.append(routed.timings_s["truncate"] * 1000)
            total_ms.append(total * 1000)
            refuse_ms.append(refused * 1000)
            cold_ms.append(cold * 1000)
            before.append(routed.truncation.tokens_before)
            after.append(routed.request.prompt_tokens)
        rows.append(
            {
                "shape": name,
                "tokens_before": int(statistics.median(before)),
                "tokens_after": int(statistics.median(after)),
                "truncate_p50_ms": statistics.median(cut_ms),
                "truncate_p95_ms": sorted(cut_ms)[math.ceil(len(cut_ms) * 0.95) - 1],
                "off_cold_p50_ms": statistics.median(cold_ms),
                "off_warm_p50_ms": statistics.median(refuse_ms),
                "on_p50_ms": statistics.median(total_ms),
            }
        )
    on.close()
    off.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()
    rows = asyncio.run(run(args.iterations))
    cols = ["shape", "tokens_before", "tokens_after", "off_cold_p50_ms", "off_warm_p50_ms", "on_p50_ms"]
    cols += ["truncate_p50_ms", "truncate_p95_ms"]
    if args.markdown:
        print("| " + " | ".join(cols) + " | added (on − off warm) |")
        print("|" + "---|" * (len(cols) + 1))
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r[c], float) else f"{r[c]:,}" if isinstance(r[c], int) else r[c] for c in cols]
        ratio = f"{r['on_p50_ms'] - r['off_warm_p50_ms']:.1f}"
        print(("| " + " | ".join(cells) + f" | {ratio} |") if args.markdown else "  ".join(cells) + f"  {ratio}")


if __name__ == "__main__":
    main()
