"""Endpoint fixtures in known states for scheduling tests."""

from __future__ import annotations

import random
import time

import pytest

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore
from extproc.datastore.scraper import EngineMetrics
from extproc.scheduling.framework import SchedulingContext
from extproc.types import LLMRequest, RequestKind, TokenCount


@pytest.fixture
def store() -> Datastore:
    return Datastore([EndpointConfig(address=f"10.0.0.{i}:8000", models=["m"]) for i in (1, 2, 3)])


def engine(*, waiting=0, running=0, kv=0.0, blocks=1000, block_size=16, ttft=None, age=0.0) -> EngineMetrics:
    return EngineMetrics(
        running=running, waiting=waiting, kv_usage=kv, num_gpu_blocks=blocks, block_size=block_size,
        ttft_p95_s=ttft, scraped_at=time.monotonic() - age,
    )


def context(prompt=100, output=28, n=1, priority="standard", stale_after_s=2.0) -> SchedulingContext:
    req = LLMRequest(kind=RequestKind.CHAT, model="m", served_model="m", prompt_tokens=TokenCount(prompt), n=n)
    return SchedulingContext(req, output, 16, time.monotonic(), random.Random(1), priority, stale_after_s)
