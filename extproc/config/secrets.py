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
"""Configuration keys whose values are never echoed in a problem line; so are those of any key
`hides_value` finds a credential word in."""

_SECRET_WORDS = frozenset({"password", "passwd", "pass", "pwd", "pw", "passphrase", "secret", "secrets", "token", "auth", "credential", "credentials", "bearer"})
"""Words (a key split at `_`, `-`, `.`) that name a credential: an unknown key such as
`passwd:` beside `redis.url`, or `auth:`, holds one as surely as `password:` does."""

_SECRET_JOINED = ("apikey", "accesskey", "privatekey", "password", "secret")
"""Credential names found in a key with its separators removed (`api_key:`, `apiKey:`,
`apikey_sha256:`, `access_key:`, `private_key:` — each a place a user pastes a key)."""


_TOKEN = re.compile(r"\S+")
"""A run of non-white-space: a URL's user information (`user:password@`, or a password alone)
runs from its `://` to the token's last `@`. A password may hold `@`, `/` or a quote (redis-py
splits at the last `@`; one with `/` is not even a URL it accepts, but it is still the user's
password), so nothing but white space ends it. Found by `str.find`/`rfind` on each token, not
by one pattern: scheme, `://`, any non-space run, `@` backtracks, quadratic on a long token of
many `://` and no `@` (6 s at 64 KB; a problem line is masked before it is shortened)."""


def _mask_token(match: re.Match[str]) -> str:
    """One token with its user information, from `://` to its last `@`, replaced by `***`."""
    token = match.group(0)
    sep = token.find("://")
    at = token.rfind("@")
    if sep < 0 or at < sep + 3:  # no URL, or no user information (a scheme left out: masked all the same)
        return token
    return f"{token[: sep + 3]}***{token[at:]}"


_QUERY_SECRET = re.compile(r"(?i)([?&](?:password|passwd|pass|pwd|secret|token|auth|api_?key)=)[^&#\s'\"]*")
"""A credential in a URL's query string (`unix:///run/redis.sock?password=...`: redis-py's
documented form for a socket)."""


def mask_urls(text: str) -> str:
    """`text` with every URL's user information replaced by `***` (`redis://***@host:6379/0`):
    whether `redis://secret@host` names a user or a password depends on the client, so the whole
    of it goes; so does a credential in a query string (`?password=***`). A password holding
    white space is not recognised (percent-encode it: `%20`)."""
    return _QUERY_SECRET.sub(r"\1***", _TOKEN.sub(_mask_token, text))


def hides_value(loc: Iterable[object]) -> bool:
    """Whether a value at the configuration path `loc` (pydantic's location steps) is secret: a
    step is one of `SECRET_KEYS`, holds a credential word (`passwd`, `auth`, `x_token`), or names
    an API key (`api_key`, `apiKey`). A key such as `token_encoder` is hidden too: a value hidden
    needlessly costs a look at the file, one printed costs a credential."""
    for part in loc:
        if not isinstance(part, str):
            continue
        key = part.lower()
        words = set(re.split(r"[_\-.\s]+", key))
        joined = re.sub(r"[_\-.\s]+", "", key)
        if key in SECRET_KEYS or words & _SECRET_WORDS or any(name in joined for name in _SECRET_JOINED):
            return True
    return False
