"""Fixtures for driving the ext_proc server in-process over a real gRPC channel."""

from __future__ import annotations

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry

from extproc.config.loader import config_from_mapping
from extproc.pipeline.request import ModelRuntime
from extproc.server.app import ExtProcApp

ENDPOINTS = ["127.0.0.1:18001", "127.0.0.1:18002"]
MODEL = "Qwen/Qwen3-8B"


def make_config(**overrides):
    raw = {
        "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "limits": {"max_body_bytes": 65536, "grpc_max_message_bytes": 262144, "shutdown_grace_s": 1},
        "models": [{"name": MODEL, "aliases": ["qwen3-8b"], "max_model_len": 4096}],
        "endpoints": [{"address": a, "models": [MODEL]} for a in ENDPOINTS],
        "scheduling": {"health_check": {"enabled": False}},
        "telemetry": {"sample_rate": 1.0},  # every stream observed: deterministic tests
    }
    for key, value in overrides.items():
        raw[key] = value
    return config_from_mapping(raw)


@pytest.fixture
async def make_app(qwen_counter):
    """Factory: start an ExtProcApp (health checks off unless configured), stop it after the test.
    `counter=` gives the app its own token counter instead of the session's shared one (whose
    cache totals other tests' leftover tokenizer threads may still move)."""
    apps: list[ExtProcApp] = []

    async def factory(*, counter=None, **overrides) -> ExtProcApp:
        cfg = make_config(**overrides)
        models = {m.name: ModelRuntime(m, counter or qwen_counter) for m in cfg.models}
        app = ExtProcApp(cfg, registry=CollectorRegistry(), models=models)
        await app.start()
        apps.append(app)
        return app

    yield factory
    for app in apps:
        await app.aclose(grace_s=0)


@pytest.fixture
async def app(make_app):
    return await make_app()


@pytest.fixture
async def stub(app):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)
