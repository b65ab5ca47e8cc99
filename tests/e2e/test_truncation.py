"""Truncation end to end: a client's over-long chat goes through a real Envoy, llm-extproc cuts
it (the client asked with `x-llm-truncate: head-tail`), and a simulated vLLM engine — which
counts the prompt it receives with the same real tokenizer — serves it; the client learns how
many tokens were cut. Without the header the client gets our 400, and the engine sees nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml

from extproc.pipeline.tokens import TokenCounter
from extproc.stack.envoy import EnvoyProcess, RunSettings, load_envoy_config, rewrite_config
from extproc.stack.fleet import SimProcess
from extproc.stack.ports import free_ports
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import assert_openai_error, start_beside

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"
CONTEXT = 8192
"""Our configured context (the simulator allows its profile's 40,960): small keeps the test fast."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[tuple[EnvoyProcess, SimProcess]]:
    workdir = tmp_path_factory.mktemp("truncation")
    (port,) = free_ports(1)
    sim = SimProcess("h100-qwen3-8b", name="sim", workdir=workdir, speed=20, seed=1, port=port)
    path = workdir / "llm-extproc.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {"name": MODEL, "max_model_len": CONTEXT, "truncation": {"mode": "on-request", "min_output_tokens": 256}}
                ],
                "endpoints": [{"address": f"127.0.0.1:{port}", "models": [MODEL]}],
                "scheduling": {"health_check": {"timeout_s": 2.0, "unhealthy_threshold": 3}},
            }
        )
    )
    server = ExtProcServerProcess(path, workdir=workdir)
    try:
        await start_beside(server, [sim])
        settings = RunSettings(extproc=server.grpc_address, endpoints=[("127.0.0.1", sim.port)])
        cfg = rewrite_config(load_envoy_config("fail-open"), settings)
        envoy = EnvoyProcess(cfg, workdir=workdir)
        await envoy.start()
        try:
            yield envoy, sim
        finally:
            await envoy.aclose()
    finally:
        await server.aclose()
        await sim.aclose()


def long_chat() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You answer in one word."}]
    for t in range(40):
        msgs.append({"role": "user", "content": f"Turn {t}. " + "Describe the harbour at dawn, the boats and the gulls. " * 25})
        msgs.append({"role": "assistant", "content": f"Reply {t}. " + "Quiet water, grey light, gulls over the nets. " * 25})
    msgs.append({"role": "user", "content": "Which turn was the first you still remember?"})
    return msgs


async def test_truncated_chat_reaches_the_engine_and_the_client_learns_the_cut(stack, qwen_counter: TokenCounter):
    envoy, _ = stack
    msgs = long_chat()
    before = qwen_counter.count_chat(msgs).count
    assert before > CONTEXT
    body = {"model": MODEL, "messages": msgs, "max_tokens": 8, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=envoy.url, trust_env=False, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body, headers={"x-llm-truncate": "head-tail"})
        assert r.status_code == 200, r.text
        dropped = int(r.headers["x-llm-truncated-tokens"])
        # The engine counted what it received with the same tokenizer: our cut body, to the token.
        prompt = r.json()["usage"]["prompt_tokens"]
        assert prompt == before - dropped and prompt + 8 <= CONTEXT
        assert prompt > CONTEXT - 8 - 1200  # only whole turns of ~600 tokens went


async def test_without_the_header_the_client_gets_the_400_and_the_engine_nothing(stack, qwen_counter: TokenCounter):
    envoy, sim = stack
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        served = await _served(c, sim)
        r = await c.post(f"{envoy.url}/v1/chat/completions", json={"model": MODEL, "messages": long_chat(), "max_tokens": 8})
        error = assert_openai_error(r, 400)
        assert error["code"] == "context_length_exceeded" and "x-llm-truncated-tokens" not in r.headers
        assert f"maximum context length is {CONTEXT} tokens" in error["message"]
        assert await _served(c, sim) == served


async def _served(c: httpx.AsyncClient, sim: SimProcess) -> float:
    """Requests the simulator has received (its vLLM-style counter)."""
    text = (await c.get(f"{sim.url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total"))
