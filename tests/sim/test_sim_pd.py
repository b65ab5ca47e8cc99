"""The simulator's P/D roles (extproc.sim.pd): a prefill engine holds a finished prompt's blocks
until a decode engine pulls them or a timeout frees them; a decode engine pulls, is charged the
transfer time, and fails the request when the blocks are gone (kv_load_failure_policy=fail)."""

from __future__ import annotations

import asyncio

import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.sim.test_sim_http import post

PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip
PROMPT = [{"role": "user", "content": " ".join(f"token{i}" for i in range(1500))}]


async def state(http, sim) -> dict:
    async with http.get(f"{sim.url}/sim/state") as resp:
        return await resp.json()


async def metric(http, sim, name: str) -> float:
    async with http.get(f"{sim.url}/metrics") as resp:
        text = await resp.text()
    values = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]
    assert values, f"{name} not exported"
    return sum(values)  # over every label set


async def prefill(http, sim) -> dict:
    body = {"messages": PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    status, raw, _ = await post(http, f"{sim.url}/v1/chat/completions", body)
    assert status == 200, raw
    return orjson.loads(raw)


async def test_prefill_holds_blocks_until_the_decode_side_pulls_them(start_sim, http):
    p = await start_sim(role="prefill")
    d = await start_sim(role="decode", kv_link_gbytes_per_s=1.0)
    answer = await prefill(http, p)
    kv = answer["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_host"] == p.host and kv["remote_port"] == p.port
    prompt_tokens = answer["usage"]["prompt_tokens"]
    held = await state(http, p)
    assert held["kv_holds"] == 1 and held["kv_held_blocks"] == len(kv["remote_block_ids"]) == -(-prompt_tokens // 16)
    assert held["num_free_blocks"] == p.config.num_gpu_blocks - held["kv_held_blocks"]

    body = {"messages": PROMPT, "max_tokens": 5, "ignore_eos": True, "kv_transfer_params": kv}
    status, raw, _ = await post(http, f"{d.url}/v1/chat/completions", body)
    assert status == 200, raw
    usage = orjson.loads(raw)["usage"]
    # vLLM counts the pulled prompt as cached on the decode side (the sidecar rewrites it).
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    after = await state(http, p)
    assert after["kv_holds"] == 0 and after["num_free_blocks"] == p.config.num_gpu_blocks
    # The decode engine computed one prompt token, not the prompt (its first token came far
    # sooner after admission than the prefill engine's); the transfer was charged.
    assert await metric(http, d, "vllm:time_to_first_token_seconds_sum") < await metric(http, p, "vllm:time_to_first_token_seconds_sum") / 5
    xfer = prompt_tokens * d.profile.kv_bytes_per_token() / 1e9
    assert await metric(http, d, "vllm:nixl_xfer_time_seconds_sum") == xfer
    assert await metric(http, d, "vllm:nixl_bytes_transferred_sum") == prompt_tokens * d.profile.kv_bytes_per_token()

    # Pulled once: a second decode with the same params finds nothing and fails, never recomputes.
    status, raw, _ = await post(http, f"{d.url}/v1/chat/completions", body)
    assert status == 500 and b"kv_load_failure_policy=fail" in raw
    assert await metric(http, d, "vllm:nixl_num_failed_transfers_total") == 1
    assert await metric(http, d, "vllm:request_success_total") == 1


async def test_unpulled_blocks_expire_and_roles_are_enforced(start_sim, http):
    p = await start_sim(role="prefill", kv_hold_timeout_s=0.5, speed=20.0)
    d = await start_sim(role="decode")
    kv = (await prefill(http, p))["kv_transfer_params"]
    await asyncio.sleep(0.5 / 20 + 0.05)
    # The next step of the prefill engine (any request) frees the expired hold.
    await post(http, f"{p.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert (await state(http, p))["kv_holds"] == 0 and await metric(http, p, "vllm:nixl_num_kv_expired_reqs_total") == 1
    status, raw, _ = await post(http, f"{d.url}/v1/chat/completions", {"messages": PROMPT, "max_tokens": 3, "kv_transfer_params": kv})
    assert status == 500
    # A decode engine does not hold KV for others; a prefill engine does not pull.
    status, raw, _ = await post(http, f"{d.url}/v1/chat/completions", {"messages": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    assert status == 400 and b"role is decode" in raw
    status, raw, _ = await post(http, f"{p.url}/v1/chat/completions", {"messages": PROMPT, "kv_transfer_params": {**kv, "remote_port": "x"}})
    assert status == 400 and b"remote_port" in raw


async def test_a_pull_answered_with_an_impossible_token_count_fails_fast(start_sim, http):
    """A prefill side claiming 10^12 tokens had the decode engine sleep out that transfer."""
    from aiohttp import web

    async def pull(request: web.Request) -> web.Response:
        return web.json_response({"tokens": 10**12})

    app = web.Application()
    app.router.add_post("/sim/kv/pull", pull)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        d = await start_sim(role="decode")
        kv = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port, "remote_request_id": "x"}
        body = {"messages": PROMPT, "max_tokens": 2, "kv_transfer_params": kv}
        status, raw, _ = await asyncio.wait_for(post(http, f"{d.url}/v1/chat/completions", body), 10)
        assert status == 500 and b"kv_load_failure_policy=fail" in raw
    finally:
        await runner.cleanup()
