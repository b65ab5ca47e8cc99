"""The simulator over HTTP: vLLM's shapes (bodies, SSE, errors, metrics) and peer-router endpoints."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.pipeline.tokens import TokenCounter

CHAT = [{"role": "user", "content": "Tell me about load balancing."}]
ERROR_KEYS = {"object", "message", "type", "param", "code"}


def sse_json(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, checking vLLM's framing: every event is
    `data: <payload>\\n\\n` and the last one is `data: [DONE]`."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    events = raw[:-2].split(b"\n\n")
    assert all(ev.startswith(b"data: ") for ev in events)
    assert events[-1] == b"data: [DONE]"
    return [orjson.loads(ev[len(b"data: ") :]) for ev in events[:-1]]


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, bytes, aiohttp.ClientResponse]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.post(url, data=data, headers={"content-type": "application/json"}) as resp:
        return resp.status, await resp.read(), resp


async def test_chat_non_streaming_body_and_usage(start_sim, http) -> None:
    sim = await start_sim()
    body = {"model": sim.model, "messages": CHAT, "max_tokens": 7, "ignore_eos": True}
    status, raw, resp = await post(http, f"{sim.url}/v1/chat/completions", body)
    assert status == 200 and resp.headers["x-sim-speed"] == "20.0"
    body = orjson.loads(raw)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["message"]["content"].split()) == 7  # one filler word per token
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["prompt_tokens"] == sim._tokenizer.count_chat(CHAT).count
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7


@pytest.mark.parametrize("interval", [1, 4], ids=["interval-1", "interval-4"])
async def test_chat_stream_framing_and_usage_chunk(start_sim, http, interval: int) -> None:
    sim = await start_sim(stream_interval=interval)
    body = {"messages": CHAT, "max_tokens": 10, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    status, raw, resp = await post(http, f"{sim.url}/v1/chat/completions", body)
    assert status == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_json(raw)
    first, *content, usage = events
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == first["id"] for e in events)
    # like vLLM's --stream-interval: the first token at once, then the rest grouped by the interval
    assert len(content) == 1 + -(-9 // interval)
    assert len(content[0]["choices"][0]["delta"]["content"].split()) == 1
    text = "".join(e["choices"][0]["delta"]["content"] for e in content)
    assert len(text.split()) == 10
    assert [e["choices"][0]["finish_reason"] for e in content] == [None] * (len(content) - 1) + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10


async def test_completion_stream_without_usage(start_sim, http) -> None:
    sim = await start_sim()
    body = {"prompt": "Once upon a time", "max_tokens": 3, "min_tokens": 3, "stream": True}
    status, raw, _ = await post(http, f"{sim.url}/v1/completions", body)
    events = sse_json(raw)
    assert status == 200 and len(events) == 3
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_completion_with_token_ids_prompt(start_sim, http) -> None:
    sim = await start_sim()
    body = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "ignore_eos": True}
    status, raw, _ = await post(http, f"{sim.url}/v1/completions", body)
    body = orjson.loads(raw)
    assert status == 200 and body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 2


async def test_output_length_without_eos_control_is_drawn_under_max_tokens(start_sim, http) -> None:
    sim = await start_sim(speed=200.0)
    lengths = []
    for seed in range(12):
        _, raw, _ = await post(http, f"{sim.url}/v1/completions", {"prompt": "hi", "max_tokens": 300, "seed": seed})
        body = orjson.loads(raw)
        n = body["usage"]["completion_tokens"]
        assert 1 <= n <= 300
        assert body["choices"][0]["finish_reason"] == ("length" if n == 300 else "stop")
        lengths.append(n)
    assert len(set(lengths)) > 5  # a distribution, not a constant


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/chat/completions", b"{not json", 400, "Invalid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", {"model": "nope", "messages": CHAT}, 404, "The model `nope` does not exist."),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "'image_url'"),
        ("/v1/responses", {"input": []}, 400, "input"),
        ("/v1/responses", {"input": [{"type": "reasoning"}]}, 400, "unsupported input item"),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4096}, 400,
         "This model's maximum context length is 4096 tokens. However, you requested 4097 tokens "
         "(1 in the messages, 4096 in the completion)."),
        ("/v1/completions", {"prompt": [7] * 5000}, 400, "However, your request has 5000 input tokens"),
    ],
    ids=[
        "invalid-json", "not-object", "unknown-model", "no-messages", "image-part", "responses-empty",
        "responses-reasoning-item", "max-tokens-0", "context-length",
        "prompt-too-long",
    ],
)
async def test_errors_have_vllm_shape(start_sim, http, path: str, body: Any, status: int, needle: str) -> None:
    sim = await start_sim(max_model_len=4096)
    got, raw, _ = await post(http, sim.url + path, body)
    err = orjson.loads(raw)
    assert got == status and set(err) == ERROR_KEYS
    assert err["object"] == "error" and err["code"] == status and needle in err["message"]


async def test_models_health_version(start_sim, http) -> None:
    sim = await start_sim(model="my-model")
    async with http.get(f"{sim.url}/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["my-model"]
    assert models["data"][0]["max_model_len"] == sim.config.max_model_len
    async with http.get(f"{sim.url}/health") as resp:
        assert resp.status == 200 and resp.headers["x-sim-speed"] == "20.0"
    async with http.get(f"{sim.url}/version") as resp:
        assert "version" in await resp.json()


async def test_tokenize_and_detokenize(start_sim, http, qwen_counter: TokenCounter) -> None:
    sim = await start_sim()
    _, raw, _ = await post(http, f"{sim.url}/tokenize", {"model": sim.model, "prompt": "Hello world"})
    tok = orjson.loads(raw)
    assert tok["tokens"] == qwen_counter.count_text("Hello world").token_ids
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == sim.config.max_model_len
    _, raw, _ = await post(http, f"{sim.url}/tokenize", {"messages": CHAT})
    assert orjson.loads(raw)["count"] == qwen_counter.count_chat(CHAT).count
    _, raw, _ = await post(http, f"{sim.url}/detokenize", {"tokens": tok["tokens"]})
    assert orjson.loads(raw)["prompt"] == "Hello world"
    status, raw, _ = await post(http, f"{sim.url}/tokenize", {"nothing": 1})
    assert status == 400 and set(orjson.loads(raw)) == ERROR_KEYS


@pytest.mark.parametrize("shape", ["sglang", "vllm-router"])
async def test_get_load_shapes(start_sim, http, shape: str) -> None:
    sim = await start_sim(load_shape=shape)
    async with http.get(f"{sim.url}/get_load") as resp:
        load = await resp.json()
    if shape == "sglang":  # sglang-router sums num_tokens over this list
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    else:  # vllm-router reads an integer `load`
        assert load == {"load": 0}


async def test_worker_info_endpoints(start_sim, http) -> None:
    sim = await start_sim(profile="h100-llama-3.1-70b-tp4")
    for path in ("/server_info", "/get_server_info"):
        async with http.get(sim.url + path) as resp:
            info = await resp.json()
        # fields sglang-router's worker registration deserializes
        assert info["model_path"] == "meta-llama/Llama-3.1-70B-Instruct" and info["dp_size"] == 1
        assert info["max_total_num_tokens"] == sim.config.num_gpu_blocks * 16 and info["tp_size"] == 4
    for path in ("/model_info", "/get_model_info"):
        async with http.get(sim.url + path) as resp:
            info = await resp.json()
        assert info["is_generation"] is True and info["architectures"] == ["LlamaForCausalLM"]
        assert info["model_path"] == sim.model


def parse_metrics(text: str) -> dict[str, Any]:
    """{family name: family} from Prometheus text."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], family: str, sample_name: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(sample_name)


async def test_metrics_names_types_and_agreement_with_engine(start_sim, http) -> None:
    sim = await start_sim(speed=50.0)
    for i in range(3):
        body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 5, "ignore_eos": True}
        await post(http, f"{sim.url}/v1/chat/completions", body)
    async with http.get(f"{sim.url}/metrics") as resp:
        fam = parse_metrics(await resp.text())
    types = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    for name, kind in types.items():
        assert fam[name].type == kind, name
    m = {"model_name": sim.model}
    async with http.get(f"{sim.url}/sim/state") as resp:
        state = await resp.json()
    assert sample(fam, "vllm:generation_tokens", "vllm:generation_tokens_total", **m) == state["generation_tokens"] == 15
    assert sample(fam, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **m) == state["prompt_tokens"]
    assert sample(fam, "vllm:request_success", "vllm:request_success_total", finished_reason="length", **m) == 3
    assert sample(fam, "vllm:num_requests_running", "vllm:num_requests_running", **m) == state["running"] == 0
    assert sample(fam, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", **m) == state["kv_cache_usage"]
    info = fam["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == str(sim.config.num_gpu_blocks)
    assert sample(fam, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count", **m) == 3
    assert sample(fam, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count", **m) == 3 * 4


async def test_legacy_metric_names(start_sim, http) -> None:
    sim = await start_sim(legacy_metrics=True)
    async with http.get(f"{sim.url}/metrics") as resp:
        fam = parse_metrics(await resp.text())
    assert "vllm:gpu_cache_usage_perc" in fam and "vllm:kv_cache_usage_perc" not in fam
    assert "vllm:time_per_output_token_seconds" in fam and "vllm:inter_token_latency_seconds" not in fam


@pytest.mark.parametrize("status", [429, 503])
async def test_full_waiting_queue_is_refused(start_sim, http, status: int) -> None:
    sim = await start_sim(max_waiting=0, queue_full_status=status)
    got, raw, _ = await post(http, f"{sim.url}/v1/completions", {"prompt": "hi", "max_tokens": 2})
    err = orjson.loads(raw)
    assert got == status and err["code"] == status and "overloaded" in err["message"]


async def test_gpu_view(start_sim, http) -> None:
    sim = await start_sim(profile="h100-qwen3-8b")
    async with http.get(f"{sim.url}/sim/gpu") as resp:
        idle = await resp.json()
    assert idle["memory_total_bytes"] == sim.profile.gpu.memory_bytes
    assert idle["memory_used_bytes"] >= sim.profile.weight_bytes() and idle["utilization"] == 0.0
    await post(http, f"{sim.url}/v1/completions", {"prompt": [5] * 3000, "max_tokens": 200, "ignore_eos": True})
    async with http.get(f"{sim.url}/sim/gpu") as resp:
        busy = await resp.json()
    assert 0.0 < busy["utilization"] <= 1.0  # busy in the last simulated second


async def test_client_disconnect_aborts_the_request(start_sim, http) -> None:
    sim = await start_sim(speed=2.0)
    body = {"prompt": [3] * 2000, "max_tokens": 4000, "ignore_eos": True}
    task = asyncio.create_task(post(http, f"{sim.url}/v1/completions", body))
    assert sim.engine is not None
    for _ in range(200):
        if sim.engine.running:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.pool.num_used > 0
    task.cancel()
    for _ in range(200):
        if sim.engine.stats.finished["abort"]:
            break
        await asyncio.sleep(0.01)
    assert sim.engine.stats.finished["abort"] == 1 and sim.engine.pool.num_used == 0


# -- what vLLM accepts, the simulator accepts (issue 19) ------------------------------------

PARTS = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]


async def test_chat_content_parts_are_joined_with_newlines_as_vllm_does(start_sim, http) -> None:
    """vLLM flattens text parts for string-content templates (Qwen3's): "\\n".join of the texts."""
    sim = await start_sim()
    status, raw, _ = await post(http, f"{sim.url}/v1/chat/completions", {"messages": PARTS, "max_tokens": 2})
    assert status == 200, raw
    flat = [{"role": "user", "content": "hi\nthere"}]
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == sim._tokenizer.count_chat(flat).count
    status, raw, _ = await post(http, f"{sim.url}/tokenize", {"messages": PARTS})
    assert status == 200 and orjson.loads(raw)["count"] == sim._tokenizer.count_chat(flat).count


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_n_choices_are_served(start_sim, http, stream: bool) -> None:
    sim = await start_sim(stream_interval=2)
    body = {"messages": CHAT, "max_tokens": 5, "ignore_eos": True, "n": 3, "stream": stream,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, raw, _ = await post(http, f"{sim.url}/v1/chat/completions", body)
    assert status == 200, raw
    prompt = sim._tokenizer.count_chat(CHAT).count
    if not stream:
        out = orjson.loads(raw)
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert all(len(c["message"]["content"].split()) == 5 and c["finish_reason"] == "length" for c in out["choices"])
        usage = out["usage"]
    else:
        *events, last = sse_json(raw)
        texts = {0: "", 1: "", 2: ""}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] += c["delta"].get("content", "")
        assert all(len(t.split()) == 5 for t in texts.values())
        finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"] == "length"]
        assert sorted(finishes) == [0, 1, 2]
        usage = last["usage"]
    assert usage["prompt_tokens"] == prompt and usage["completion_tokens"] == 15
    assert (await sim_state(http, sim))["running"] == 0


async def sim_state(http: aiohttp.ClientSession, sim: Any) -> dict[str, Any]:
    async with http.get(f"{sim.url}/sim/state") as resp:
        return await resp.json()


RESPONSES_INPUT = [
    {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
    {"role": "user", "content": "And 3+3?"},
]


async def test_responses_api_json(start_sim, http) -> None:
    sim = await start_sim()
    body = {"model": sim.model, "instructions": "Be brief.", "input": RESPONSES_INPUT, "max_output_tokens": 6, "ignore_eos": True}
    status, raw, _ = await post(http, f"{sim.url}/v1/responses", body)
    assert status == 200, raw
    out = orjson.loads(raw)
    assert out["object"] == "response" and out["id"].startswith("resp_") and out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"} and out["instructions"] == "Be brief."
    (msg,) = out["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"][0]["type"] == "output_text" and len(msg["content"][0]["text"].split()) == 6
    rendered = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]  # fmt: skip
    usage = out["usage"]
    assert usage["input_tokens"] == sim._tokenizer.count_chat(rendered).count
    assert usage["output_tokens"] == 6 and usage["total_tokens"] == usage["input_tokens"] + 6


async def test_responses_api_stream_events(start_sim, http) -> None:
    sim = await start_sim(stream_interval=3)
    body = {"input": "Tell me a story.", "max_output_tokens": 7, "ignore_eos": True, "stream": True, "seed": 3}
    status, raw, resp = await post(http, f"{sim.url}/v1/responses", body)
    assert status == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    events = []
    for block in raw[:-2].split(b"\n\n"):
        name_line, data_line = block.split(b"\n")
        assert name_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        payload = orjson.loads(data_line[len(b"data: "):])
        assert payload["type"] == name_line[len(b"event: "):].decode()
        events.append(payload)
    types = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert len(deltas) == 1 + 2 and [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in deltas)
    assert events[-4]["text"] == text and len(text.split()) == 7
    usage = events[-1]["response"]["usage"]
    assert usage["output_tokens"] == 7
    assert usage["input_tokens"] == sim._tokenizer.count_chat([{"role": "user", "content": "Tell me a story."}]).count


@pytest.mark.parametrize(
    "prompt",
    [["Once upon", "a time there"], [[1, 2, 3], [4, 5]]],
    ids=["strings", "token-id-lists"],
)
async def test_batched_completion_prompts_are_served(start_sim, http, prompt) -> None:
    """Every prompt shape llm-extproc's parser accepts, the simulator serves (as vLLM does):
    choice i * n + j is prompt i's j-th."""
    sim = await start_sim()
    body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "n": 2}
    status, raw, _ = await post(http, f"{sim.url}/v1/completions", body)
    assert status == 200, raw
    out = orjson.loads(raw)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    lens = [len(p) if isinstance(p, list) else sim._tokenizer.count_text(p).count for p in prompt]
    assert out["usage"]["prompt_tokens"] == sum(lens) and out["usage"]["completion_tokens"] == 12


async def test_unknown_paths_answer_json_as_vllm_does(start_sim, http) -> None:
    sim = await start_sim()
    async with http.get(f"{sim.url}/v1/nothing-here") as resp:
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
    async with http.get(f"{sim.url}/v1/chat/completions") as resp:
        assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}


async def test_responses_api_stops_before_the_budget_as_completed(start_sim, http) -> None:
    sim = await start_sim()
    body = {"input": "hi", "max_output_tokens": 1000, "min_tokens": 2}
    lengths = set()
    for seed in range(6):
        status, raw, _ = await post(http, f"{sim.url}/v1/responses", {**body, "seed": seed})
        out = orjson.loads(raw)
        n = out["usage"]["output_tokens"]
        assert status == 200 and 2 <= n <= 1000
        assert out["status"] == ("incomplete" if n == 1000 else "completed")
        lengths.add(n)
    assert len(lengths) > 1
