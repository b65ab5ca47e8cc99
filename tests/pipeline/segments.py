"""The reference for `TokenCounter._segments`: cuts found by `re.finditer` over the counter's cut
regex (a segment starts at each added token), which its `str.find` scan must equal."""

from __future__ import annotations

import re


def segments_by_finditer(cut: re.Pattern[str], text: str) -> list[str]:
    """`text` cut before every match of `cut` (no empty segment; "" gives [""])."""
    out, last = [], 0
    for m in cut.finditer(text):
        if m.start() > last:
            out.append(text[last : m.start()])
            last = m.start()
    if last < len(text) or not out:
        out.append(text[last:])
    return out
