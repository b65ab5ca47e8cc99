"""`mask_urls` on what a problem line may hold: every URL's user information masked, in time
linear in the text (a problem line is masked before it is shortened, and a key or name in it
may be a megabyte)."""

from __future__ import annotations

import time

from extproc.config.secrets import mask_urls


def test_a_long_token_of_schemes_is_masked_in_linear_time() -> None:
    """A pattern of scheme, any non-space run, then `@` backtracked on a token of many `://` and
    no `@`: 64 KB took 6 s, 128 KB would take about 24."""
    text = "a://" * 32_000
    started = time.perf_counter()
    assert mask_urls(text) == text
    assert time.perf_counter() - started < 1.0
    assert mask_urls(text + "u:hunter2@h") == "a://***@h"


def test_user_information_is_masked_to_the_last_at_of_its_token() -> None:
    assert mask_urls("(got 'redis://app:p@ss/x@h:6379/0'), see ops@example.com") == "(got 'redis://***@h:6379/0'), see ops@example.com"
    assert mask_urls("://:hunter2@h") == "://***@h"  # no scheme: masked all the same
    assert mask_urls("redis://h:6379/0 and mailto:ops@example.com") == "redis://h:6379/0 and mailto:ops@example.com"
