"""The Kubernetes source: EndpointSlices chosen by a label selector, or the Pods an
InferencePool selects, kept current by list + watch.

Protocol (the API server's list/watch contract, kept by a thin aiohttp client — decision 0230):

* **list** the objects (`GET …?labelSelector=…`), replace everything known, remember the list's
  `resourceVersion`;
* **watch** from it (`?watch=1&resourceVersion=…&allowWatchBookmarks=true&timeoutSeconds=…`):
  ADDED / MODIFIED / DELETED events update the objects, BOOKMARK events only move the version;
* a watch that ends or drops (server timeout, connection reset, a proxy's idle cut) **resumes**
  from the last version seen, without a new list;
* a cycle (list if due, then watch) that lasted under `MIN_CYCLE_S`, whether it failed, was
  refused or delivered events before ending, is followed by a capped exponential backoff with
  jitter: a server or proxy that ends every watch at once (after an event or none) cannot make
  the source spin; a cycle that lasted longer resets the backoff;
* **410 Gone** (the version was compacted away), as the watch's status or as an ERROR event,
  means **relist**; so does every `resync_s` (a periodic full list repairs any missed event).

Endpoints: an EndpointSlice endpoint is ready unless `conditions.ready` is false (unset means
ready, per the API) and not `conditions.terminating`; a Pod is ready when its `Ready` condition
is True and it has no `deletionTimestamp`. An endpoint listed but not ready or terminating is
published as not ready: it takes no new requests and its in-flight ones finish
(`extproc.discovery.manager`). IPv4 and IPv6 addresses are used; FQDN slices are skipped.

Sockets: the template's `kv_events` / `kv_events_replay` / `agent` (`EndpointTemplate`) are
rendered for each address; an InferencePool's Pod may override their ports, never their host,
with `PORT_ANNOTATIONS` (an annotation that is not a port is ignored with a warning).

Malformed objects (a field of the wrong JSON type: an event that is not an object, a name that
is a list, an address that is a number, ...) are skipped with a rate-limited warning; the other
objects of the list or watch are used. An InferencePool without selector labels, or whose target
port is not an integer 1..65535, is an error: the list is retried and what was published stays.

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

from extproc.config.schema import ROLE_LABEL
from extproc.datastore.agent_client import backoff_delay
from extproc.discovery.base import SOCKET_FIELDS, Discovered, DiscoverySource, EndpointTemplate, Publish, SourceContext
from extproc.logthrottle import WarnEvery

__all__ = [
    "Params", "Source", "Gone", "ApiError", "Malformed", "SERVICE_ACCOUNT_DIR", "slice_endpoints", "pod_endpoint", "pod_socket_ports",
    "pool_selector", "object_name", "PORT_ANNOTATIONS",
]

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

MIN_CYCLE_S = 1.0
"""A list + watch cycle shorter than this (seconds) is followed by a backoff (module doc). A
watch that runs its course lasts its `timeoutSeconds`, at least 1 s (the smallest this source
asks for), so only a cut or refused one is shorter."""

PORT_ANNOTATIONS = {
    "kv_events": "llm-extproc.io/kv-events-port",
    "kv_events_replay": "llm-extproc.io/kv-events-replay-port",
    "agent": "llm-extproc.io/agent-port",
}
"""Pod annotations (InferencePool Pods only) that set one socket's port for that pod; the host is
always the pod's own IP, so a pod can move its own sockets but never point them elsewhere."""

assert tuple(PORT_ANNOTATIONS) == SOCKET_FIELDS

BACKOFF_INITIAL_S, BACKOFF_MAX_S = 0.1, 10.0
"""Backoff bounds after a short or failed cycle (seconds): `backoff_delay`'s equal jitter over
`min(max, initial · 2^attempt)`."""


class Params(EndpointTemplate):
    """`{type: kubernetes}` parameters (with `port`, `models`, `labels`, `kv_events`,
    `kv_events_replay`, `agent` of `EndpointTemplate`; a Pod's `PORT_ANNOTATIONS` override
    its sockets' ports).

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


class Malformed(ValueError):
    """An API object not of its kind's shape (an object that is not a JSON object, a field of
    the wrong JSON type); the message names the field, never the object's content."""


def _json_type(value: Any) -> str:
    """`value`'s JSON type, with its article (for error messages that must not show content)."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), f"a {type(value).__name__}")


def _field(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """`obj[key]` when it is a `kind`; `default` when it is absent or null.

    Raises:
        Malformed: it is of another type (a bool is not an int).
    """
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise Malformed(f"{key} is {_json_type(value)}")
    return value


def _objects_in(items: list[Any], what: str) -> list[Mapping[str, Any]]:
    """`items` when every one is a JSON object.

    Raises:
        Malformed: one is not.
    """
    for item in items:
        if not isinstance(item, Mapping):
            raise Malformed(f"{what} is {_json_type(item)}")
    return items


def object_name(obj: Any) -> str:
    """An object's `metadata.name`.

    Raises:
        Malformed: `obj` or its metadata is not an object, or the name is missing or not a
            string.
    """
    if not isinstance(obj, Mapping):
        raise Malformed(f"the object is {_json_type(obj)}")
    name = _field(_field(obj, "metadata", Mapping, {}), "name", str, "")
    if not name:
        raise Malformed("metadata.name is missing")
    return name


def slice_endpoints(obj: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """(ip, ready) for every address of an EndpointSlice (discovery.k8s.io/v1); FQDN slices
    give none. Ready: `conditions.ready` not false and `conditions.terminating` not true.

    Raises:
        Malformed: a field of the wrong type (endpoints not a list, an endpoint or its
            conditions not an object, an address not a string).
    """
    if not isinstance(obj, Mapping):
        raise Malformed(f"the object is {_json_type(obj)}")
    if obj.get("addressType") not in ("IPv4", "IPv6"):
        return []
    out = []
    for ep in _objects_in(_field(obj, "endpoints", list, []), "an endpoint"):
        cond = _field(ep, "conditions", Mapping, {})
        ready = cond.get("ready") is not False and cond.get("terminating") is not True
        for ip in _field(ep, "addresses", list, []):
            if not isinstance(ip, str):
                raise Malformed(f"an address is {_json_type(ip)}")
            out.append((ip, ready))
    return out


def pod_endpoint(obj: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """(ip, ready) of a Pod: none before it has an IP; ready when its `Ready` condition is True
    and it is not being deleted.

    Raises:
        Malformed: a field of the wrong type (status, metadata or a condition not an object,
            podIPs or conditions not a list, an IP not a string).
    """
    if not isinstance(obj, Mapping):
        raise Malformed(f"the object is {_json_type(obj)}")
    status = _field(obj, "status", Mapping, {})
    ips = [ip for p in _objects_in(_field(status, "podIPs", list, []), "a podIPs entry") if (ip := _field(p, "ip", str, ""))]
    if not ips and (ip := _field(status, "podIP", str, "")):
        ips = [ip]
    conditions = _objects_in(_field(status, "conditions", list, []), "a condition")
    deleting = _field(obj, "metadata", Mapping, {}).get("deletionTimestamp")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions) and not deleting
    return [(ip, ready) for ip in ips]


def object_role_labels(obj: Mapping[str, Any]) -> dict[str, str]:
    """`{"llm-d.ai/role": value}` when the object (a Pod, an EndpointSlice) carries llm-d's role
    label, else `{}`: the endpoints it lists get that P/D role (`EndpointConfig.role`).

    Raises:
        Malformed: metadata or its labels are not an object.
    """
    value = _field(_field(obj, "metadata", Mapping, {}), "labels", Mapping, {}).get(ROLE_LABEL)
    return {ROLE_LABEL: value} if isinstance(value, str) else {}


def pod_socket_ports(obj: Mapping[str, Any]) -> tuple[dict[str, int], list[str]]:
    """A Pod's socket port overrides (`PORT_ANNOTATIONS`): field → port, and the annotations
    present whose value is not a decimal port 1..65535 (ignored; the caller warns).

    Raises:
        Malformed: metadata or its annotations are not an object.
    """
    annotations = _field(_field(obj, "metadata", Mapping, {}), "annotations", Mapping, {})
    ports: dict[str, int] = {}
    bad: list[str] = []
    for name, key in PORT_ANNOTATIONS.items():
        value = annotations.get(key)
        if value is None:
            continue
        if isinstance(value, str) and value.isascii() and value.isdigit() and 1 <= int(value) <= 65535:
            ports[name] = int(value)
        else:
            bad.append(key)
    return ports, bad


def pool_selector(pool: Any) -> tuple[str, int | None]:
    """An InferencePool's Pod label selector (`k=v,...`) and target port (None if unset).

    Raises:
        ValueError: the pool has no selector labels, a field of the wrong type, or a target
            port that is not an integer 1..65535 (the message names the port).
    """
    if not isinstance(pool, Mapping):
        raise Malformed(f"the InferencePool is {_json_type(pool)}")
    spec = _field(pool, "spec", Mapping, {})
    sel = _field(spec, "selector", Mapping, {})
    labels = sel.get("matchLabels") if isinstance(sel.get("matchLabels"), Mapping) else sel
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("the InferencePool has no selector labels")
    ports = _objects_in(_field(spec, "targetPorts", list, []), "a targetPorts entry")
    port = ports[0].get("number") if ports else spec.get("targetPortNumber")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        raise ValueError(f"the InferencePool's target port {port!r} is not an integer 1..65535")
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), port


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
        self._objects: dict[str, tuple[list[tuple[str, bool]], dict[str, int], dict[str, str]]] = {}  # name → ((ip, ready), ports, labels)
        self._port = params.port
        self._selector = params.selector or ""
        self.resource_version: str | None = None
        self.lists = 0
        """Full lists done (count)."""
        self.watches = 0
        """Watches opened (count)."""
        self.relists_for_gone = 0
        """Relists forced by 410 Gone (count)."""
        self.malformed = 0
        """Objects and events skipped as malformed (count)."""
        self._warn_malformed = WarnEvery(log, 60.0)

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

    async def _get_json(self, session: aiohttp.ClientSession, path: str, query: Mapping[str, str]) -> Any:
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
        try:
            if not isinstance(body, Mapping):
                raise Malformed(f"the answer is {_json_type(body)}")
            items, meta = _field(body, "items", list, []), _field(body, "metadata", Mapping, {})
        except Malformed as exc:
            raise ApiError(f"list {self._path()}: {exc}") from None
        objects: dict[str, tuple[list[tuple[str, bool]], dict[str, int], dict[str, str]]] = {}
        for obj in items:
            try:
                objects[object_name(obj)] = self._extract(obj)
            except Malformed as exc:
                self._skip_malformed("list", exc)
        self._objects = objects
        version = meta.get("resourceVersion")
        self.resource_version = version if isinstance(version, str) and version else None
        self.lists += 1
        self._publish(publish)

    def _extract(self, obj: Mapping[str, Any]) -> tuple[list[tuple[str, bool]], dict[str, int], dict[str, str]]:
        """An object's (ip, ready) entries, for a Pod its socket port annotations (an
        invalid one is ignored with a rate-limited warning), and the labels its endpoints take
        from it: its `llm-d.ai/role` label when it has one (a Pod's, or an EndpointSlice's own).

        Raises:
            Malformed: as `pod_endpoint` / `slice_endpoints`.
        """
        if not self._params.inference_pool:
            entries = slice_endpoints(obj)
            return entries, {}, object_role_labels(obj)
        entries = pod_endpoint(obj)
        labels = object_role_labels(obj)
        ports, bad = pod_socket_ports(obj)
        if bad:
            self._warn_malformed.warning(
                "%s: pod %s: ignoring %s (not a port 1..65535); the template's value is used", self.name, object_name(obj), ", ".join(bad)
            )
        return entries, ports, labels

    def _skip_malformed(self, where: str, exc: Malformed) -> None:
        self.malformed += 1
        self._warn_malformed.warning("%s: skipping a malformed object in the %s (%s)", self.name, where, exc)

    async def _events(self, session: aiohttp.ClientSession, timeout_s: float) -> AsyncIterator[Any]:
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

    def _apply(self, event: Any) -> bool:
        """Apply one watch event; True when the endpoints changed.

        Raises:
            Gone: an ERROR event with code 410. ApiError: another ERROR event. Malformed: the
                event or its object is not of the expected shape (nothing was changed).
        """
        if not isinstance(event, Mapping):
            raise Malformed(f"the event is {_json_type(event)}")
        kind, obj = event.get("type"), _field(event, "object", Mapping, {})
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(str(obj.get("message", "")))
            raise ApiError(f"watch error event: {obj.get('code')} {obj.get('reason')}")
        version = _field(obj, "metadata", Mapping, {}).get("resourceVersion")
        if isinstance(version, str) and version:
            self.resource_version = version
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return False  # BOOKMARK (only the version moves), or a type this code does not know
        name = object_name(obj)
        if kind == "DELETED":
            return self._objects.pop(name, None) is not None
        found = self._extract(obj)
        changed = self._objects.get(name) != found
        self._objects[name] = found
        return changed

    def _publish(self, publish: Publish) -> None:
        merged: dict[str, Discovered] = {}
        for entries, ports, labels in self._objects.values():
            for ip, ready in entries:
                try:
                    cfg = self._params.endpoint(ip, self._port, labels=labels, socket_ports=ports)
                except ValueError as exc:
                    why = str(exc).splitlines()[-1].strip() if ROLE_LABEL in labels else "not an IP literal"
                    self._warn_malformed.warning("%s: skipping address %r (%s)", self.name, ip, why)
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
                began = time.monotonic()
                try:
                    if need_list or time.monotonic() - listed_at >= p.resync_s:
                        await self._list(session, publish)
                        listed_at, need_list = time.monotonic(), False
                    remaining = max(1.0, min(p.watch_timeout_s, p.resync_s - (time.monotonic() - listed_at)))
                    async for event in self._events(session, remaining):
                        try:
                            changed = self._apply(event)
                        except Malformed as exc:
                            self._skip_malformed("watch", exc)
                            continue
                        if changed:
                            self._publish(publish)
                    # The watch ended (server timeout): resume from resource_version.
                except Gone:
                    self.relists_for_gone += 1
                    log.info("%s: resource version %s expired (410 Gone); listing again", self.name, self.resource_version)
                    need_list = True
                    self.resource_version = None
                except (aiohttp.ClientError, TimeoutError, ApiError, ValueError) as exc:
                    # ValueError: a body that is not JSON. What was published stays.
                    log.warning("%s: %s; retrying", self.name, exc if isinstance(exc, ApiError) else type(exc).__name__)
                    if self.resource_version is None:
                        need_list = True
                if time.monotonic() - began >= MIN_CYCLE_S:
                    attempt = 0  # a watch that ran a while (or a slow failure): go again at once
                    continue
                # Ended at once — refused, failed, or cut after an event or none: never spin.
                await asyncio.sleep(backoff_delay(attempt, initial_s=BACKOFF_INITIAL_S, max_s=BACKOFF_MAX_S, rng=self._rng))
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
