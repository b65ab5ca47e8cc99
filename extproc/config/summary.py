"""A valid configuration in one line, for `llm-extproc check-config`: what it serves, where its
endpoints come from, how it routes. Credentials never appear (`extproc.config.secrets`)."""

from __future__ import annotations

from extproc.config.schema import Config
from extproc.config.secrets import mask_urls

__all__ = ["config_summary"]


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def config_summary(cfg: Config) -> str:
    """One line: models (each with its tokenizer and architecture, so a model counted with
    another's tokenizer shows), endpoint sources (the static list's size), the routing profile
    among those defined, the listen addresses, and the Redis URL when rate limits or replica
    sync use it (its user information masked), and flow control with the Envoy timeout it needs when on."""
    models = ", ".join(f"{m.name}: tokenizer {m.tokenizer}, architecture {m.architecture}" for m in cfg.models)
    sources = [
        f"static ({_count(len(cfg.endpoints), 'endpoint')})" if p.type == "static" else str(p.type) for p in cfg.discovery.sources
    ]
    sched = cfg.scheduling
    parts = [
        f"{_count(len(cfg.models), 'model')} ({models})",
        f"endpoints from {', '.join(sources)}",
        f"profile {sched.profile} (of {len(sched.all_profiles())})",
        f"listens on {cfg.listen.grpc} (ext_proc), {cfg.listen.admin} (admin)",
    ]
    users = [what for what, on in (("rate limits", cfg.ratelimit.enabled and cfg.ratelimit.backend == "redis"), ("replica sync", cfg.replicas.sync == "redis")) if on]
    if users:
        parts.append(f"{' and '.join(users)} through {mask_urls(cfg.ratelimit.redis.url)}")
    fc = cfg.flow_control
    if fc.enabled:
        need = fc.message_timeout_s(cfg.limits.decision_timeout_ms)
        parts.append(f"flow control ({fc.fairness} fairness, {fc.gate.mode} gate; Envoy's ext_proc message_timeout must be >= {need:g} s)")
    return "; ".join(parts)
