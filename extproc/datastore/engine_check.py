"""Cross-check the router's token counts and context limit against each engine's own.

The router counts every prompt with the tokenizer its config names (`models[].tokenizer`); the
engine counts with the one it loaded. When they differ — another model's tokenizer, another
chat template, a `max_model_len` the engine was started with — every context-length check, KV
admission and rate-limit charge is wrong, and nothing else would say so (docs/decisions/0290).

So, off the request path, for each endpoint and each configured model it serves, when the
endpoint joins (at start, by discovery or a reload) and every `RECHECK_S` after:

- `GET /v1/models`: the entry whose `id` is the model, its `max_model_len` (vLLM's field);
- `POST /tokenize` (vLLM's route, `{"model", "prompt"}` or `{"model", "messages"}` →
  `{"count", "max_model_len", "tokens"}`) on `CHECK_PROMPTS` and `CHECK_CHAT`, each compared
  with the router's own count of the same text (`TokenCounter.count_text`, `count_chat`).

Outcomes (`EngineCheck.outcome`): `match`; `mismatch` (a count or `max_model_len` differs:
an ERROR line, `llm_extproc_engine_check_mismatches_total{model}`, and with
`engine_check: drain` a weight override of 0 on the endpoint, renewed while it lasts);
`unverified` (no `/tokenize` on the engine — 404, 405, 501 — or an answer without a count: not
retried until the next `RECHECK_S`; or unreachable, a timeout, 5xx: retried with backoff from
`RETRY_FIRST_S` to `RETRY_MAX_S`). `llm_extproc_engine_check_endpoints{model,outcome}` counts
endpoints by their latest outcome (labels bounded by the configured models).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.aio import cancel_and_wait, read_at_most
from extproc.datastore.endpoints import Endpoint
from extproc.datastore.overrides import MAX_DURATION_S, set_override

__all__ = [
    "CHECK_CHAT", "CHECK_PROMPTS", "EngineCheck", "EngineChecker", "MAX_ANSWER_BYTES", "OUTCOMES", "OVERRIDE_SOURCE", "RECHECK_S",
    "RETRY_FIRST_S", "RETRY_MAX_S", "TIMEOUT_S", "USER_AGENT",
]  # fmt: skip

log = logging.getLogger(__name__)

OUTCOMES = ("match", "mismatch", "unverified")

CHECK_PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. It was 3:45 p.m. on 2024-07-01; the bill came to $1,234.56.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint([fib(i) for i in range(10)])",
    "Größenwahn naïveté café — 東京都の天気は晴れです。北京欢迎你！ 🚀🔥 مرحبا بالعالم",
)
"""Fixed completion prompts (prose and numbers, code and whitespace, accents, CJK, emoji, Arabic):
texts on which tokenizers of different families give different counts."""

CHECK_CHAT: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
)
"""A fixed chat conversation: its count includes the chat template, which the prompts' do not."""

TIMEOUT_S = 5.0
"""Timeout of one check request (seconds): `/tokenize` on a short text answers in milliseconds."""
RETRY_FIRST_S = 1.0
"""First retry after an unreachable engine (seconds); doubled on each failure."""
RETRY_MAX_S = 60.0
"""Longest retry interval (seconds): an engine still loading its weights is asked once a minute."""
RECHECK_S = 600.0
"""Interval between checks of an endpoint once answered (seconds): an engine restarted with
another model behind the same address is found within it."""
MAX_CONCURRENT = 8
"""Checks running at once: a discovery that adds a thousand endpoints asks eight at a time."""
USER_AGENT = "llm-extproc-engine-check"
"""The checks' `User-Agent`: an engine's access log tells them from clients' requests."""
OVERRIDE_SOURCE = "engine-check"
"""`WeightOverride.source` of a drain set by a mismatch (`engine_check: drain`)."""
MAX_ANSWER_BYTES = 1 << 20
"""Largest answer read from an engine (bytes): a `/tokenize` answer on the fixed texts is a few
hundred bytes, a `/v1/models` listing a few KB per model; past it the answer is not read on (the
check is `unverified`), so a hostile or broken engine cannot fill the server's memory."""
_NO_TOKENIZE = frozenset({404, 405, 501})


@dataclass(slots=True)
class EngineCheck:
    """The latest check of one model on one endpoint.

    Attributes:
        outcome: `match`, `mismatch` or `unverified` (see the module).
        detail: what differed, or why it is unverified ("" on a match).
        checked_at: `time.time()` of the check (seconds since the epoch).
        engine_max_model_len: the engine's `max_model_len` (tokens), or None when it did not say.
        counts: per checked text (`prompt[i]`, `chat`), `[router, engine]` counts (tokens).
    """

    outcome: str
    detail: str = ""
    checked_at: float = 0.0
    engine_max_model_len: int | None = None
    counts: dict[str, list[int]] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """The admin page's view (JSON-ready)."""
        return {
            "outcome": self.outcome,
            "detail": self.detail,
            "checked_at": round(self.checked_at, 3),
            "engine_max_model_len": self.engine_max_model_len,
            "counts": self.counts,
        }


class _Unreachable(Exception):
    """The engine did not answer usefully now (connection, timeout, 5xx): retry later."""


class _Hostile(Exception):
    """The engine's answer is larger than `MAX_ANSWER_BYTES`: unverified until the next re-check."""


@dataclass(frozen=True, slots=True)
class _Expected:
    """The router's own counts of the fixed texts for one model, and its configured limit."""

    prompts: tuple[int, ...]
    chat: int | None
    max_model_len: int


class EngineChecker:
    """Checks every endpoint's engine against the router's counts (see the module).

    Args:
        models: canonical model name → (configured `max_model_len` in tokens, `engine_check`
            mode: `warn`, `drain` or `off`); `off` models are not checked.
        registry: where its metrics are registered.
        timeout_s, retry_first_s, retry_max_s, recheck_s: see the module's constants (seconds).
    """

    def __init__(
        self,
        models: Mapping[str, tuple[int, str]],
        registry: CollectorRegistry,
        *,
        timeout_s: float = TIMEOUT_S,
        retry_first_s: float = RETRY_FIRST_S,
        retry_max_s: float = RETRY_MAX_S,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self._models = {name: spec for name, spec in models.items() if spec[1] != "off"}
        self._timeout_s = timeout_s
        self._retry = (retry_first_s, retry_max_s)
        self._recheck_s = recheck_s
        self._expected: dict[str, _Expected] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pending: dict[str, Endpoint] = {}
        self._session: aiohttp.ClientSession | None = None
        self._starting: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)
        self.endpoints = Gauge(
            "llm_extproc_engine_check_endpoints",
            "Endpoints by the outcome of the latest check of the engine's /tokenize counts and max_model_len "
            "against the router's (match, mismatch, unverified)",
            ["model", "outcome"],
            registry=registry,
        )
        self.mismatches = Counter(
            "llm_extproc_engine_check_mismatches_total",
            "Checks that found an engine counting a model's tokens, or limiting its context, otherwise than the router",
            ["model"],
            registry=registry,
        )
        for name in self._models:
            for outcome in OUTCOMES:
                self.endpoints.labels(name, outcome).set(0)
            self.mismatches.labels(name)

    async def start(self, counters: Mapping[str, Any]) -> None:
        """Begin in the background and return at once, so that serving does not wait on it:
        count the fixed texts with each model's tokenizer (`counters`: canonical model name →
        `TokenCounter`; in a thread, ~ms per model, more on a chat template's first use), then
        check every endpoint added so far."""
        if not self._models:
            return
        self._starting = asyncio.create_task(self._begin(counters), name="engine-check-start")

    async def _begin(self, counters: Mapping[str, Any]) -> None:
        self._expected = await asyncio.to_thread(self._count_expected, counters)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            connector=aiohttp.TCPConnector(limit=MAX_CONCURRENT),
            headers={"user-agent": USER_AGENT},
        )
        pending, self._pending = self._pending, {}
        for ep in pending.values():
            self.add(ep)

    def _count_expected(self, counters: Mapping[str, Any]) -> dict[str, _Expected]:
        out = {}
        for name, (max_model_len, _) in self._models.items():
            counter = counters.get(name)
            if counter is None:  # a runtime set without this model (tests): nothing to compare
                continue
            prompts = tuple(counter.count_text(text).count for text in CHECK_PROMPTS)
            chat = counter.count_chat(list(CHECK_CHAT)).count if counter.has_chat_template else None
            out[name] = _Expected(prompts, chat, max_model_len)
        return out

    def add(self, ep: Endpoint) -> None:
        """An endpoint joined (or the checker starts): check it now and every `recheck_s`.
        Before `start`, it is remembered and checked then."""
        if not any(m in self._models for m in ep.models):
            return
        if self._session is None:
            self._pending[ep.address] = ep
            return
        old = self._tasks.pop(ep.address, None)
        if old is not None:
            old.cancel()
        task = asyncio.create_task(self._watch(ep), name=f"engine-check-{ep.address}")
        self._tasks[ep.address] = task

    def forget(self, ep: Endpoint) -> None:
        """An endpoint left: stop checking it; its outcomes leave the gauge."""
        self._pending.pop(ep.address, None)
        task = self._tasks.pop(ep.address, None)
        if task is not None:
            task.cancel()
        for model, check in (ep.engine_check or {}).items():
            if model in self._models:
                self.endpoints.labels(model, check.outcome).dec()
        ep.engine_check = None

    async def aclose(self) -> None:
        if self._starting is not None:
            await cancel_and_wait([self._starting])
        await cancel_and_wait(list(self._tasks.values()))
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _watch(self, ep: Endpoint) -> None:
        """Check `ep` until cancelled: retry an unreachable engine with backoff, else wait
        `recheck_s` between checks."""
        delay = self._retry[0]
        while True:
            async with self._slots:
                unreachable = await self.check(ep)
            if unreachable:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry[1])
            else:
                delay = self._retry[0]
                await asyncio.sleep(self._recheck_s)

    async def check(self, ep: Endpoint) -> bool:
        """Check every configured model `ep` serves once, record the outcomes on
        `ep.engine_check` and in the metrics, and act on a mismatch. Returns whether some
        model's engine was unreachable (worth a retry soon)."""
        unreachable = False
        for model in sorted(m for m in ep.models if m in self._expected):
            try:
                result = await self._check_model(ep, model)
            except _Unreachable as exc:
                result = EngineCheck("unverified", f"engine unreachable: {exc}", time.time())
                unreachable = True
            except _Hostile as exc:
                result = EngineCheck("unverified", f"answer refused: {exc}", time.time())
            except Exception:  # an answer shaped as nothing foreseen: say so, keep checking
                log.exception("endpoint %s: engine check of model %s failed", ep.address, model)
                result = EngineCheck("unverified", "the engine's answer could not be read", time.time())
            self._record(ep, model, result)
        return unreachable

    async def _get_json(self, url: str, body: Any = None) -> tuple[int, Any]:
        """`(status, parsed JSON or None)` of a GET (`body` None) or POST.

        Raises:
            _Unreachable: no connection, a timeout, or a 5xx other than 501.
            _Hostile: an answer over `MAX_ANSWER_BYTES` (not read past that).
        """
        assert self._session is not None
        try:
            call = self._session.get(url) if body is None else self._session.post(url, json=body)
            async with call as resp:
                if resp.status >= 500 and resp.status != 501:
                    raise _Unreachable(f"HTTP {resp.status} from {url}")
                raw = await read_at_most(resp.content, MAX_ANSWER_BYTES)
                if raw is None:
                    raise _Hostile(f"{url} answered more than {MAX_ANSWER_BYTES} bytes")
                try:
                    data = orjson.loads(raw)  # nesting past 1,024 levels: a JSONDecodeError, not a RecursionError
                except orjson.JSONDecodeError:
                    data = None
                return resp.status, data
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _Unreachable(f"{type(exc).__name__} on {url}") from None

    async def _check_model(self, ep: Endpoint, model: str) -> EngineCheck:
        want = self._expected[model]
        base = f"http://{ep.address}"
        result = EngineCheck("match", "", time.time())
        problems: list[str] = []
        unverified: list[str] = []
        status, listing = await self._get_json(f"{base}/v1/models")
        engine_len = _listed_max_model_len(listing, model) if status == 200 else None
        if status == 200:
            ep.listed_adapters = listed_adapters(listing)
        texts: list[tuple[str, dict[str, Any], int]] = [
            (f"prompt[{i}]", {"model": model, "prompt": text}, n) for i, (text, n) in enumerate(zip(CHECK_PROMPTS, want.prompts))
        ]
        if want.chat is not None:
            texts.append(("chat", {"model": model, "messages": list(CHECK_CHAT), "add_generation_prompt": True}, want.chat))
        for what, body, mine in texts:
            status, data = await self._get_json(f"{base}/tokenize", body)
            if status in _NO_TOKENIZE:
                unverified.append(f"the engine serves no /tokenize (HTTP {status})")
                break
            count = data.get("count") if isinstance(data, dict) else None
            if status != 200 or not isinstance(count, int) or isinstance(count, bool):
                unverified.append(f"/tokenize answered HTTP {status} without a count")
                break
            result.counts[what] = [mine, count]
            if engine_len is None and isinstance(data.get("max_model_len"), int):
                engine_len = data["max_model_len"]
            if count != mine:
                problems.append(f"{what}: the router counts {mine} tokens, the engine {count}")
        result.engine_max_model_len = engine_len
        if engine_len is None:
            unverified.append("the engine reports no max_model_len")
        elif engine_len != want.max_model_len:
            problems.append(f"max_model_len: the router's config says {want.max_model_len}, the engine {engine_len}")
        if problems:
            result.outcome = "mismatch"
            result.detail = "; ".join(problems)
        elif unverified:
            result.outcome = "unverified"
            result.detail = "; ".join(unverified)
        return result

    def _record(self, ep: Endpoint, model: str, result: EngineCheck) -> None:
        checks = ep.engine_check if ep.engine_check is not None else {}
        old = checks.get(model)
        if old is not None:
            self.endpoints.labels(model, old.outcome).dec()
        self.endpoints.labels(model, result.outcome).inc()
        checks[model] = result
        ep.engine_check = checks
        changed = old is None or (old.outcome, old.detail) != (result.outcome, result.detail)
        mode = self._models[model][1]
        if result.outcome == "mismatch":
            self.mismatches.labels(model).inc()
            action = "no new requests go there (engine_check: drain)" if mode == "drain" else "still routed (engine_check: warn)"
            if changed:
                log.error(
                    "endpoint %s: model %s is counted otherwise by the engine than by the router (%s); its token "
                    "counts, context limits, KV admission and rate-limit charges are wrong; %s. Set models[].tokenizer "
                    "(or path) to the directory the engine loads",
                    ep.address, model, result.detail, action,
                )  # fmt: skip
        elif changed:
            # Unverified is INFO: an engine without /tokenize, or one still starting, is no fault.
            log.info("endpoint %s: model %s engine check %s%s", ep.address, model, result.outcome, f" ({result.detail})" if result.detail else "")
        if mode == "drain":
            self._drain_on_mismatch(ep)

    def _drain_on_mismatch(self, ep: Endpoint) -> None:
        """Drain `ep` (a weight override of 0, the `weight-override-filter` keeps it out unless
        every candidate is drained) while any of its `drain` models mismatches; lift the drain
        this checker set once none does. An operator's own override is left alone."""
        mismatched = any(
            c.outcome == "mismatch" and self._models.get(m, (0, ""))[1] == "drain" for m, c in (ep.engine_check or {}).items()
        )
        ours = ep.override is not None and ep.override.source == OVERRIDE_SOURCE
        if mismatched and (ep.override is None or ours or not ep.override.active(time.monotonic())):
            duration = min(MAX_DURATION_S, 2 * self._recheck_s)  # renewed by each re-check
            set_override(ep, 0.0, duration, reason="token counts differ from the engine's", source=OVERRIDE_SOURCE)
        elif not mismatched and ours:
            set_override(ep, 1.0, 1.0, reason="", source=OVERRIDE_SOURCE)


MAX_LISTED_ADAPTERS = 1024
"""Adapters read from one engine's `/v1/models` (count); the rest are ignored."""


def listed_adapters(listing: Any) -> dict[str, str]:
    """LoRA adapters in a `/v1/models` body: adapter id → its `parent` (vLLM lists each loaded
    adapter as an entry whose `parent` is the base model's id), at most `MAX_LISTED_ADAPTERS`;
    {} for a body that is not such a listing."""
    data = listing.get("data") if isinstance(listing, dict) else None
    out: dict[str, str] = {}
    for entry in data if isinstance(data, list) else ():
        if len(out) >= MAX_LISTED_ADAPTERS:
            break
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and isinstance(entry.get("parent"), str) and entry["id"] and entry["parent"]:
            out[entry["id"]] = entry["parent"]
    return out


def _listed_max_model_len(listing: Any, model: str) -> int | None:
    """`max_model_len` of `model` in a `/v1/models` body (`{"data": [{"id", "max_model_len"}]}`)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    for entry in data if isinstance(data, list) else ():
        if isinstance(entry, dict) and entry.get("id") == model and isinstance(entry.get("max_model_len"), int):
            return entry["max_model_len"]
    return None

