"""The rate limiter the ext_proc server calls: tenant → scopes → reserve at admission → settle.

    precheck_headers(tenant) at the request's headers: refuse before the body crosses when the
                             tenant could not be admitted even a 1-token request now
    precheck(tenant, ...)    before tokenizing: refuse at once when the window cannot hold even
                             the request's least cost (1 prompt token + max_tokens × n), so a
                             flooding tenant's refusals cost no tokenizer time
    admit(tenant, request)   cost = prompt + output budget (or the size cost); one backend call
                             charges every scope (tenant, tenant × model) — window, pacing
                             bucket, in-flight slot — or refuses: 429 + retry-after +
                             x-ratelimit-*, or 400 when the cost exceeds a whole limit (no wait
                             would ever admit it)
    settle(admission, used)  at the stream's end, however it ended: the charge becomes the
                             tokens really used (`used_tokens`); None keeps the reservation;
                             the in-flight slot is released either way

A tenant with no limit anywhere is not counted at all (no backend call). Backend failures follow
`redis.on_error`: `open` admits uncounted, `closed` answers 503; both count
`llm_extproc_ratelimit_backend_errors_total` and log at most one line per `log_interval_s`.
A settlement (or the give-back of a cancelled admission) the backend cannot take, even after its
retry on a fresh connection, waits in a bounded queue and is delivered once the backend answers
again — before the next decision, and by a background retry every `FLUSH_RETRY_S` while the queue
is not empty (no request need arrive) — so a tenant's concurrency slot is not held for the lease.
An acquire with an in-flight slot that timed out (Redis stalled: the command may still run when
it resumes) is aborted the same way (`WindowBackend.abort`): it gives its slot and tokens back,
or is refused when it runs late.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from extproc.errors import NoEndpointError
from extproc.logthrottle import WarnEvery
from extproc.ratelimit.backend import BackendUnavailable, WindowBackend
from extproc.ratelimit.config import LimitValues, RateLimitConfig
from extproc.ratelimit.metrics import RateLimitMetrics
from extproc.ratelimit.replies import TenantRateLimitedError, TooLargeForLimitError, duration, ratelimit_headers
from extproc.ratelimit.tenant import Tenant, TenantResolver
from extproc.ratelimit.window import UNLIMITED, Decision, ScopeLimit
from extproc.types import LLMRequest

__all__ = ["Admission", "RateLimiter", "build_backend"]

log = logging.getLogger(__name__)

PROMPT_FLOOR_MARGIN = 0.5
"""The body precheck's prompt estimate: half the tokens per body byte of the tenant's sparsest
request seen so far (its lowest prompt tokens / body bytes), times this body's bytes. A request
of the same tenant needs twice as many bytes per token as any before it to be refused early by
mistake, and then only delayed (a full window or bucket still admits it)."""

UNSETTLED_MAX = 10_000
"""Settlements kept while the backend cannot take them; past this the oldest is dropped (its
slot then waits for its lease, `inflight_lease_s`). One entry: keys, bucket, delta, id; or an
abort of a timed-out acquire: keys, None, its cost, id."""

FLUSH_RETRY_S = 1.0
"""While the backend keeps failing, a decision tries to deliver the queued settlements at most
once per this many seconds (each try may cost one backend timeout)."""

FLUSH_BATCH = 32
"""Queued settlements sent at once (connections the flush may open together)."""

REFUSED_MEMORY = 10_000
"""Tenants whose latest refusal this process remembers (for the remote precheck); forgotten
all at once past this, which only costs their next request a full decision."""


def build_backend(config: RateLimitConfig) -> WindowBackend:
    """The configured backend (one new backend = one module + one line here)."""
    if config.backend == "redis":
        from extproc.ratelimit.redis_backend import RedisBackend

        return RedisBackend(config.redis, config.buckets, lease_ms=round(config.inflight_lease_s * 1000))
    from extproc.ratelimit.memory import MemoryBackend

    return MemoryBackend(config.buckets, lease_ms=round(config.inflight_lease_s * 1000))


@dataclass(slots=True)
class Admission:
    """An admitted request's charge, held until the stream ends.

    Attributes:
        tenant: whose window was charged.
        keys: the scope keys charged.
        bucket: the bucket charged, or None when nothing was (backend down, failing open).
        charged: tokens reserved (tokens).
        prompt_tokens: our prompt count, for settlement without `usage` (tokens).
        headers: the `x-ratelimit-*` headers for the response.
        settle_by_usage: the charge is settled from the response (token cost with a token limit).
        request_id: the request's entry in its scopes' in-flight sets (a concurrency cap), else None.
        settled: `settle` ran (it runs once).
    """

    tenant: Tenant
    keys: tuple[str, ...]
    bucket: int | None
    charged: int
    prompt_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    settle_by_usage: bool = False
    request_id: str | None = None
    settled: bool = False


class RateLimiter:
    """Tenants and their sliding-window limits over one backend.

    Args:
        config: the `ratelimit` section.
        backend: where windows live (`build_backend`).
        metrics: per-tenant metrics.
        models: canonical model name → (default_output_tokens, max_model_len) for the output
            budget of a request without `max_tokens` (tokens).
        clock: monotonic seconds, for log rate-limiting.
    """

    def __init__(
        self,
        config: RateLimitConfig,
        backend: WindowBackend,
        metrics: RateLimitMetrics,
        models: Mapping[str, tuple[int, int]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.backend = backend
        self.resolver = TenantResolver(config)
        self._metrics = metrics
        self._models = dict(models)
        self._clock = clock
        self._pending: set[asyncio.Task] = set()
        self._seen: dict[str, Tenant] = {}
        self._backend_warning = WarnEvery(log, config.redis.log_interval_s, self._clock)
        self._refused_at: dict[str, float] = {}
        self._tokens_per_byte: dict[str, float] = {}  # tenant id → its lowest prompt tokens / body byte
        # In-flight ids: unique across replicas sharing Redis (a random prefix per process).
        self._id_prefix = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._unsettled: collections.deque[tuple[list[str], int | None, int, str | None]] = collections.deque()
        self._flushing: asyncio.Task | None = None
        self._flusher: asyncio.Task | None = None  # retries the queue in the background
        self._flush_failed_at = -1e18

    # -- identity and limits ---------------------------------------------------------------

    @property
    def headers(self) -> frozenset[str]:
        """Request headers the server must hand to `tenant`."""
        return self.resolver.headers

    def tenant(self, headers: Mapping[str, str]) -> Tenant:
        """The request's tenant (`TenantResolver.resolve`)."""
        return self.resolver.resolve(headers)

    @staticmethod
    def limited(tenant: Tenant) -> bool:
        """Some limit applies to this tenant (else nothing is counted)."""
        return tenant.limits.limited or any(v.limited for v in tenant.models.values())

    def wants_usage(self, tenant: Tenant) -> bool:
        """Its requests' real usage is needed (token cost, a token limit, settlement on): the
        server streams their responses through itself."""
        if self.config.cost != "tokens" or not self.config.settle_from_response:
            return False
        return tenant.limits.tokens_per_minute is not None or any(v.tokens_per_minute is not None for v in tenant.models.values())

    @staticmethod
    def scopes(tenant: Tenant, model: str) -> list[ScopeLimit]:
        """The tenant's scope, and the tenant × model scope when that model has limits. Keys share
        the `{tenant}` hash tag (one Redis Cluster slot)."""

        def lim(v: int | None) -> int:
            return UNLIMITED if v is None else v

        def scope(key: str, v: LimitValues) -> ScopeLimit:
            return ScopeLimit(key, lim(v.tokens_per_minute), lim(v.requests_per_minute), lim(v.max_concurrent_requests), lim(v.burst_tokens))

        out = [scope("{%s}" % tenant.id, tenant.limits)]
        per_model = tenant.models.get(model)
        if per_model is not None and per_model.limited:
            out.append(scope("{%s}:%s" % (tenant.id, model), per_model))
        return out

    def output_budget(self, request: LLMRequest) -> int:
        """Output tokens reserved: `max_tokens` × the sequences decoded (n for each prompt of a
        batched completion, `LLMRequest.sequences`), else the model's `default_output_tokens`
        (within what its context leaves after the largest prompt, as the router's expected
        output; each prompt of a batch is its own engine request) × those sequences."""
        if request.max_tokens is not None:
            per = request.max_tokens
        else:
            default, max_len = self._models.get(request.served_model, (512, 1 << 30))
            per = min(default, max(1, max_len - request.largest_prompt))
        return per * request.sequences

    def cost(self, request: LLMRequest) -> int:
        """Tokens charged at admission (`RateLimitConfig.cost`)."""
        if self.config.cost == "size":
            return self.config.size_cost_base + max(1, request.body_bytes // 1024)
        return request.prompt_tokens + self.output_budget(request)

    # -- admission ---------------------------------------------------------------------------

    async def precheck_headers(self, tenant: Tenant) -> None:
        """Refuse at the request's headers, before its body crosses Envoy and the server, when the
        tenant's own scope cannot admit even the least request now (1 token, or the size cost of
        an empty body): its concurrency cap is full, its requests per minute are spent, or its
        window or pacing bucket is empty. A flood retrying refusals at once then costs one
        ext_proc message each. Same conditions as `precheck` (local backend always; remote only
        under pressure); charges nothing.

        Raises:
            TenantRateLimitedError: no request of this tenant could be admitted now (429).
        """
        floor = self.config.size_cost_base + 1 if self.config.cost == "size" else 1
        # Its cost is unknown before the body: the refusal counts as a request, not as tokens.
        await self._precheck(tenant, None, floor, count_tokens=False)

    async def precheck(self, tenant: Tenant, model: str, max_tokens: int | None, n: int, body_bytes: int) -> None:
        """Refuse before the prompt is tokenized when even the request's least possible cost
        does not fit now (charges nothing; `admit` decides for real).

        The least cost is the prompt's floor + `max_tokens` × n (1 × n without max_tokens; `n`:
        the sequences decoded, n for each prompt of a batched completion), or
        the size cost. The prompt's floor is 1 token for a tenant's first request, then this
        body's bytes × the tenant's lowest tokens per byte so far × `PROMPT_FLOOR_MARGIN`: a
        flood of long prompts that the window or pacing bucket cannot hold is refused before
        tokenizing, not after. A local backend is asked every time (a few µs); a remote one only for a
        tenant refused within the last second (an extra round trip only under pressure).

        Raises:
            TenantRateLimitedError: the window (or bucket, or concurrency cap) is too full for
                the least cost (429).
        """
        if self.config.cost == "size":
            floor = self.config.size_cost_base + max(1, body_bytes // 1024)
        else:
            prompt = int(body_bytes * self._tokens_per_byte.get(tenant.id, 0.0) * PROMPT_FLOOR_MARGIN)
            floor = max(1, prompt) + (max_tokens or 1) * max(1, n)
        await self._precheck(tenant, model, floor)

    async def _precheck(self, tenant: Tenant, model: str | None, floor: int, *, count_tokens: bool = True) -> None:
        """Refuse when `floor` tokens do not fit now in the tenant's scopes (`model` None: its
        own scope only). The scopes are built only past the early returns, which most requests
        take (an unlimited tenant; a remote backend not under pressure)."""
        if not self.limited(tenant):
            return
        if not self.backend.local and self._clock() - self._refused_at.get(tenant.id, -1e18) > 1.0:
            return
        scopes = self.scopes(tenant, model or "")
        if model is None:
            scopes = scopes[:1]
        if any(0 <= s.tokens < floor for s in scopes):
            return  # too large for the whole limit: admit answers the 400
        try:
            decision = await self.backend.check(scopes, floor)
        except BackendUnavailable:
            return  # admit applies the failure policy
        if not decision.admitted:
            self._metrics.child(self._metrics.requests, tenant.label, f"refused_{decision.refused_limit}").inc()
            if count_tokens:  # the least the request would have cost
                self._metrics.child(self._metrics.tokens_refused, tenant.label).inc(floor)
            self._note_refusal(tenant)
            raise self._refusal(tenant, scopes, decision, floor, ratelimit_headers(scopes, decision.uses))

    async def admit(self, tenant: Tenant, request: LLMRequest) -> Admission | None:
        """Charge the request or refuse it. None: the tenant has no limit (nothing counted).

        Raises:
            TooLargeForLimitError: the cost exceeds a whole token limit (400).
            TenantRateLimitedError: over a limit now (429, retry-after, x-ratelimit-*).
            NoEndpointError: the backend is unreachable and `redis.on_error` is `closed` (503).
        """
        if not self.limited(tenant):
            return None
        self._remember(tenant)
        scopes = self.scopes(tenant, request.served_model)
        cost = self.cost(request)
        m = self._metrics
        for s in scopes:
            if 0 <= s.tokens < cost:
                m.child(m.requests, tenant.label, "too_large").inc()
                raise TooLargeForLimitError(self._too_large(tenant, request, s, cost), param="max_tokens")
        if self.config.cost == "tokens" and request.body_bytes > 0:
            self._learn_density(tenant, request.prompt_tokens / request.body_bytes)
        keys = tuple(s.key for s in scopes)
        request_id = f"{self._id_prefix}{next(self._ids):x}" if any(s.concurrent >= 0 for s in scopes) else None
        if self._unsettled:
            await self._flush()  # before deciding: a slot held by a lost settlement comes back first
        start = time.perf_counter()
        try:
            decision = await self._acquire(scopes, cost, request_id)
        except BackendUnavailable as exc:
            m.child(m.backend_errors, self.backend.name, "acquire").inc()
            self._warn(f"rate-limit backend {self.backend.name} unavailable ({exc}); failing {self.config.redis.on_error}")
            if self.config.redis.on_error == "closed":
                m.child(m.requests, tenant.label, "backend_error_closed").inc()
                raise NoEndpointError("the rate limiter is unavailable; retry later", code="rate_limiter_unavailable") from None
            m.child(m.requests, tenant.label, "backend_error_open").inc()
            return Admission(tenant, keys, None, cost, request.prompt_tokens)
        m.child(m.decision_seconds, self.backend.name).observe(time.perf_counter() - start)
        m.child(m.window_tokens, tenant.label).set(decision.uses[0].tokens)
        m.child(m.window_requests, tenant.label).set(decision.uses[0].requests)
        if scopes[0].concurrent >= 0:
            m.child(m.inflight, tenant.label).set(decision.uses[0].inflight)
        headers = ratelimit_headers(scopes, decision.uses)
        if not decision.admitted:
            m.child(m.requests, tenant.label, f"refused_{decision.refused_limit}").inc()
            m.child(m.tokens_refused, tenant.label).inc(cost)
            self._note_refusal(tenant)
            raise self._refusal(tenant, scopes, decision, cost, headers)
        m.child(m.requests, tenant.label, "admitted").inc()
        m.child(m.tokens_charged, tenant.label).inc(cost)
        return Admission(tenant, keys, decision.bucket, cost, request.prompt_tokens, headers, self.wants_usage(tenant), request_id)

    def _learn_density(self, tenant: Tenant, tokens_per_byte: float) -> None:
        seen = self._tokens_per_byte.get(tenant.id)
        if seen is None:
            if len(self._tokens_per_byte) >= REFUSED_MEMORY:
                self._tokens_per_byte.clear()  # bounded; forgetting only costs a later tokenization
            self._tokens_per_byte[tenant.id] = tokens_per_byte
        elif tokens_per_byte < seen:
            self._tokens_per_byte[tenant.id] = tokens_per_byte

    def _note_refusal(self, tenant: Tenant) -> None:
        if len(self._refused_at) >= REFUSED_MEMORY:
            self._refused_at.clear()  # bounded: a flood of one-off keys cannot grow it
        self._refused_at[tenant.id] = self._clock()

    async def _acquire(self, scopes: list[ScopeLimit], cost: int, request_id: str | None) -> Decision:
        if self.backend.local:  # never suspends: a cancelled stream cannot lose a charge here
            return await self.backend.acquire(scopes, cost, request_id=request_id)
        # A remote call may have charged by the time a cancellation arrives: let it finish and
        # give the tokens (and the in-flight slot) back, so a client gone during the decision
        # costs nothing.
        keys = [s.key for s in scopes]
        task = asyncio.ensure_future(self.backend.acquire(scopes, cost, request_id=request_id))
        try:
            return await asyncio.shield(task)
        except BackendUnavailable as exc:
            self._abort_later(keys, cost, request_id, exc)
            raise
        except asyncio.CancelledError:

            def undo(t: asyncio.Future) -> None:
                if t.cancelled():
                    return
                exc = t.exception()
                if exc is None and t.result().admitted:
                    self._spawn(self._settle_remote(keys, t.result().bucket, -cost, request_id))
                elif isinstance(exc, BackendUnavailable):
                    self._abort_later(keys, cost, request_id, exc)

            task.add_done_callback(undo)
            raise

    def _abort_later(self, keys: list[str], cost: int, request_id: str | None, exc: BackendUnavailable) -> None:
        """An acquire holding a slot went unanswered: queue its abort (`WindowBackend.abort`). Only
        a timeout or an error reply may leave it to run later; a refused or reset connection
        never delivered it (`exc.dropped`), and an acquire without a slot costs at most its
        tokens for one window."""
        if request_id is None or exc.dropped:
            return
        self._defer((keys, None, cost, request_id))

    @staticmethod
    def _scope_name(tenant: Tenant, scope: ScopeLimit) -> str:
        model = scope.key.partition("}:")[2]
        return f"tenant {tenant.label}" + (f" on model {model}" if model else "")

    def _too_large(self, tenant: Tenant, request: LLMRequest, scope: ScopeLimit, cost: int) -> str:
        if self.config.cost == "size":
            what = f"{cost} tokens (size cost of a {request.body_bytes}-byte body)"
        else:
            what = f"{cost} tokens ({request.prompt_tokens} prompt + {self.output_budget(request)} output budget)"
        return (
            f"This request needs {what}, more than the whole limit of {scope.tokens} tokens per minute "
            f"for {self._scope_name(tenant, scope)}: it can never be admitted. Lower max_tokens or shorten the prompt."
        )

    def _refusal(self, tenant: Tenant, scopes: list[ScopeLimit], d: Decision, cost: int, headers: dict[str, str]) -> TenantRateLimitedError:
        k = d.refused_scope or 0
        scope, use = scopes[k], d.uses[k]
        kind = "tokens"
        if d.refused_limit == "concurrency":
            what, kind = f"requests in flight: Limit {scope.concurrent}, In flight {use.inflight}, Requested 1", "requests"
        elif d.refused_limit == "requests":
            what, kind = f"requests per min (RPM): Limit {scope.requests}, Used {use.requests}, Requested 1", "requests"
        elif d.refused_limit == "pacing":
            what = (
                f"tokens per min paced (TPM {scope.tokens}, burst {scope.burst}): Available {max(0, use.bucket_tokens or 0)}, "
                f"Requested {cost}"
            )
        else:
            what = f"tokens per min (TPM): Limit {scope.tokens}, Used {use.tokens}, Requested {cost}"
        msg = f"Rate limit reached for {self._scope_name(tenant, scope)} on {what}. Please try again in {duration(d.retry_after_ms)}."
        # One wait per 429: the refused kind's reset is when it admits again (the body's wait,
        # retry-after its ceiling), not when its whole window has emptied, which is up to one
        # bucket later when the window holds charges from several buckets (replies.py).
        headers = {**headers, f"x-ratelimit-reset-{kind}": duration(d.retry_after_ms)}
        return TenantRateLimitedError(msg, limit=kind, retry_after_s=d.retry_after_ms / 1000, headers=headers)

    # -- settlement ----------------------------------------------------------------------------

    @staticmethod
    def used_tokens(admission: Admission, result: Any, tokens_per_event: float = 1.0) -> int | None:
        """Tokens a finished request really cost, from its `StreamResult` (or None: keep the charge).

        usage (prompt + completion) when the response carried it; an answer ≥ 400 without
        content costs nothing; an SSE stream without usage (the client did not ask for it, or
        went away) costs our prompt count + its content events × the endpoint's learned tokens
        per event (decision 0110); a stream that never got response headers costs the prompt
        (the engine may have prefilled it); a non-streamed answer without usage keeps the charge.
        """
        if result is None or not admission.settle_by_usage:
            return None
        usage = result.usage
        prompt = usage.prompt_tokens if usage is not None and usage.prompt_tokens is not None else admission.prompt_tokens
        if usage is not None and usage.completion_tokens is not None:
            return prompt + usage.completion_tokens
        if result.status is not None and result.status >= 400 and not result.content_events:
            return 0
        if result.streaming:
            return prompt + round(result.content_events * tokens_per_event)
        if result.status is None:
            return prompt
        return None

    def settle(self, admission: Admission | None, used: int | None) -> None:
        """The request ended: correct its charge to `used` tokens (None: keep it) and release its
        in-flight slot. Runs once per admission; never raises, never suspends (a remote
        correction runs as its own task)."""
        if admission is None or admission.settled:
            return
        admission.settled = True
        if admission.bucket is None:
            return
        final = admission.charged if used is None else max(0, used)
        self._metrics.child(self._metrics.tokens_settled, admission.tenant.label).inc(final)
        if admission.request_id is not None:  # it held a slot: the gauge set at decisions drops now
            self._metrics.child(self._metrics.inflight, admission.tenant.label).dec()
        delta = final - admission.charged
        if delta == 0 and admission.request_id is None:
            return
        backend = self.backend
        if backend.local:
            backend.settle_now(admission.keys, admission.bucket, delta, request_id=admission.request_id)  # type: ignore[attr-defined]
        else:
            self._spawn(self._settle_remote(list(admission.keys), admission.bucket, delta, admission.request_id))

    def _spawn(self, coro) -> asyncio.Task:
        """Run `coro` as a task that `aclose` waits for."""
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _settle_remote(self, keys: list[str], bucket: int, delta: int, request_id: str | None = None) -> None:
        try:
            await self.backend.settle(keys, bucket, delta, request_id=request_id)
        except BackendUnavailable as exc:
            m = self._metrics
            m.child(m.backend_errors, self.backend.name, "settle").inc()
            self._warn(f"rate-limit backend {self.backend.name} unavailable at settlement ({exc}); kept until it answers again")
            self._defer((keys, bucket, delta, request_id))

    def _defer(self, entry: tuple[list[str], int | None, int, str | None]) -> None:
        """Queue a settlement (bucket None: an abort) and make sure the background retry runs."""
        m = self._metrics
        if len(self._unsettled) >= UNSETTLED_MAX:
            self._unsettled.popleft()
            m.child(m.settlements_deferred, "dropped").inc()
        self._unsettled.append(entry)
        m.child(m.settlements_deferred, "queued").inc()
        m.settlements_pending.set(len(self._unsettled))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_in_background())

    async def _flush_in_background(self) -> None:
        """Deliver the queue without waiting for a decision: a try every `FLUSH_RETRY_S` until it
        is empty (a tenant whose slots are held sends no request that would flush them)."""
        while self._unsettled:
            await asyncio.sleep(FLUSH_RETRY_S)
            await self._flush()

    async def _flush(self) -> None:
        """Deliver the queued settlements (one flush at a time; while the backend keeps failing,
        at most one try per `FLUSH_RETRY_S`). A cancelled caller leaves the flush running."""
        if self._flushing is None or self._flushing.done():
            if self._clock() - self._flush_failed_at < FLUSH_RETRY_S:
                return
            self._flushing = self._spawn(self._flush_unsettled())
        await asyncio.shield(self._flushing)

    async def _flush_unsettled(self) -> None:
        m = self._metrics
        while self._unsettled:
            batch = [self._unsettled.popleft() for _ in range(min(FLUSH_BATCH, len(self._unsettled)))]
            results = await asyncio.gather(
                *(
                    self.backend.abort(k, d, r) if b is None else self.backend.settle(k, b, d, request_id=r)  # type: ignore[arg-type]
                    for k, b, d, r in batch
                ),
                return_exceptions=True,
            )
            failed = [entry for entry, res in zip(batch, results, strict=True) if isinstance(res, BaseException)]
            m.child(m.settlements_deferred, "flushed").inc(len(batch) - len(failed))
            if failed:
                self._unsettled.extendleft(reversed(failed))  # still first in line, in order
                self._flush_failed_at = self._clock()
                break
        m.settlements_pending.set(len(self._unsettled))

    def _warn(self, message: str) -> None:
        self._backend_warning.warning("%s", message)

    # -- admin ---------------------------------------------------------------------------------

    def _remember(self, tenant: Tenant) -> None:
        if tenant.label != "other" and tenant.id not in self._seen and len(self._seen) < self.config.max_tenant_labels + len(self.config.tenants) + 1:
            self._seen[tenant.id] = tenant

    async def windows(self) -> list[dict[str, Any]]:
        """Each limited tenant's window (configured ones, and unnamed ones seen by this process):
        limits, use, remaining and resets per scope. Labels only, never keys."""
        tenants = {t.id: t for t in self.resolver.named} | self._seen
        out = []
        for t in tenants.values():
            if not self.limited(t):
                continue
            rows = []
            for model in [""] + sorted(t.models):
                scopes = self.scopes(t, model)
                scope = scopes[-1] if model else scopes[0]
                if model and len(scopes) == 1:
                    continue
                try:
                    use = (await self.backend.peek([scope])).uses[0]
                except BackendUnavailable:
                    rows.append({"model": model or None, "error": f"{self.backend.name} backend unavailable"})
                    continue
                rows.append(
                    {
                        "model": model or None,
                        "tokens_per_minute": None if scope.tokens < 0 else scope.tokens,
                        "requests_per_minute": None if scope.requests < 0 else scope.requests,
                        "max_concurrent_requests": None if scope.concurrent < 0 else scope.concurrent,
                        "burst_tokens": None if scope.burst < 0 else scope.burst,
                        "tokens": use.tokens,
                        "requests": use.requests,
                        "inflight": use.inflight,
                        "bucket_tokens": use.bucket_tokens,
                        "reset_tokens": duration(use.reset_tokens_ms),
                        "reset_requests": duration(use.reset_requests_ms),
                    }
                )
            out.append({"tenant": t.label, "named": t.named, "windows": rows})
        return out

    async def aclose(self) -> None:
        """Wait for pending settlements (bounded by the backend's timeout), try once more to deliver
        those the backend refused earlier, then close the backend."""
        if self._flusher is not None:
            self._flusher.cancel()
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._unsettled:
            await self._flush_unsettled()
        await self.backend.aclose()
