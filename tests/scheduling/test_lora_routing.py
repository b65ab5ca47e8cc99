"""LoRA adapters through a real `ExtProcApp` in front of simulated engines serving them: the
adapter's name reaches the engine as `model` (never rewritten to the base), adapters the engines
report are learned, and the `lora` profile routes an adapter back to the engine that loaded it
even where the engine exports only the old activity metric."""

from __future__ import annotations

import asyncio

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.scheduling.test_with_simulator import MODEL, _headers, stack, until  # noqa: F401  (stack: a fixture)

ADAPTERS = ["sql-lora", "chat-lora", "code-lora"]
PROFILE = "lora"


async def route(stub, model: str, words: int = 40) -> tuple[str | int, bytes | None]:
    """One decision: (the chosen endpoint or the refusal's status, the body sent upstream when rewritten)."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": " ".join(["tok"] * words)}], "max_tokens": 4})
    call = stub.Process()
    await call.write(_headers(None))
    await call.read()
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    reply = await call.read()
    call.cancel()
    if reply.WhichOneof("response") == "immediate_response":
        return reply.immediate_response.status.code, None
    common = reply.request_body.response
    headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    return headers["x-gateway-destination-endpoint"], common.body_mutation.body or None


async def test_adapter_is_sent_as_is_learned_adapters_resolve_and_unknown_names_404(stack):
    models = [{"name": MODEL, "aliases": ["qwen"], "adapters": ["sql-lora"], "max_model_len": 40960}]
    sims = ({"speed": 20, "lora_modules": ADAPTERS, "max_loras": 2},)
    app, (sim,), stub = await stack(*sims, models=models)
    dest, rewritten = await route(stub, "sql-lora")
    assert dest == f"127.0.0.1:{sim.port}" and rewritten is None  # the engine selects the adapter by this name
    _, rewritten = await route(stub, "qwen")
    assert rewritten is not None and orjson.loads(rewritten)["model"] == MODEL  # an alias still is rewritten
    # not configured: learned from the engine's /v1/models (engine check) or its LoRA metrics
    await until(lambda: app.store.all()[0].engine is not None and app.store.all()[0].engine.lora is not None)
    assert (await route(stub, "nope-lora"))[0] == 404
    sim_ep = app.store.all()[0]
    sim_ep.listed_adapters = {"code-lora": MODEL}
    dest, rewritten = await route(stub, "code-lora")
    assert dest == f"127.0.0.1:{sim.port}" and rewritten is None
    assert "code-lora" in app.pipeline.served_models
    labels = {
        (s.labels["adapter"], s.labels["residency"])
        for m in app.metrics.registry.collect() if m.name == "llm_extproc_lora_requests"
        for s in m.samples if s.name.endswith("_total")
    }
    assert ("sql-lora", "free") in labels and ("other", "free") in labels  # learned names are not labels


async def test_lora_profile_returns_an_idle_adapter_to_its_engine_on_the_old_metric(stack):
    sims = [{"speed": 20, "lora_modules": ADAPTERS, "max_loras": 1, "lora_metrics": "activity"} for _ in range(3)]
    app, started, stub = await stack(*sims, models=[{"name": MODEL, "adapters": ADAPTERS}], scheduling={
        "profile": PROFILE, "prefix": {"enabled": False}, "metrics": {"interval_s": 0.05, "timeout_s": 0.2, "stale_after_s": 0.5}, "health_check": {"interval_s": 0.2},
    })
    first, _ = await route(stub, "chat-lora")
    await asyncio.sleep(0.3)  # finished: the engine's lora_requests_info shows no adapter now
    assert all(ep.engine.lora is not None and not ep.engine.lora.running for ep in app.store.all())
    again = [(await route(stub, "chat-lora"))[0] for _ in range(8)]
    assert set(again) == {first}
