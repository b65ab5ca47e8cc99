"""Micro-benchmark: cost of the weight-override filter and scorer per scheduling cycle (8 endpoints,
one drained, one lowered). `python scripts/bench_weight_override.py`; results in docs/benchmarks.md."""

from __future__ import annotations

import random, time, timeit
from extproc.datastore.endpoints import Endpoint
from extproc.datastore.overrides import set_override
from extproc.scheduling.framework import SchedulingContext
from extproc.scheduling.registry import build
from extproc.types import LLMRequest, RequestKind, TokenCount
eps=[Endpoint(f"10.0.0.{i}:8000", frozenset({"m"})) for i in range(8)]
set_override(eps[0], 0.0, 60, reason="x", source="api"); set_override(eps[1], 0.25, 60, reason="x", source="api")
ctx=SchedulingContext(request=LLMRequest(kind=RequestKind.CHAT, model="m", prompt_tokens=TokenCount(512)), expected_output_tokens=512, default_block_size=16, now=time.monotonic(), rng=random.Random(0))
f=build("weight-override-filter"); s=build("weight-override-scorer")
n=200000
for name, fn in (("filter", lambda: f.filter(ctx, eps)), ("scorer", lambda: s.score(ctx, eps))):
    t=min(timeit.repeat(fn, number=n, repeat=5))/n
    print(f"{name}: {t*1e6:.2f} us per call, 8 endpoints")
