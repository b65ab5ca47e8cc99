"""What a new user trips over (issue 19), through a real Envoy onto a simulated vLLM: the Envoy
bootstrap comes from `llm-extproc envoy-config` (validated by `envoy --mode validate`, then
serving every test here); chat content parts and `n` choices; the Responses API counted and
routed, streamed and not; an engine's 4xx in the gateway's error shape; `x-request-id` on every
response; `x-llm-fallback` when llm-extproc is down."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack.envoy import EnvoyProcess, load_envoy_config, validate_config_file
from extproc.stack.fleet import SimProcess
from extproc.stack.ports import free_port, free_ports
from extproc.stack.server import ExtProcServerProcess
from tests.e2e.e2e_helpers import assert_openai_error, start_beside

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

MODEL = "Qwen/Qwen3-8B"


def envoy_config(workdir: Path, config: Path, name: str, extproc: str) -> dict:
    """`llm-extproc envoy-config` as a user runs it, checked by the real `envoy --mode validate`."""
    out = workdir / f"{name}.yaml"
    argv = [sys.executable, "-m", "extproc", "envoy-config", "--config", str(config), "--output", str(out),
            "--listen", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{free_port()}", "--extproc", extproc]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    validate_config_file(out)
    return load_envoy_config(out)


class Stack:
    def __init__(self, envoy: EnvoyProcess, fallback: EnvoyProcess, server: ExtProcServerProcess, sim: SimProcess) -> None:
        self.envoy, self.fallback, self.server, self.sim = envoy, fallback, server, sim


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory) -> AsyncIterator[Stack]:
    workdir = tmp_path_factory.mktemp("first_contact")
    (port,) = free_ports(1)
    sim = SimProcess("h100-qwen3-8b", name="sim-0", workdir=workdir, speed=20, stream_interval=2, port=port)
    config = workdir / "llm-extproc.yaml"
    config.write_text(yaml.safe_dump({
        "models": [{"name": MODEL, "aliases": ["my-alias"]}],
        "endpoints": [{"address": f"127.0.0.1:{port}", "models": [MODEL]}],
        "scheduling": {"health_check": {"timeout_s": 2.0, "unhealthy_threshold": 3}},
        "telemetry": {"sample_rate": 1.0},
    }))  # fmt: skip
    server = ExtProcServerProcess(config, workdir=workdir)
    started: list = [sim]
    try:
        await start_beside(server, [sim])
        started.append(server)
        envoy = EnvoyProcess(envoy_config(workdir, config, "envoy", f"127.0.0.1:{server.grpc_port}"), workdir=workdir)
        await envoy.start()
        started.append(envoy)
        # The same fleet, with llm-extproc unreachable: Envoy fails open to its fallback cluster.
        dead = envoy_config(workdir, config, "envoy-dead-extproc", f"127.0.0.1:{free_port()}")
        fallback = EnvoyProcess(dead, workdir=workdir, name="envoy-fallback")
        await fallback.start()
        started.append(fallback)
        yield Stack(envoy, fallback, server, sim)
    finally:
        for proc in reversed(started):
            await proc.aclose()


async def prompt_tokens_seen(stack: Stack) -> tuple[float, float]:
    """(sum, count) of llm-extproc's prompt-token histogram: what it counted for its decisions."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        text = (await c.get(f"{stack.server.admin_url}/metrics")).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("llm_extproc_prompt_tokens")}
    return values["llm_extproc_prompt_tokens_sum"], values["llm_extproc_prompt_tokens_count"]


async def post_counted(stack: Stack, path: str, body: dict) -> tuple[httpx.Response, float]:
    """POST through the gateway; the response and the prompt tokens llm-extproc counted for it."""
    before, n0 = await prompt_tokens_seen(stack)
    async with httpx.AsyncClient(base_url=stack.envoy.url, trust_env=False, timeout=60) as c:
        r = await c.post(path, json=body)
    after, n1 = await prompt_tokens_seen(stack)
    assert n1 == n0 + 1, r.text
    return r, after - before


async def test_chat_content_parts_are_served_and_counted_as_the_engine_prefills(stack):
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 3}
    r, counted = await post_counted(stack, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == counted


async def test_n_choices_are_served(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "n": 2, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=stack.envoy.url, trust_env=False, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1] and r.json()["usage"]["completion_tokens"] == 8


RESPONSES = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 5, "ignore_eos": True,
             "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]}]}  # fmt: skip


async def test_responses_api_json_is_counted_and_routed(stack):
    r, counted = await post_counted(stack, "/v1/responses", RESPONSES)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "response" and out["usage"]["input_tokens"] == counted and out["usage"]["output_tokens"] == 5
    assert r.headers["x-llm-endpoint"] == stack.sim.address


def _output_tokens_observed(text: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "gen_ai_client_token_usage_sum" and s.labels.get("gen_ai_token_type") == "output")  # fmt: skip


async def test_responses_api_stream_is_counted_and_its_usage_read(stack):
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        before = _output_tokens_observed((await c.get(f"{stack.server.admin_url}/metrics")).text)
    r, counted = await post_counted(stack, "/v1/responses", {**RESPONSES, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [orjson.loads(line[len("data: "):]) for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["usage"]["input_tokens"] == counted
    async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
        for _ in range(50):  # the observer records when the ext_proc stream ends, just after the client's
            after = _output_tokens_observed((await c.get(f"{stack.server.admin_url}/metrics")).text)
            if after > before:
                break
            await asyncio.sleep(0.1)
    assert after - before == 5  # usage read from the `response.completed` event


async def test_engine_4xx_reaches_the_client_in_the_gateway_shape(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "min_tokens": 5}
    async with httpx.AsyncClient(base_url=stack.envoy.url, trust_env=False, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body)
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error" and "min_tokens" in err["message"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_bodiless_engine_error_reaches_the_client_in_the_gateway_shape(stack, stream):
    # A bare 500 (no body: a proxy in front of the engine, a crashed handler) passed through as
    # an empty answer; the client now reads the same JSON error as from any other refusal.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": stream}
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        faults = f"http://{stack.sim.address}/sim/faults"
        assert (await c.post(faults, json={"error_rate": 1.0, "error_body": False})).status_code == 200
        try:
            r = await c.post(f"{stack.envoy.url}/v1/chat/completions", json=body)
        finally:
            assert (await c.delete(faults)).status_code == 200
    err = assert_openai_error(r, 500)
    assert err["message"] == "HTTP 500 from the engine" and r.headers["x-request-id"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, 200),
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
        ("GET", "/v1/models", None, 200),
    ],
    ids=["success", "refusal", "passthrough"],
)
async def test_every_response_carries_a_request_id(stack, method, path, body, status):
    async with httpx.AsyncClient(base_url=stack.envoy.url, trust_env=False, timeout=60) as c:
        r = await c.request(method, path, json=body)
        assert r.status_code == status and len(r.headers["x-request-id"]) >= 16
        mine = await c.request(method, path, json=body, headers={"x-request-id": "trace-me-42"})
        assert mine.headers["x-request-id"] == "trace-me-42"
    assert "x-llm-fallback" not in r.headers


async def test_the_model_list_through_envoy_names_the_aliases(stack):
    """The engine lists the name it serves; through the gateway the configured alias is listed
    too, OpenAI-shaped, rooted at that model (fail-open, without llm-extproc, only the engine's)."""
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        r = await c.get(f"{stack.envoy.url}/v1/models")
        alone = await c.get(f"{stack.fallback.url}/v1/models")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    listed = {e["id"]: e for e in r.json()["data"]}
    assert set(listed) == {MODEL, "my-alias"}
    assert listed["my-alias"]["object"] == "model" and listed["my-alias"]["root"] == MODEL
    assert [e["id"] for e in alone.json()["data"]] == [MODEL]


async def test_fallback_answers_say_so(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=stack.fallback.url, trust_env=False, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-llm-fallback"] == "1"
    assert r.headers["x-llm-endpoint"] == stack.sim.address


TOOL_CHAT = [
    {"role": "user", "content": "What is 3+3?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "6"}]},
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": ["Once upon", "a time there"], "max_tokens": 2}),
        ("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2, "n": 2}),
        ("/v1/chat/completions", {"messages": TOOL_CHAT, "max_completion_tokens": 2}),
    ],
    ids=["batch-strings", "batch-token-ids", "n-2-completion", "tool-call-history"],
)
async def test_other_accepted_shapes_are_served_and_counted_as_the_engine_prefills(stack, path, body):
    """Every shape llm-extproc's parser accepts, the simulator (as vLLM) serves, and the count
    llm-extproc decided on is what the engine reports as prefilled."""
    r, counted = await post_counted(stack, path, {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == counted
