"""The server's lifecycle: load models, start the datastore, gRPC and admin servers; stop them.

`grpc.aio` serves `envoy.service.ext_proc.v3.ExternalProcessor` and `grpc.health.v1.Health`
on one port. SIGTERM → health NOT_SERVING, answer every request still in a flow-control queue 503
`shutting_down`, stop accepting new streams, let in-flight streams finish for up to
`limits.shutdown_grace_s`, then cancel the rest.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from extproc.aio import listener_at
from extproc.config.schema import Config, TLSConfig, is_loopback, parse_host_port
from extproc.datastore.agent_client import AgentWatcher
from extproc.datastore.endpoints import Datastore, Endpoint, Reservation
from extproc.datastore.health import HealthChecker
from extproc.datastore.prefill_fit import PrefillCounts, PrefillPrior
from extproc.datastore.outliers import OutlierDetector
from extproc.datastore.scraper import MetricsScraper
from extproc.discovery.base import SourceContext
from extproc.discovery.manager import Discovery
from extproc.discovery.registry import build_source
from extproc.flowcontrol.controller import FlowController
from extproc.flowcontrol.gate import Gate
from extproc.flowcontrol.metrics import FlowMetrics
from extproc.metrics import Metrics
from extproc.pipeline.request import ModelRuntime, RequestPipeline
from extproc.pipeline.tokens import TokenCounter
from extproc.prefix.precise import PreciseSource
from extproc.prefix.tracker import PrefixMetrics, PrefixTracker
from extproc.ratelimit.limiter import RateLimiter, build_backend
from extproc.ratelimit.metrics import RateLimitMetrics
from extproc.replicas.sync import ReplicaSync
from extproc.server.admin import AdminServer
from extproc.server.epp import EppServicer
from extproc.server.extproc import ExtProcServicer
from extproc.telemetry.decision_log import DecisionLog
from extproc.telemetry.metrics import TelemetryMetrics
from extproc.telemetry.stats import EndpointStreamStats

__all__ = ["ExtProcApp", "load_models", "EXTPROC_SERVICE", "PICKER_HEALTH_SERVICES"]

log = logging.getLogger(__name__)

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

PICKER_HEALTH_SERVICES = ("liveness", "readiness")
"""The grpc.health.v1 service names the Endpoint Picker Protocol defines (its "Health Checking"
section); served in every mode, SERVING while the ext_proc service is."""


def load_models(config: Config) -> dict[str, ModelRuntime]:
    """Load every model's tokenizer (shared between models with the same source and encoder).

    Raises:
        TokenizerLoadError: a tokenizer source cannot be loaded.
    """
    counters: dict[tuple[str, str], TokenCounter] = {}
    out: dict[str, ModelRuntime] = {}
    for m in config.models:
        key = (m.tokenizer, m.token_encoder)
        if key not in counters:
            counters[key] = TokenCounter.from_source(m.tokenizer, encoder=m.token_encoder)
        out[m.name] = ModelRuntime(m, counters[key])
    return out


async def _warn_if_shared(cfg: Config) -> None:
    """Log a warning for each listen address where something already accepts connections:
    with SO_REUSEPORT the bind succeeds and the kernel splits new connections between the two
    listeners, which is the point while a replacement llm-extproc starts (decision 0140) and
    a silent misrouting when the port is a typo for someone else's (Envoy's listener, say)."""
    addresses = [("gRPC", cfg.listen.grpc)] + ([("admin", cfg.listen.admin)] if cfg.admin.enabled else [])
    for what, address in addresses:
        host, port = parse_host_port(address)
        if await listener_at(host, port):
            log.warning(
                "%s port %s already has a listener; listen.reuse_port lets this process share it, as a replacement "
                "llm-extproc does while the old one drains. If that listener is not llm-extproc, the kernel splits "
                "connections between the two: choose another port",
                what, address,
            )


def _add_port(server: grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    """Bind `address` on `server`, over TLS (mTLS when `tls.client_ca_file`) or plaintext;
    return the bound port (0 on failure with older grpcio). A plaintext non-loopback address
    is logged as a warning: any client reaching it can hold reservations.

    Raises:
        RuntimeError: the bind failed (grpcio). OSError: a TLS file cannot be read.
    """
    if tls is None:
        host, _ = parse_host_port(address)
        if not is_loopback(host):
            log.warning(
                "gRPC port %s is not loopback and has no TLS: any client that reaches it can hold reservations; "
                "set listen.grpc_tls (mTLS with client_ca_file) or restrict it to Envoy with a network policy",
                address,
            )
        return server.add_insecure_port(address)
    with open(tls.key_file, "rb") as f:
        key = f.read()
    with open(tls.cert_file, "rb") as f:
        cert = f.read()
    ca = None
    if tls.client_ca_file is not None:
        with open(tls.client_ca_file, "rb") as f:
            ca = f.read()
    creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
    return server.add_secure_port(address, creds)



TOKENIZE_THREADS = 2
"""Threads that render and tokenize long prompts (and check huge JSON bodies) off the event loop."""

class ExtProcApp:
    """The whole ext_proc server process.

    Args:
        config: validated configuration.
        registry: Prometheus registry (fresh per app; tests create several apps in one process).
        models: preloaded model runtimes (default: loaded from config at start).
        config_path: the file `config` came from: the static discovery source reloads its
            endpoints from it (None: they never change).
    """

    def __init__(
        self,
        config: Config,
        *,
        registry: CollectorRegistry | None = None,
        models: dict[str, ModelRuntime] | None = None,
        config_path: str | Path | None = None,
    ) -> None:
        self.config = config
        self.metrics = Metrics(registry or CollectorRegistry())
        self.telemetry = TelemetryMetrics(self.metrics.registry)
        # Response bodies are observed per endpoint; tier mode leaves the endpoint to Envoy.
        self._telemetry_on = config.telemetry.enabled and config.scheduling.mode == "endpoint"
        pm = config.scheduling.prefill_model
        self.store = Datastore(
            config.endpoints,
            PrefillPrior(t0_s=pm.prior_t0_s, s_per_token=pm.prior_s_per_token, weight=pm.prior_weight, forget=pm.forget),
            pm.prior_s_per_token_by_gpu,
            pm.gpu_label,
        )
        self.prefix = PrefixTracker(config.scheduling.prefix, PrefixMetrics(self.metrics.registry), registry=self.metrics.registry)
        self.prefix.warmer.reserve = lambda ep, tokens: self._reserve_warmup(ep, PrefillCounts(tokens, tokens))
        # Subscribed per endpoint by _endpoint_added / _endpoint_changed, configured or discovered.
        self.kv_events = PreciseSource(
            self.prefix,
            (),
            speculative_ttl_s=config.scheduling.prefix.speculative_ttl_s,
            registry=self.metrics.registry,
        )
        self.sync: ReplicaSync | None = None
        if config.replicas.sync == "redis":
            # Hooks on the datastore and tracker: every pick, first token and release is shared.
            self.sync = ReplicaSync(
                config.replicas, config.ratelimit.redis, self.store, self.prefix,
                registry=self.metrics.registry, attention_ratio=config.scheduling.prefill_model.attention_ratio,
            )  # fmt: skip
        self._models = models
        self._decision_log: DecisionLog | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._checker = HealthChecker(self.store, config.scheduling.health_check)
        self._agents = AgentWatcher(self.store, stale_after_s=config.scheduling.metrics.stale_after_s)
        m = config.scheduling.metrics
        self._scraper = (
            MetricsScraper(self.store, path=m.path, interval_s=m.interval_s, timeout_s=m.timeout_s, on_scrape=self._on_scrape)
            if m.enabled
            else None
        )
        ctx = SourceContext(config, Path(config_path) if config_path is not None else None)
        d = config.discovery
        self.discovery = Discovery(
            self.store,
            [build_source(p, ctx) for p in d.sources],
            drain_timeout_s=d.drain_timeout_s,
            initial_wait_s=d.initial_wait_s,
        )
        self.store.on_added.append(self._endpoint_added)
        self.store.on_changed.append(self._endpoint_changed)
        self.store.on_removed.append(self._endpoint_removed)
        for ep in self.store.all():
            self._endpoint_added(ep)
        self.pipeline: RequestPipeline | None = None
        self.ratelimit: RateLimiter | None = None
        if config.ratelimit.enabled:
            models = {m.name: (m.default_output_tokens, m.max_model_len) for m in config.models}
            self.ratelimit = RateLimiter(config.ratelimit, build_backend(config.ratelimit), RateLimitMetrics(self.metrics), models)
        self._admin: AdminServer | None = None
        self._serving = False
        self.servicer: ExtProcServicer | None = None
        self.flow: FlowController | None = None
        self.grpc_port = 0
        self.admin_port = 0

    def _reserve_warmup(self, ep: Endpoint, counts: PrefillCounts) -> Reservation:
        """A prefix warm-up is prefill work on its endpoint like any request: counted in flight
        there, its counts kept for the other replicas."""
        work = counts.work(self.config.scheduling.prefill_model.attention_ratio)
        return self.store.reserve(ep, prompt_tokens=work, context_tokens=counts.prompt_tokens, prefill_counts=counts)

    def _endpoint_added(self, ep: Endpoint) -> None:
        """A new endpoint (configured or discovered): its gauges, statistics and loops."""
        # Read at scrape time: nothing to update on the request path.
        self.metrics.endpoint_inflight.labels(ep.address).set_function(lambda ep=ep: ep.inflight)
        self.metrics.endpoint_reserved_blocks.labels(ep.address).set_function(lambda ep=ep: ep.reserved_blocks)
        ep.stream_stats = EndpointStreamStats(self.config.telemetry.stats)
        self._checker.add(ep)  # after start: no request before its first probe passes
        if self._scraper is not None:
            self._scraper.add(ep)  # no-op before start(), which scrapes every endpoint
        self._endpoint_changed(ep)

    def _endpoint_changed(self, ep: Endpoint) -> None:
        """An endpoint's agent or KV-event sockets are new (added, or changed by a reload): watch
        that agent, subscribe to that publisher (both replace the previous ones; none: stop)."""
        if ep.agent:
            self._agents.add(ep, ep.agent)
        else:
            self._agents.remove(ep)
        if ep.kv_events and self.config.scheduling.prefix.enabled:
            self.kv_events.add(ep.address, ep.kv_events, ep.kv_events_replay)
        else:
            self.kv_events.remove(ep.address)

    def _endpoint_removed(self, ep: Endpoint) -> None:
        """An endpoint left (`Datastore.remove_endpoint`): stop its loops, drop its prefix
        index, sessions and every metric series labelled with it."""
        if self._scraper is not None:
            self._scraper.remove(ep)
        self._agents.remove(ep)
        self._checker.forget(ep)
        self.kv_events.remove(ep.address)  # before the index drop: no late batch re-adds entries
        if self.sync is not None:
            self.sync.drop_endpoint(ep.address)  # the other replicas' requests counted on it
        self.prefix.drop_endpoint(ep.address)
        self.metrics.forget_endpoint(ep.address)

    def _on_scrape(self, endpoint, ok: bool, seconds: float) -> None:
        m = self.metrics
        m.scrape_seconds.labels(endpoint.address).observe(seconds)
        if ok:
            endpoint.scrape_errors = 0
            self.store.settle_scraped(endpoint, endpoint.engine.scraped_at)
            self.prefix.on_scrape(endpoint)
            if self.flow is not None:
                self.flow.wake()  # the engine's queue may have emptied: the gate reads it
        else:
            endpoint.scrape_errors += 1
            m.scrape_errors.labels(endpoint.address).inc()

    def _skip_response_headers(self, cfg: Config) -> bool:
        """`telemetry.response_headers: when_needed` and nothing configured reads a response's
        headers (outlier detection, the explain header, rate limits, truncation); when it is set
        but something does, say so once and keep them."""
        if cfg.telemetry.response_headers != "when_needed":
            return False
        needs = [
            name
            for name, on in (
                ("scheduling.outlier_detection", cfg.scheduling.outlier_detection.enabled),
                ("scheduling.explain_header", cfg.scheduling.explain_header),
                ("rate limits", self.ratelimit is not None),
                ("truncation", any(m.truncation.mode != "off" for m in cfg.models)),
                ("protocol.mode: epp (FULL_DUPLEX_STREAMED takes no mode override)", cfg.protocol.mode == "epp"),
                ("flow control (x-llm-queue-ms)", cfg.flow_control.enabled),
            )
            if on
        ]
        if needs:
            log.info("telemetry.response_headers: when_needed has no effect: %s read every response's headers", ", ".join(needs))
            return False
        return True

    async def start(self) -> None:
        """Load tokenizers, probe endpoints, then listen (gRPC, then admin).

        Raises:
            TokenizerLoadError: a tokenizer cannot be loaded.
            RuntimeError: a listen address cannot be bound, or the decision log cannot be opened.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        if self._models is None:
            self._models = await loop.run_in_executor(None, load_models, cfg)
        if cfg.decision_log.path is not None:
            decision_log = DecisionLog(cfg.decision_log, self.metrics.decision_log_dropped)
            try:
                decision_log.start()
            except OSError as exc:
                raise RuntimeError(f"cannot open decision_log.path {cfg.decision_log.path}: {exc.strerror or exc}") from None
            self._decision_log = decision_log
        self.pipeline = pipeline = RequestPipeline(
            cfg, self.store, self._models, self.metrics, prefix=self.prefix, tokenize_threads=TOKENIZE_THREADS
        )
        if cfg.flow_control.enabled:
            fc = cfg.flow_control
            gate = Gate(fc.gate, self.store.for_model, stale_after_s=cfg.scheduling.metrics.stale_after_s)
            self.flow = FlowController(fc, gate, pipeline.schedule, pipeline.reserve, FlowMetrics(self.metrics))
            log.info(
                "flow control on (%s fairness, %s gate): Envoy's ext_proc message_timeout must be at least %.1f s, "
                "or requests queued longer get Envoy's 504 (llm-extproc envoy-config sets it)",
                fc.fairness, fc.gate.mode, fc.message_timeout_s(cfg.limits.decision_timeout_ms),
            )  # fmt: skip
        od = cfg.scheduling.outlier_detection
        servicer_kwargs = {}
        servicer_class = ExtProcServicer
        if cfg.protocol.mode == "epp":
            servicer_class = EppServicer
            servicer_kwargs = {"protocol": cfg.protocol, "max_body_bytes": cfg.limits.max_body_bytes}
        self.servicer = servicer_class(
            pipeline,
            self.metrics,
            **servicer_kwargs,
            priority_header=cfg.admission.priority.header,
            session_header=cfg.scheduling.prefix.session_header or None,
            trusted_priority_header=cfg.admission.priority.trusted_header,
            explain_header=cfg.scheduling.explain_header,
            telemetry=self.telemetry if self._telemetry_on else None,
            observer_options=cfg.telemetry.observer,
            sample_rate=cfg.telemetry.sample_rate,
            outlier_detection=OutlierDetector(self.store, od) if od.enabled else None,
            ratelimit=self.ratelimit,
            decision_log=self._decision_log,
            skip_response_headers=self._skip_response_headers(cfg),
            flow_control=self.flow,
        )
        await self.discovery.start()
        await self._checker.start()
        await self._agents.start()
        if self._scraper is not None:
            await self._scraper.start()
        await self.kv_events.start()
        if self.sync is not None:
            await self.sync.start()

        if cfg.listen.reuse_port:
            await _warn_if_shared(cfg)
        options = [
            ("grpc.max_receive_message_length", cfg.limits.grpc_max_message_bytes),
            ("grpc.max_send_message_length", cfg.limits.grpc_max_message_bytes),
            ("grpc.max_concurrent_streams", 100_000),
            # A replacement process binds beside this one and gets ready before this one is
            # told to drain (decision 0140); off, a second bind fails with "address in use".
            ("grpc.so_reuseport", 1 if cfg.listen.reuse_port else 0),
        ]
        server = grpc.aio.server(options=options)
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = _add_port(server, cfg.listen.grpc, cfg.listen.grpc_tls)
        except RuntimeError:  # grpcio raises on a failed bind (older versions returned 0)
            port = 0
        except OSError as exc:
            await self.aclose(grace_s=0)
            raise RuntimeError(f"cannot read the gRPC TLS files: {exc}") from None
        if port == 0:
            await self.aclose(grace_s=0)  # the probes and scrapers already started
            raise RuntimeError(f"cannot listen on {cfg.listen.grpc} (address in use or not available)")
        self.grpc_port = port
        await server.start()
        self._grpc = server
        for svc in ("", EXTPROC_SERVICE, *PICKER_HEALTH_SERVICES):
            await self._health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True

        if cfg.admin.enabled:
            host, aport = parse_host_port(cfg.listen.admin)
            rate = cfg.telemetry.sample_rate if cfg.telemetry.enabled else None
            self._admin = AdminServer(
                self.metrics,
                self.store,
                lambda: self._serving,
                host,
                aport,
                pipeline=self.pipeline,
                reuse_port=cfg.listen.reuse_port,
                sample_rate=rate,
                ratelimit=self.ratelimit,
                replicas=self.sync,
                flow=self.flow,
            )
            try:
                await self._admin.start()
            except OSError as exc:
                await self.aclose()
                raise RuntimeError(f"cannot listen on {cfg.listen.admin}: {exc.strerror}") from None
            self.admin_port = self._admin.port
        log.info("ext_proc listening on %s (port %d), admin on %s", cfg.listen.grpc, self.grpc_port, cfg.listen.admin)

    async def aclose(self, grace_s: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, no new streams, wait for in-flight ones (bounded), close."""
        grace = self.config.limits.shutdown_grace_s if grace_s is None else grace_s
        self._serving = False
        await self._health.enter_graceful_shutdown()
        if self.flow is not None:
            answered = self.flow.close()  # before the streams are waited for: nobody waits on a queue
            if answered:
                log.info("shutdown: %d queued requests answered 503", answered)
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        await self.discovery.aclose()
        await self._checker.aclose()
        await self._agents.aclose()
        await self.prefix.warmer.aclose()
        if self._scraper is not None:
            await self._scraper.aclose()
        await self.kv_events.aclose()
        if self.sync is not None:
            await self.sync.aclose()  # after the streams: the others release what this one held
        if self._admin is not None:
            await self._admin.aclose()
            self._admin = None
        if self.ratelimit is not None:
            await self.ratelimit.aclose()
        if self.pipeline is not None:
            self.pipeline.close()
        if self._decision_log is not None:
            self._decision_log.close()  # after the streams: their last lines are written
            self._decision_log = None
