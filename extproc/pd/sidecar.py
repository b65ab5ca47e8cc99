"""`llm-extproc pd-sidecar`: the P/D two-step protocol in front of a decode engine.

The router (`extproc.scheduling.pd`) sends a disaggregated request to the decode endpoint with
the prefill endpoint in `x-prefiller-host-port` (llm-d's routing-sidecar header). This proxy,
listening where the router's destination points and forwarding to the local decode engine:

1. **Without the header**: passes the request through to the decode engine untouched (the
   router chose to prefill locally, or the request is not a generation).
2. **With it**: checks `host:port` against the allow-list — prefill-capable endpoints (`role`
   `prefill` or `both`) the router's own discovery lists now, port included (llm-d-router #979
   matched IPs only) — and answers 403 otherwise: a client-sent header must never make this
   sidecar send prompts anywhere (llm-d-router #242; Envoy and the router strip it too).
3. Sends the prefill, vLLM NIXL connector's way: the body with `max_tokens=1`, `stream=false`,
   `n=1` and `kv_transfer_params={do_remote_decode: true, do_remote_prefill: false,
   remote_engine_id/remote_block_ids/remote_host/remote_port: null}`. A 502/503/504 or a
   connection failure is retried `prefill_retries` times (bounded); a prefill with no answer
   within `prefill_timeout_s` is not (it may still be running there: a retry doubles the load
   of an engine already too slow, and the client's wait).
4. Sends the decode to the local engine: the client's body plus the returned
   `kv_transfer_params`. A streamed answer passes through untouched; a whole one gets
   `usage.prompt_tokens_details.cached_tokens` rewritten to the prefill side's count (the
   decode engine counts the pulled prompt as cached).

A failed prefill answers 502 (`prefill_failed`, with `x-llm-prefill-failed`: the router then
counts the failure against the prefill endpoint, not this decode one): it never recomputes the prompt on the decode
engine unless `local_fallback` says so (llm-d removed its silent fallback, PR #1206: it hid
broken transfers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from extproc.aio import read_at_most, start_site
from extproc.config.schema import parse_host_port
from extproc.datastore.endpoints import Datastore, canonical_address
from extproc.scheduling.pd import PREFILL_ROLES
from extproc.server.responses import PREFILL_FAILED_HEADER, PREFILLER_HEADER

__all__ = ["PDSidecar", "discovered_prefillers", "static_prefillers", "PREFILL_KV_PARAMS", "RETRY_STATUSES"]

log = logging.getLogger(__name__)

PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""The prefill request's `kv_transfer_params` (vLLM's NIXL connector, llm-d's sidecar)."""

RETRY_STATUSES = frozenset({502, 503, 504})
"""Prefill answers retried (the prefill engine or a proxy before it is briefly unavailable)."""

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
"""Paths the two-step protocol applies to; anything else passes through."""

_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length", PREFILLER_HEADER,
})  # fmt: skip


def discovered_prefillers(store: Datastore) -> Callable[[str], bool]:
    """The allow-list check over `store` (kept current by the router's discovery): True for a
    `host:port` naming a listed, not draining endpoint whose role is `prefill` or `both`. The
    port is part of the match; an IPv6 host may be written in any spelling."""

    def allows(address: str) -> bool:
        ep = store.get(canonical_address(address))
        return ep is not None and not ep.draining and ep.role in PREFILL_ROLES

    return allows


def static_prefillers(addresses: Iterable[str]) -> Callable[[str], bool]:
    """The allow-list check over fixed `host:port` pairs (canonical IPs; the port must match).

    Raises:
        ValueError: an entry that is not `host:port` with a port 1..65535.
    """
    allowed = set()
    for a in addresses:
        if parse_host_port(a)[1] == 0:
            raise ValueError(f"allow-list entry {a!r}: port must not be 0")
        allowed.add(canonical_address(a))
    return lambda address: canonical_address(address) in allowed


_ERROR_TYPES = {400: "BadRequestError", 403: "PermissionDeniedError", 502: "BadGatewayError"}
"""vLLM's `ErrorResponse.type` names its exception class; 403 and 502 are ours (the OpenAI SDK's
names for those statuses)."""


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> web.Response:
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "ServiceUnavailableError")
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": code}
    return web.Response(status=status, body=orjson.dumps({"error": body, **body}), content_type="application/json", headers=headers)


class PDSidecar:
    """The sidecar's HTTP server (module doc).

    Args:
        decode_url: the local decode engine, `http://host:port`.
        allows: the prefill allow-list check (`discovered_prefillers`, `static_prefillers`).
        host, port: where to listen (port 0: any free port; `.port` after `start`).
        prefill_retries: retries of a prefill answered 502/503/504, not reached or cut off (count
            ≥ 0); one that timed out is not retried.
        retry_backoff_s: wait before the first retry, doubled each time (seconds).
        prefill_timeout_s: time limit of one prefill attempt (seconds).
        local_fallback: after a failed prefill, decode locally without the transfer (counted
            and logged) instead of answering 502.
        max_prefill_answer_bytes: the largest prefill answer read (bytes); a longer one fails
            the prefill (a `max_tokens=1` answer is a few KiB, its block ids included).

    Raises:
        ValueError: a negative retry count or a timeout that is not > 0.
    """

    def __init__(
        self,
        decode_url: str,
        allows: Callable[[str], bool],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        prefill_retries: int = 2,
        retry_backoff_s: float = 0.05,
        prefill_timeout_s: float = 60.0,
        local_fallback: bool = False,
        max_prefill_answer_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        if prefill_retries < 0:
            raise ValueError(f"prefill_retries must be ≥ 0, got {prefill_retries}")
        if not prefill_timeout_s > 0:
            raise ValueError(f"prefill_timeout_s must be > 0, got {prefill_timeout_s}")
        self.decode_url = decode_url.rstrip("/")
        self.allows = allows
        self.host, self.port = host, port
        self.prefill_retries = prefill_retries
        self.retry_backoff_s = retry_backoff_s
        self.prefill_timeout_s = prefill_timeout_s
        self.local_fallback = local_fallback
        self.max_prefill_answer_bytes = max_prefill_answer_bytes
        self.counts: dict[str, int] = {"passthrough": 0, "disaggregated": 0, "forbidden": 0, "prefill_failed": 0, "local_fallback": 0, "prefill_retries": 0}
        """Requests by outcome, and prefill retries (counts)."""
        self._http: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen (the server, then the client session).

        Raises:
            OSError: the address cannot be bound (nothing is left open).
        """
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.port = await start_site(app, self.host, self.port, handler_cancellation=True)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False)

    async def aclose(self) -> None:
        """Stop listening and close the client session. Idempotent."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        prefiller = request.headers.get(PREFILLER_HEADER)
        if prefiller is None or request.method != "POST" or request.path not in GENERATION_PATHS:
            self.counts["passthrough"] += 1
            return await self._forward(request, self.decode_url, await request.read())
        try:
            parse_host_port(prefiller)
        except ValueError:
            self.counts["forbidden"] += 1
            return _error(403, f"{PREFILLER_HEADER} must be host:port", "prefiller_not_allowed")
        if not self.allows(prefiller):
            self.counts["forbidden"] += 1
            log.warning("refused a prefill on %r: not a prefill endpoint of the fleet", prefiller[:100])
            return _error(403, f"{PREFILLER_HEADER}: not a prefill endpoint of this fleet", "prefiller_not_allowed")
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_body")
        outcome = await self._prefill(request, prefiller, body)
        if isinstance(outcome, str):
            self.counts["prefill_failed"] += 1
            if not self.local_fallback:
                # The header tells the router whose failure this is (its outlier detection).
                return _error(502, f"prefill on {prefiller} failed: {outcome}", "prefill_failed", {PREFILL_FAILED_HEADER: "1"})
            self.counts["local_fallback"] += 1
            log.warning("prefill on %s failed (%s): decoding locally (local_fallback)", prefiller, outcome)
            return await self._forward(request, self.decode_url, raw)
        kv, cached = outcome
        self.counts["disaggregated"] += 1
        decode = orjson.dumps({**body, "kv_transfer_params": kv})
        return await self._forward(request, self.decode_url, decode, cached_tokens=None if body.get("stream") else cached)

    async def _prefill(self, request: web.Request, prefiller: str, body: dict[str, Any]) -> tuple[dict[str, Any], int] | str:
        """Run the prefill on `prefiller`; its `kv_transfer_params` and cached tokens, or why it
        failed (after the bounded retries)."""
        assert self._http is not None
        prefill = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens", "min_tokens")}
        prefill.update(max_tokens=1, stream=False, n=1, kv_transfer_params=PREFILL_KV_PARAMS)
        data = orjson.dumps(prefill)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["content-type"] = "application/json"
        # The allow-list matched the canonical spelling: reach that one (an unbracketed IPv6
        # `::1:8000` passes the check but is no URL authority).
        url = f"http://{canonical_address(prefiller)}{request.path}"
        why = "not attempted"
        for attempt in range(self.prefill_retries + 1):
            if attempt:
                self.counts["prefill_retries"] += 1
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                async with self._http.post(url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=self.prefill_timeout_s)) as resp:
                    status = resp.status
                    # Bounded: the prefill engine's answer is read whole, into this process.
                    payload = await read_at_most(resp.content, self.max_prefill_answer_bytes)
                    if payload is None:
                        return f"the answer is over {self.max_prefill_answer_bytes} bytes"
            except aiohttp.ClientError as exc:  # not reached, or the connection broke (retried)
                why = f"{type(exc).__name__}"
                continue
            except TimeoutError:
                return f"no answer within {self.prefill_timeout_s:g} s"
            if status in RETRY_STATUSES:
                why = f"status {status}"
                continue
            if status != 200:
                return f"status {status}"
            try:
                answer = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return "the answer is not JSON"
            kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if not isinstance(kv, dict):
                return "the answer has no kv_transfer_params (is the engine's KV connector configured?)"
            usage = answer.get("usage")
            details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            return kv, cached if type(cached) is int and cached >= 0 else 0
        return why

    async def _forward(self, request: web.Request, base: str, data: bytes, *, cached_tokens: int | None = None) -> web.StreamResponse:
        """Send the request to `base` with `data` as its body; stream the answer back as it
        comes, or, with `cached_tokens`, read a 200 JSON answer whole and rewrite its
        `usage.prompt_tokens_details.cached_tokens`."""
        assert self._http is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        url = f"{base}{request.path_qs}"
        try:
            upstream = await self._http.request(request.method, url, data=data if data else None, headers=headers)
        except aiohttp.ClientError as exc:
            return _error(502, f"decode engine unreachable: {type(exc).__name__}", "decode_unreachable")
        async with upstream:
            if cached_tokens is not None and upstream.status == 200:
                payload = await upstream.read()
                try:
                    answer = orjson.loads(payload)
                    usage = answer.get("usage")
                    if isinstance(usage, dict):
                        details = usage.get("prompt_tokens_details")
                        usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}), "cached_tokens": cached_tokens}
                        payload = orjson.dumps(answer)
                except (orjson.JSONDecodeError, AttributeError):
                    pass  # not the JSON we know: passed on as it came
                return web.Response(status=200, body=payload, content_type=upstream.content_type)
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-encoding":
                    resp.headers[k] = v
            if "content-encoding" in upstream.headers:
                resp.headers["content-encoding"] = upstream.headers["content-encoding"]
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
