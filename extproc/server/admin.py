"""The admin HTTP server (default port 9090): `/metrics`, `/healthz`, `/api/v1/endpoints`,
`/api/v1/weights`, `/api/v1/tenants` (each rate-limited tenant's window), and the authenticated
override routes of `extproc.server.overrides_api`. `/` and `/api/v1` list them (`PAGES`: one
line each, JSON).

`/api/v1/weights` is what an external balancer (or Grafana) pulls: per endpoint, the active
profile's weighted score for a reference request (a 512-token prompt with the model's default
output), each scorer's value, the design notes' compute-aware components, metrics staleness and
reserved KV blocks. Nothing here echoes request content, user ids or credentials.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

from extproc.aio import start_site
from extproc.datastore.endpoints import Datastore
from extproc.metrics import Metrics
from extproc.scheduling.framework import SchedulingContext
from extproc.server.overrides_api import OVERRIDE_PAGES
from extproc.server.overrides_api import OverridesAPI, describe, load_admin_token
from extproc.scheduling.plugins.scorers.compute_aware import components
from extproc.types import LLMRequest, RequestKind, TokenCount

if TYPE_CHECKING:
    from extproc.pipeline.request import RequestPipeline
    from extproc.ratelimit.limiter import RateLimiter
    from extproc.replicas.sync import ReplicaSync

__all__ = ["AdminServer", "INDEX_PATHS", "PAGES", "REFERENCE_PROMPT_TOKENS"]

INDEX_PATHS = ("/", "/api/v1", "/api/v1/")
"""Where the list of pages is served."""

PAGES: dict[tuple[str, str], str] = {
    ("GET", "/metrics"): "Prometheus metrics (text exposition format)",
    ("GET", "/healthz"): "200 while serving (healthy endpoints, pid), 503 while shutting down",
    ("GET", "/api/v1/endpoints"): "each endpoint's health, load, KV cache, prefill fit; prefix index, token encoders, replica sync",
    ("GET", "/api/v1/weights"): "each endpoint's routing weight for a reference request, its scorers and operator override",
    ("GET", "/api/v1/tenants"): "each rate-limited tenant's window and limits (labels only, never keys)",
    **OVERRIDE_PAGES,
}
"""Method and path → one line on the page, listed at `INDEX_PATHS` (a test checks every route
of the server is here)."""

REFERENCE_PROMPT_TOKENS = 512
"""Prompt length of the reference request `/api/v1/weights` scores endpoints for (tokens)."""

# `/metrics` without a `<name>_created` series beside every counter and histogram: creation
# timestamps double the series a dashboard scrolls through and nothing here reads them.
# (Process-wide, checked when metrics are collected.)
disable_created_metrics()


def _stream(ep) -> dict | None:
    """Response-path statistics of an endpoint (seconds), each with the samples it comes from
    (responses observed at `telemetry.sample_rate`), or None without any."""
    stats = ep.stream_stats
    if stats is None:
        return None
    snap = stats.snapshot()
    return {
        "ttft_p95_s": snap.ttft_p95_s,
        "ttft_samples": snap.ttft_samples,
        "itl_recent_s": snap.itl_recent_s,
        "itl_samples": snap.itl_samples,
        "gap_stddev_s": snap.gap_stddev_s,
        "pressure": snap.pressure.name.lower(),
        "latency_score": snap.latency_score,
        "completed": snap.completed,
        "failed": snap.failed,
    }


class AdminServer:
    """aiohttp app serving the admin endpoints.

    Args:
        metrics: whose registry `/metrics` exposes.
        store: endpoint state for `/api/v1/endpoints`.
        is_serving: returns False while shutting down (then `/healthz` answers 503).
        host, port: listen address (port 0 picks a free one; see `.port` after start).
        sample_rate: `telemetry.sample_rate` (the share of responses the stream statistics of
            `/api/v1/endpoints` come from), shown there; None when telemetry is off.
        replicas: replica sync, summarised in `/api/v1/endpoints` (None: sync off).
    """

    def __init__(
        self,
        metrics: Metrics,
        store: Datastore,
        is_serving: Callable[[], bool],
        host: str,
        port: int,
        pipeline: RequestPipeline | None = None,
        ratelimit: RateLimiter | None = None,
        reuse_port: bool = False,
        sample_rate: float | None = None,
        admin_token: str | None = None,
        replicas: ReplicaSync | None = None,
    ) -> None:
        self._replicas = replicas
        # The write routes' credential: given, else from the environment (None refuses them).
        token = admin_token if admin_token is not None else load_admin_token()
        self._overrides = OverridesAPI(store, metrics, token, share=replicas.override if replicas is not None else None)
        self._reuse_port = reuse_port
        self._pipeline = pipeline
        self._ratelimit = ratelimit
        self._sample_rate = sample_rate
        self._metrics = metrics
        self._store = store
        self._is_serving = is_serving
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port = port

    def _app(self) -> web.Application:
        app = web.Application()
        for index in INDEX_PATHS:
            app.router.add_get(index, self._index)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/api/v1/endpoints", self._endpoints)
        app.router.add_get("/api/v1/weights", self._weights)
        app.router.add_get("/api/v1/tenants", self._tenants)
        self._overrides.add_routes(app)
        return app

    async def start(self) -> None:
        """Listen.

        Raises:
            OSError: the address cannot be bound.
        """
        self._runner, self.port = await start_site(self._app(), self._host, self._port, reuse_port=self._reuse_port)

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        for ep in self._store.all():
            self._metrics.endpoint_healthy.labels(ep.address).set(1 if ep.healthy else 0)
            age = ep.metrics_age(now)
            if age is not None:
                self._metrics.endpoint_metrics_age.labels(ep.address).set(age)
        for row in self.weights():
            self._metrics.endpoint_weight.labels(row["address"]).set(row["weight"])
            self._metrics.endpoint_override_factor.labels(row["address"]).set(row["override"]["factor"])
            for scorer, part in row["scores"].items():
                self._metrics.endpoint_score.labels(row["address"], scorer).set(part["score"])
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

    async def _index(self, request: web.Request) -> web.Response:
        """Every page of this server with one line on what it is (`PAGES`)."""
        return web.json_response({"pages": [{"method": m, "path": path, "what": what} for (m, path), what in PAGES.items()]})

    async def _healthz(self, request: web.Request) -> web.Response:
        if not self._is_serving():
            return web.json_response({"status": "shutting_down", "pid": os.getpid()}, status=503)
        healthy = sum(1 for ep in self._store.all() if ep.healthy)
        # The pid tells a replacement process sharing the port (SO_REUSEPORT) from the old one.
        return web.json_response({"status": "ok", "endpoints_healthy": healthy, "endpoints": len(self._store.all()), "pid": os.getpid()})

    async def _endpoints(self, request: web.Request) -> web.Response:
        prefix = self._pipeline.prefix if self._pipeline is not None else None
        return web.json_response(
            {
                "prefix_index": prefix.summary() if prefix is not None else None,
                # Which encoder counts each model's tokens (tiktoken once cross-checked, else
                # tokenizers and why): docs/decisions/0200.
                "token_encoders": self._pipeline.encoders() if self._pipeline is not None else None,
                # Per model, the learned output length capping max_tokens in the decode cost
                # (docs/decisions/0275).
                "output_estimates": self._pipeline.output_estimates.summary() if self._pipeline is not None else None,
                "replica_sync": self._replicas.summary() if self._replicas is not None else None,
                # How much each learned value rests on: `prefill_samples` first tokens for the
                # prefill speed; stream statistics from this share of responses only.
                "telemetry_sample_rate": self._sample_rate,
                "endpoints": [
                    {
                        "address": ep.address,
                        "models": sorted(ep.models),
                        "labels": ep.labels,
                        "healthy": ep.healthy,
                        "draining": ep.draining,
                        "ejected_for_s": round(max(0.0, ep.ejected_until - time.monotonic()), 3),
                        "consecutive_5xx": ep.consecutive_5xx,
                        "ejections": ep.ejections,
                        "prefill_s_per_token": ep.prefill_s_per_token,
                        "prefill_fit": {
                            "t0_s": ep.prefill_fit.t0_s,
                            "s_per_token": ep.prefill_fit.s_per_token,
                        },
                        "prefix": prefix.describe(ep) if prefix is not None else None,
                        "prefill_samples": ep.prefill_fit.samples,
                        "inflight": ep.inflight,
                        "prefill_inflight": ep.prefill_inflight,
                        "decode_inflight": ep.decode_inflight,
                        "reserved_kv_blocks": ep.reserved_blocks,
                        "last_probe_error": ep.last_probe_error,
                        # The engine's own token counts and max_model_len against ours, per model
                        # (docs/decisions/0290): match, mismatch or unverified, and why.
                        "engine_check": {m: c.describe() for m, c in sorted((ep.engine_check or {}).items())},
                        "stream": _stream(ep),
                        "node": None
                        if ep.node is None
                        else {
                            "usable": ep.node.usable,
                            "gpu_util": ep.node.gpu_util,
                            "device_fault": ep.node.device_fault,
                            "weight": ep.node.weight,
                            "stale": ep.node.stale(),
                        },
                        "engine": None
                        if ep.engine is None
                        else {
                            "running": ep.engine.running,
                            "waiting": ep.engine.waiting,
                            "kv_cache_usage": ep.engine.kv_usage,
                            "num_gpu_blocks": ep.engine.num_gpu_blocks,
                            "block_size": ep.engine.block_size,
                            "ttft_p95_s": ep.engine.ttft_p95_s,
                            "age_s": round(time.monotonic() - ep.engine.scraped_at, 3),
                        },
                    }
                    for ep in self._store.all()
                ],
            }
        )

    async def _tenants(self, request: web.Request) -> web.Response:
        """Each limited tenant's sliding window (labels only, never keys); empty when rate
        limiting is off."""
        rows = await self._ratelimit.windows() if self._ratelimit is not None else []
        return web.json_response({"enabled": self._ratelimit is not None, "tenants": rows})

    def weights(self) -> list[dict]:
        """Per endpoint: the active profile's score for the reference request (`weight`, the sum
        of the `weighted` parts) and, per scorer, its `score` in [0, 1], its configured
        `weight` and their product `weighted`."""
        pipeline = self._pipeline
        endpoints = self._store.all()
        if pipeline is None or not endpoints:
            return []
        profile = pipeline.profile
        ctx = SchedulingContext(
            request=LLMRequest(kind=RequestKind.CHAT, model="", prompt_tokens=TokenCount(REFERENCE_PROMPT_TOKENS)),
            expected_output_tokens=512,
            default_block_size=16,
            now=time.monotonic(),
            rng=random.Random(0),
            attention_ratio=pipeline.attention_ratio,  # scored as routing scores it
        )
        scored = profile.score(ctx, endpoints)
        parts: list[dict[str, dict[str, float | bool]]] = [{} for _ in endpoints]
        for ws in profile.scorers:
            for i, se in enumerate(scored):
                v = se.parts[ws.scorer.name]
                part: dict[str, float | bool] = {"score": round(v, 4), "weight": ws.weight}
                if getattr(ws.scorer, "multiplies", False):  # scales the total instead of adding to it
                    part["multiplies"] = True
                else:
                    part["weighted"] = round(ws.weight * v, 4)
                parts[i][ws.scorer.name] = part
        comp = components(endpoints)
        rows = []
        for i, ep in enumerate(endpoints):
            age = ep.metrics_age(ctx.now)
            rows.append(
                {
                    "address": ep.address,
                    "weight": round(scored[i].total, 4) if ep.healthy else 0.0,
                    "override": describe(ep.override, ctx.now),
                    "healthy": ep.healthy,
                    "scores": parts[i],
                    "compute_aware": {k: (None if v is None else round(v, 4)) for k, v in comp[i].items()},
                    "metrics_age_s": None if age is None else round(age, 3),
                    "stale": ctx.is_stale(ep),
                    "reserved_kv_blocks": ep.reserved_blocks,
                    "inflight": ep.inflight,
                }
            )
        return rows

    async def _weights(self, request: web.Request) -> web.Response:
        profile = self._pipeline.profile.name if self._pipeline is not None else None
        return web.json_response({"profile": profile, "reference_prompt_tokens": REFERENCE_PROMPT_TOKENS, "endpoints": self.weights()})
