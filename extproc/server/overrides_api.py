"""The admin server's write side: operator weight overrides, authenticated.

    POST /api/v1/weights/override   {"endpoint": "ip:port", "action": "lower"|"drain"|"clear",
                                     "factor": 0.25, "duration_s": 300, "reason": "..."}
    POST /api/v1/alerts             Alertmanager's webhook payload (version 4)

Both need `Authorization: Bearer <token>`; the token comes from `LLM_EXTPROC_ADMIN_TOKEN`, or
from the file named by `LLM_EXTPROC_ADMIN_TOKEN_FILE` (a mounted Kubernetes Secret; surrounding
whitespace stripped). Without a configured token both answer 403 to everyone; a missing or
wrong one gets 401. The comparison is constant-time (`hmac.compare_digest`) and the token never
reaches a log line, a response or a metric label.

An Alertmanager alert moves a weight when its labels carry `endpoint` (an `ip:port` of a
configured endpoint) and `weight_action` (`lower` or `drain`) — the rules in
deploy/prometheus/alerts.yml put them there; an alert without them only notifies. Annotations
may set `weight_factor` and `weight_duration_s`. Firing alerts set (or renew) the override; resolved ones are ignored: the
override runs out by itself (`extproc.datastore.overrides`). With `replicas.sync: redis` an
override applied here is passed to every other replica (the Service sends each request to one).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from extproc.datastore.endpoints import Datastore
from extproc.datastore.overrides import DEFAULT_DURATION_S, DEFAULT_LOWER_FACTOR, set_override
from extproc.metrics import Metrics

__all__ = ["OVERRIDE_PAGES", "OverridesAPI", "load_admin_token", "TOKEN_ENV", "TOKEN_FILE_ENV"]

log = logging.getLogger(__name__)

TOKEN_ENV = "LLM_EXTPROC_ADMIN_TOKEN"
TOKEN_FILE_ENV = "LLM_EXTPROC_ADMIN_TOKEN_FILE"
_ACTIONS = ("lower", "drain", "clear")

OVERRIDE_PAGES: dict[tuple[str, str], str] = {
    ("POST", "/api/v1/weights/override"): "lower, drain or clear one endpoint for a while (bearer token)",
    ("POST", "/api/v1/alerts"): "Alertmanager's webhook: firing alerts with endpoint and weight_action labels move weights (bearer token)",
}
"""The write routes, for the admin server's index page."""


def load_admin_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The admin write token from the environment, or None when none is configured.

    Raises:
        ValueError: the token file cannot be read, is not UTF-8 or is empty (message names the
            variable, never the content).
    """
    env = os.environ if environ is None else environ
    path = env.get(TOKEN_FILE_ENV)
    if path:
        try:
            token = open(path, encoding="utf-8").read().strip()
        except OSError as exc:
            raise ValueError(f"{TOKEN_FILE_ENV}: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:  # its own message quoted a byte and named no variable
            raise ValueError(f"{TOKEN_FILE_ENV}: {path} is not UTF-8 text") from None
        if not token:
            raise ValueError(f"{TOKEN_FILE_ENV}: {path} is empty")
        return token
    token = env.get(TOKEN_ENV, "").strip()
    return token or None


class _BadRequest(Exception):
    pass


def _number(raw: Any, what: str, default: float) -> float:
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise _BadRequest(f"{what} must be a number, got {raw!r}") from None
    if value != value:
        raise _BadRequest(f"{what} must be a number, got NaN")
    return value


class OverridesAPI:
    """Handlers for the two write routes.

    Args:
        store: the endpoints whose `override` field is set.
        metrics: `weight_overrides` counts what was applied.
        token: the bearer token; None refuses every request (403).
        share: called with `(address, factor, duration_s, reason, source)` for every override
            applied here, to pass it to the other replicas (`ReplicaSync.override`); None: this
            replica only.
    """

    def __init__(self, store: Datastore, metrics: Metrics, token: str | None, share: Callable[[str, float, float, str, str], None] | None = None) -> None:
        self._share = share
        self._store = store
        self._metrics = metrics
        self._token = token.encode() if token else None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/api/v1/weights/override", self._override)
        app.router.add_post("/api/v1/alerts", self._alerts)

    def _authorized(self, request: web.Request) -> web.Response | None:
        """None when the request carries the token, else the refusal to send."""
        if self._token is None:
            return web.json_response({"error": f"weight overrides are disabled: set {TOKEN_ENV} or {TOKEN_FILE_ENV}"}, status=403)
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._token):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401, headers={"www-authenticate": "Bearer"})
        return None

    async def _json(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            raise _BadRequest("body must be JSON") from None

    def _apply(self, endpoint: Any, action: Any, factor_raw: Any, duration_raw: Any, reason: str, source: str) -> dict:
        if not isinstance(endpoint, str) or self._store.get(endpoint) is None:
            raise _BadRequest(f"unknown endpoint {endpoint!r}; configured: {sorted(ep.address for ep in self._store.all())}")
        if action not in _ACTIONS:
            raise _BadRequest(f"action must be one of {list(_ACTIONS)}, got {action!r}")
        duration = _number(duration_raw, "duration_s", DEFAULT_DURATION_S)
        factor = {"drain": 0.0, "clear": 1.0}.get(action) if action != "lower" else _number(factor_raw, "factor", DEFAULT_LOWER_FACTOR)
        if action == "lower" and not 0.0 < factor < 1.0:
            raise _BadRequest(f"factor of a lower override must be in (0, 1), got {factor}")
        ep = self._store.get(endpoint)
        try:
            ov = set_override(ep, factor, duration, reason=reason, source=source)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from None
        self._metrics.weight_overrides.labels(source, action).inc()
        if self._share is not None:
            self._share(endpoint, factor, duration, reason, source)
        log.warning("weight override %s on %s (factor %s, %ss, source %s, reason %r)", action, endpoint, factor, duration, source, reason)
        return describe(ov, time.monotonic()) | {"endpoint": endpoint, "action": action}

    async def _override(self, request: web.Request) -> web.Response:
        refused = self._authorized(request)
        if refused is not None:
            return refused
        try:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise _BadRequest("body must be a JSON object")
            unknown = set(body) - {"endpoint", "action", "factor", "duration_s", "reason"}
            if unknown:
                raise _BadRequest(f"unknown keys {sorted(unknown)}")
            reason = str(body.get("reason", ""))
            row = self._apply(body.get("endpoint"), body.get("action", "lower"), body.get("factor"), body.get("duration_s"), reason, "api")
        except _BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(row)

    async def _alerts(self, request: web.Request) -> web.Response:
        refused = self._authorized(request)
        if refused is not None:
            return refused
        try:
            body = await self._json(request)
            alerts = body.get("alerts") if isinstance(body, dict) else None
            if not isinstance(alerts, list):
                raise _BadRequest("not an Alertmanager webhook payload (no alerts list)")
        except _BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        applied, skipped = [], []
        for alert in alerts:
            labels = alert.get("labels") if isinstance(alert, dict) else None
            if not isinstance(labels, dict) or alert.get("status") != "firing" or "endpoint" not in labels or "weight_action" not in labels:
                why = "resolved, or no endpoint / weight_action label"
                skipped.append({"alertname": labels.get("alertname") if isinstance(labels, dict) else None, "why": why})
                continue
            notes = alert.get("annotations") if isinstance(alert.get("annotations"), dict) else {}
            try:
                applied.append(
                    self._apply(
                        labels["endpoint"], labels["weight_action"], notes.get("weight_factor"),
                        notes.get("weight_duration_s"), str(labels.get("alertname", "")), "alertmanager",
                    )
                )  # fmt: skip
            except _BadRequest as exc:
                skipped.append({"alertname": labels.get("alertname"), "why": str(exc)})
        return web.json_response({"applied": applied, "skipped": skipped})


def describe(ov: Any, now: float) -> dict:
    """An override as JSON for /api/v1/weights (None-safe: no active override → factor 1)."""
    if ov is None or not ov.active(now):
        return {"factor": 1.0, "expires_in_s": None, "reason": None, "source": None}
    return {"factor": ov.factor, "expires_in_s": round(ov.expires_at - now, 3), "reason": ov.reason, "source": ov.source}
