"""Tenants and token rate limits over a sliding one-minute window, in memory or in Redis.

Modules: `config` (the `ratelimit:` section), `tenant` (who a request belongs to), `window` (the
bucket arithmetic), `backend` (the interface), `memory` / `redis_backend` (+ `redis_window.lua`)
(the two backends), `replies` (headers and errors clients see), `metrics`, `limiter` (admit and
settle, called by the ext_proc server). Decision record: docs/decisions/0110-rate-limits.md.
"""
