"""`GET /v1/models` with the configured aliases: the engines list the names they serve (vLLM's
`--served-model-name`), not the aliases llm-extproc accepts (`models[].aliases`), so a client
that lists models could not discover them. The engine's answer is passed through with one entry
per alias added after its model's, a copy of that entry with the alias as `id` (OpenAI's model
object: `id`, `object`, `created`, `owned_by`; vLLM's `root`, `max_model_len` kept, so `root`
still names what serves it).

The servicer asks Envoy for the response body of that one path (`responses.MODELS_LIST_MODE`, BUFFERED:
a model list is small) and rewrites it here. An answer that is not a JSON list of models, or
not a 2xx, goes through unchanged; a model no engine listed gets no alias entry (the alias
would route to nothing).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import orjson

__all__ = ["MODELS_PATH", "is_models_list", "with_aliases"]

MODELS_PATH = "/v1/models"


def is_models_list(method: str, path: str) -> bool:
    """True for `GET /v1/models` (a query string allowed)."""
    return method == "GET" and path.split("?", 1)[0] == MODELS_PATH


def with_aliases(body: bytes, aliases: Mapping[str, Sequence[str]]) -> bytes | None:
    """The model list `body` (JSON bytes) with an entry per alias (`aliases`: canonical name →
    its aliases) after its model's entry; None to send `body` unchanged (not a model list, or
    nothing to add)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        return None
    listed = {e.get("id") for e in data}
    out: list[dict] = []
    for entry in data:
        out.append(entry)
        for alias in aliases.get(entry.get("id"), ()):  # type: ignore[arg-type]
            if alias not in listed:
                out.append({**copy.deepcopy(entry), "id": alias})
                listed.add(alias)
    if len(out) == len(data):
        return None
    return orjson.dumps({**doc, "data": out})
