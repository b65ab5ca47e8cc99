"""The decision's histograms through the real servicer over gRPC: each routed request is one
observation per decision phase and per scheduling plugin (the memoised children of
`Metrics.observe_each`), and an endpoint that leaves takes its memoised children with it."""

from __future__ import annotations

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import Histogram

from tests.server.conftest import ENDPOINTS, MODEL
from tests.server.test_contract import body_msg, exchange, headers_msg


def chat() -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8})


async def test_each_phase_and_plugin_is_observed_once_per_request(app, stub):
    for _ in range(3):
        await exchange(stub, headers_msg("POST", "/v1/chat/completions"), body_msg(chat()), pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    sample = app.metrics.registry.get_sample_value
    for phase in ("parse", "tokenize", "schedule", "total"):
        assert sample("llm_extproc_decision_duration_seconds_count", {"phase": phase}) == 3, phase
    profile = app.pipeline.profile
    plugins = [f.name for f in profile.filters] + [ws.scorer.name for ws in profile.scorers] + [profile.picker.name]
    assert len(plugins) > 5
    for name in plugins:
        assert sample("llm_extproc_scheduler_plugin_duration_seconds_count", {"plugin": name}) == 3, name
    assert sample("llm_extproc_scheduler_plugin_duration_seconds_sum", {"plugin": plugins[0]}) > 0


async def test_forgetting_an_endpoint_drops_its_memoised_children(app):
    m = app.metrics
    per_endpoint = Histogram("test_seconds", "A one-label histogram by endpoint.", ["endpoint"], registry=m.registry)
    m.observe_each(per_endpoint, {ENDPOINTS[0]: 0.5, ENDPOINTS[1]: 0.25})
    m.forget_endpoint(ENDPOINTS[0])
    sample = m.registry.get_sample_value
    assert sample("test_seconds_count", {"endpoint": ENDPOINTS[0]}) is None
    m.observe_each(per_endpoint, {ENDPOINTS[0]: 0.5, ENDPOINTS[1]: 0.25})
    # A stale memoised child would count into a series no longer exported: this one is new.
    assert sample("test_seconds_count", {"endpoint": ENDPOINTS[0]}) == 1
    assert sample("test_seconds_count", {"endpoint": ENDPOINTS[1]}) == 2
