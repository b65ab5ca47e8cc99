"""Keep credentials out of what the configuration's checks print.

The configuration holds credentials in two forms: a URL's user information (`ratelimit.redis.url`,
`redis://user:password@host:6379/0`) and API keys (`ratelimit.tenants.*.api_key_sha256` takes
SHA-256 digests, but a user may paste the key itself, and a problem there echoed it). A problem
line echoes the offending value (`describe_error`), so an unknown key beside `redis`, or a `redis:`
given a URL instead of a mapping, printed the password.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["HIDDEN", "SECRET_KEYS", "hides_value", "mask_urls"]

HIDDEN = "<hidden>"
"""What stands for a value that is not printed."""

SECRET_KEYS = frozenset({"api_key_sha256", "password", "token", "secret"})
"""Configuration keys whose values are never echoed in a problem line."""

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]*@")
"""A URL's user information (`user:password@`, or a password alone), up to its last `@` before the host."""


def mask_urls(text: str) -> str:
    """`text` with every URL's user information replaced by `***` (`redis://***@host:6379/0`):
    whether `redis://secret@host` names a user or a password depends on the client, so the whole
    of it goes."""
    return _USERINFO.sub(r"\1***@", text)


def hides_value(loc: Iterable[object]) -> bool:
    """Whether a value at the configuration path `loc` (pydantic's location steps) is secret: a
    step is one of `SECRET_KEYS`."""
    return any(isinstance(part, str) and part.lower() in SECRET_KEYS for part in loc)
