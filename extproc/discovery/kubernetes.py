"""The Kubernetes source: EndpointSlices chosen by a label selector, or the Pods an
InferencePool selects, kept current by list + watch.

Protocol (the API server's list/watch contract, kept by a thin aiohttp client — decision 0230):

* **list** the objects (`GET …?labelSelector=…`), replace everything known, remember the list's
  `resourceVersion`;
* **watch** from it (`?watch=1&resourceVersion=…&allowWatchBookmarks=true&timeoutSeconds=…`):
  ADDED / MODIFIED / DELETED events update the objects, BOOKMARK events only move the version;
* a watch that ends or drops (server timeout, connection reset, a proxy's idle cut) **resumes**
  from the last version seen, without a new list; an error before any event backs off first;
* **410 Gone** (the version was compacted away), as the watch's status or as an ERROR event,
  means **relist**; so does every `resync_s` (a periodic full list repairs any missed event).

Endpoints: an EndpointSlice endpoint is ready unless `conditions.ready` is false (unset means
ready, per the API) and not `conditions.terminating`; a Pod is ready when its `Ready` condition
is True and it has no `deletionTimestamp`. An endpoint listed but not ready or terminating is
published as not ready: it takes no new requests and its in-flight ones finish
(`extproc.discovery.manager`). IPv4 and IPv6 addresses are used; FQDN slices are skipped.

Credentials: in a pod, the service account's token and CA are read from
`/var/run/secrets/kubernetes.io/serviceaccount/` and the server from `KUBERNETES_SERVICE_HOST`
/ `KUBERNETES_SERVICE_PORT`. The token file is read again for each request (bound tokens
rotate) and is never logged: errors name the URL path and status only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode

import aiohttp
import orjson
import pydantic

from extproc.datastore.agent_client import backoff_delay
from extproc.discovery.base import Discovered, DiscoverySource, EndpointTemplate, Publish, SourceContext

__all__ = ["Params", "Source", "Gone", "ApiError", "SERVICE_ACCOUNT_DIR", "slice_endpoints", "pod_endpoint", "pool_selector"]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Params(EndpointTemplate):
    """`{type: kubernetes}` parameters (with `port`, `models`, `labels` of `EndpointTemplate`).

    Exactly one of `selector` and `inference_pool`.

    Attributes:
        namespace: where to look; default: the pod's own namespace (service account), else
            `default`.
        selector: an EndpointSlice label selector (`kubernetes.io/service-name=vllm`, or any
            `key=value,key2 in (a,b)` the API accepts). Each slice endpoint's port is `port`.
        inference_pool: an InferencePool's name: its `spec.selector` picks Pods, its target
            port (`spec.targetPorts[0].number`, or `spec.targetPortNumber` before v1)
            replaces `port`, which may then be left out. The pool is read again at every full
            list.
        pool_api: the InferencePool API `group/version`.
        resync_s: full list at least this often (seconds).
        watch_timeout_s: each watch asks the server to end it after this long (seconds).
        timeout_s: time limit of a list or of connecting a watch (seconds).
        api_server: `https://host:port` of the API server; default from
            `KUBERNETES_SERVICE_HOST` / `KUBERNETES_SERVICE_PORT` (in a pod).
        token_file: the bearer token (default: the service account's); a missing file sends
            no token.
        ca_file: the CA bundle checking the server (default: the service account's; missing:
            the system's).
    """

    type: Literal["kubernetes"] = "kubernetes"
    port: int | None = pydantic.Field(default=None, ge=1, le=65535)  # type: ignore[assignment]  # the pool's own
    namespace: str | None = None
    selector: str | None = None
    inference_pool: str | None = None
    pool_api: str = "inference.networking.k8s.io/v1"
    resync_s: float = pydantic.Field(default=300.0, gt=0)
    watch_timeout_s: float = pydantic.Field(default=240.0, ge=1)
    timeout_s: float = pydantic.Field(default=10.0, gt=0)
    api_server: str | None = None
    token_file: str = str(SERVICE_ACCOUNT_DIR / "token")
    ca_file: str = str(SERVICE_ACCOUNT_DIR / "ca.crt")

    @pydantic.model_validator(mode="after")
    def _one_target(self) -> Params:
        if (self.selector is None) == (self.inference_pool is None):
            raise ValueError("set exactly one of selector (EndpointSlices) and inference_pool")
        if self.selector is not None and self.port is None:
            raise ValueError("port is required with selector (an EndpointSlice endpoint is an address; the port is yours)")
        if self.api_server is not None and not self.api_server.startswith(("https://", "http://")):
            raise ValueError(f"api_server must be an http(s):// URL, got {self.api_server!r}")
        return self


class ApiError(Exception):
    """The API server answered a request with an error status (not 410)."""


class Gone(Exception):
    """410 Gone: the resource version is too old; relist."""


def slice_endpoints(obj: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """(ip, ready) for every address of an EndpointSlice (discovery.k8s.io/v1); FQDN slices
    give none. Ready: `conditions.ready` not false and `conditions.terminating` not true."""
    if obj.get("addressType") not in ("IPv4", "IPv6"):
        return []
    out = []
    for ep in obj.get("endpoints") or ():
        cond = ep.get("conditions") or {}
        ready = cond.get("ready") is not False and cond.get("terminating") is not True
        out.extend((ip, ready) for ip in ep.get("addresses") or ())
    return out


def pod_endpoint(obj: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """(ip, ready) of a Pod: none before it has an IP; ready when its `Ready` condition is True
    and it is not being deleted."""
    status = obj.get("status") or {}
    ips = [p.get("ip") for p in status.get("podIPs") or () if p.get("ip")] or ([status["podIP"]] if status.get("podIP") else [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    ready = ready and not (obj.get("metadata") or {}).get("deletionTimestamp")
    return [(ip, ready) for ip in ips]


def pool_selector(pool: Mapping[str, Any]) -> tuple[str, int | None]:
    """An InferencePool's Pod label selector (`k=v,...`) and target port (None if unset).

    Raises:
        ValueError: the pool has no selector labels.
    """
    spec = pool.get("spec") or {}
    sel = spec.get("selector") or {}
    labels = sel.get("matchLabels") if isinstance(sel.get("matchLabels"), Mapping) else sel
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("the InferencePool has no selector labels")
    ports = spec.get("targetPorts") or []
    port = ports[0].get("number") if ports and isinstance(ports[0], Mapping) else spec.get("targetPortNumber")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), int(port) if port else None


class Source(DiscoverySource):
    """List + watch of EndpointSlices or of an InferencePool's Pods (see the module doc).

    Args:
        params: `Params`.
        ctx: unused.
        rng: backoff jitter (tests pass a seeded one).
    """

    def __init__(self, params: Params, ctx: SourceContext | None = None, *, rng: random.Random | None = None) -> None:
        self._params = params
        self.namespace = params.namespace or _own_namespace()
        target = f"inferencepool/{params.inference_pool}" if params.inference_pool else f"endpointslices[{params.selector}]"
        self.name = f"kubernetes:{self.namespace}/{target}"
        self._server = (params.api_server or _in_cluster_server()).rstrip("/")
        self._rng = rng or random.Random()
        self._objects: dict[str, list[tuple[str, bool]]] = {}
        self._port = params.port
        self._selector = params.selector or ""
        self.resource_version: str | None = None
        self.lists = 0
        """Full lists done (count)."""
        self.watches = 0
        """Watches opened (count)."""
        self.relists_for_gone = 0
        """Relists forced by 410 Gone (count)."""

    # -- HTTP ------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        try:
            token = Path(self._params.token_file).read_text(encoding="utf-8").strip()
        except OSError:
            token = ""
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self._server.startswith("https://"):
            return False
        if os.path.exists(self._params.ca_file):
            return ssl.create_default_context(cafile=self._params.ca_file)
        return True

    def _path(self) -> str:
        ns = self.namespace
        if self._params.inference_pool:
            return f"/api/v1/namespaces/{ns}/pods"
        return f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"

    async def _get_json(self, session: aiohttp.ClientSession, path: str, query: Mapping[str, str]) -> dict[str, Any]:
        url = f"{self._server}{path}" + (f"?{urlencode(query)}" if query else "")
        async with session.get(url, headers=self._headers(), timeout=aiohttp.ClientTimeout(total=self._params.timeout_s)) as resp:
            if resp.status == 410:
                raise Gone(path)
            if resp.status != 200:
                raise ApiError(f"GET {path}: status {resp.status}")
            return orjson.loads(await resp.read())

    # -- list / watch ----------------------------------------------------------------------
    async def _list(self, session: aiohttp.ClientSession, publish: Publish) -> None:
        if self._params.inference_pool:
            group_version = self._params.pool_api
            pool = await self._get_json(
                session, f"/apis/{group_version}/namespaces/{self.namespace}/inferencepools/{self._params.inference_pool}", {}
            )
            try:
                self._selector, port = pool_selector(pool)
            except ValueError as exc:
                raise ApiError(f"inferencepool {self._params.inference_pool}: {exc}") from None
            self._port = port or self._params.port
            if self._port is None:
                raise ApiError(f"inferencepool {self._params.inference_pool}: no target port, and no port configured")
        body = await self._get_json(session, self._path(), {"labelSelector": self._selector})
        extract = pod_endpoint if self._params.inference_pool else slice_endpoints
        self._objects = {(o.get("metadata") or {}).get("name", ""): extract(o) for o in body.get("items") or ()}
        self.resource_version = (body.get("metadata") or {}).get("resourceVersion")
        self.lists += 1
        self._publish(publish)

    async def _events(self, session: aiohttp.ClientSession, timeout_s: float) -> AsyncIterator[dict[str, Any]]:
        query = {
            "watch": "1",
            "labelSelector": self._selector,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        if self.resource_version:
            query["resourceVersion"] = self.resource_version
        url = f"{self._server}{self._path()}?{urlencode(query)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._params.timeout_s, sock_read=timeout_s + self._params.timeout_s)
        async with session.get(url, headers=self._headers(), timeout=timeout) as resp:
            if resp.status == 410:
                raise Gone(self._path())
            if resp.status != 200:
                raise ApiError(f"watch {self._path()}: status {resp.status}")
            self.watches += 1
            async for line in resp.content:
                if line.strip():
                    yield orjson.loads(line)

    def _apply(self, event: Mapping[str, Any]) -> bool:
        """Apply one watch event; True when the endpoints changed.

        Raises:
            Gone: an ERROR event with code 410. ApiError: another ERROR event.
        """
        kind, obj = event.get("type"), event.get("object") or {}
        meta = obj.get("metadata") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", ""))
            raise ApiError(f"watch error event: {obj.get('code')} {obj.get('reason')}")
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if kind == "BOOKMARK":
            return False
        name = meta.get("name", "")
        extract = pod_endpoint if self._params.inference_pool else slice_endpoints
        if kind == "DELETED":
            return self._objects.pop(name, None) is not None
        if kind in ("ADDED", "MODIFIED"):
            found = extract(obj)
            changed = self._objects.get(name) != found
            self._objects[name] = found
            return changed
        return False

    def _publish(self, publish: Publish) -> None:
        merged: dict[str, Discovered] = {}
        for entries in self._objects.values():
            for ip, ready in entries:
                try:
                    cfg = self._params.endpoint(ip, self._port)
                except ValueError:
                    log.warning("%s: skipping address %r (not an IP literal)", self.name, ip)
                    continue
                prev = merged.get(cfg.address)
                # The same address in two slices (a slice being replaced): ready if either says so.
                merged[cfg.address] = Discovered(cfg, ready or (prev is not None and prev.ready))
        publish(merged)

    async def run(self, publish: Publish) -> None:
        p = self._params
        attempt = 0
        need_list = True
        listed_at = 0.0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self._ssl())) as session:
            while True:
                try:
                    if need_list or time.monotonic() - listed_at >= p.resync_s:
                        await self._list(session, publish)
                        listed_at, need_list = time.monotonic(), False
                    remaining = max(1.0, min(p.watch_timeout_s, p.resync_s - (time.monotonic() - listed_at)))
                    started, events = time.monotonic(), 0
                    async for event in self._events(session, remaining):
                        events += 1
                        if self._apply(event):
                            self._publish(publish)
                        attempt = 0
                    if events or time.monotonic() - started >= 1.0:
                        continue  # the watch ended (server timeout): resume from resource_version
                    # An empty watch that ended at once: back off rather than spin.
                except Gone:
                    self.relists_for_gone += 1
                    log.info("%s: resource version %s expired (410 Gone); listing again", self.name, self.resource_version)
                    need_list = True
                    self.resource_version = None
                    continue
                except (aiohttp.ClientError, TimeoutError, ApiError, ValueError) as exc:
                    # ValueError: a body that is not JSON. What was published stays.
                    log.warning("%s: %s; retrying", self.name, exc if isinstance(exc, ApiError) else type(exc).__name__)
                    if self.resource_version is None:
                        need_list = True
                await asyncio.sleep(backoff_delay(attempt, initial_s=0.1, max_s=10.0, rng=self._rng))
                attempt += 1


def _own_namespace() -> str:
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text(encoding="utf-8").strip() or "default"
    except OSError:
        return "default"


def _in_cluster_server() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return "https://kubernetes.default.svc"
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
