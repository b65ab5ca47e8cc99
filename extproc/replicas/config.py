"""Configuration of replica sync (`replicas:` in the config file).

Shape::

    replicas:
      sync: redis              # or off (default): each replica decides on its own state only
      channel: "llm-extproc:replicas"
      heartbeat_s: 0.5
      owner_timeout_s: 3.0

The Redis server and its connection settings are the rate limiter's (`ratelimit.redis`: url,
timeout_ms): one Redis for everything the replicas share, configured once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from extproc.config_base import Strict, yaml_off

__all__ = ["ReplicasConfig"]


class ReplicasConfig(Strict):
    """How replicas share their decisions.

    Attributes:
        sync: `redis` publishes this replica's picks, first tokens and releases on a Redis
            pub/sub channel and applies the other replicas' (on `ratelimit.redis.url`); `off`
            keeps every replica's state its own.
        channel: the pub/sub channel (every replica of one fleet uses the same one).
        heartbeat_s: seconds between two heartbeats; each carries the ids of the replica's open
            reservations, so a release lost in transit is undone by the next one.
        owner_timeout_s: a replica not heard from for this long is gone: everything it held is
            released (seconds; larger than `heartbeat_s`).
        flush_ms: least milliseconds between two PUBLISHes of this replica; events queued in
            between go in one batch (one PUBLISH costs ~0.1 ms of CPU with redis-py, so this
            bounds sync's CPU at ~1000 / flush_ms publishes a second, adding at most flush_ms
            to the delay under load).
        max_queue: events waiting to be published (count); beyond it new events are dropped
            and counted, never waited for.
        max_remote: remote reservations held at once, all replicas together (count).
        max_hashes: prefix blocks shared per pick (count; the longest prompts share their first
            `max_hashes` blocks).
    """

    sync: Literal["off", "redis"] = "off"
    channel: str = Field(default="llm-extproc:replicas", min_length=1)
    heartbeat_s: float = Field(default=0.5, gt=0, le=60)
    owner_timeout_s: float = Field(default=3.0, gt=0, le=600)
    flush_ms: float = Field(default=5.0, ge=0, le=1000)
    max_queue: int = Field(default=10_000, ge=1)
    max_remote: int = Field(default=100_000, ge=1)
    max_hashes: int = Field(default=4096, ge=1)

    @field_validator("sync", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        return yaml_off(v)

    @model_validator(mode="after")
    def _timeout_above_heartbeat(self) -> ReplicasConfig:
        if self.owner_timeout_s <= 2 * self.heartbeat_s:
            raise ValueError(
                f"replicas.owner_timeout_s ({self.owner_timeout_s}) must exceed twice heartbeat_s ({self.heartbeat_s}): "
                "a replica must miss at least two heartbeats before its reservations are dropped"
            )
        return self
