"""Prefill/decode disaggregation: the profile handler that picks a (prefill, decode) pair.

llm-d-router's rule (DESIGN.md §13, decision 0330), on a model whose endpoints carry P/D roles
(`Endpoint.role`):

1. **Decode first**, among `decode` and `both` endpoints, with the decode profile (default
   `pd-decode`: in-flight requests, KV headroom, queue, cached prefix). Decode is what the
   request will occupy for its whole output, so it is chosen on what bounds decode.
2. **Disaggregate or not**, from the request's uncached prompt tokens *on that decode endpoint*
   (the prefix index; what the decode engine would have to prefill itself): above
   `threshold_tokens` → prefill elsewhere; otherwise (a short or mostly cached prompt) the decode
   endpoint prefills locally, as vllm-project/router does at ≤ 256 uncached tokens and Dynamo for
   short or cached prompts: a transfer's fixed cost buys nothing there.
3. **Prefill second**, among `prefill` and `both` endpoints other than the decode one, with the
   prefill profile (default `pd-prefill`: the learned TTFT estimate, which counts the prefill
   backlog and the prefix cached there in seconds). Its KV fit is checked for the prompt only
   (one output token: the prefill side's blocks leave with the transfer).

Both picks run full profiles, so health, outlier ejection, KV admission and operator overrides
apply to each; the prefill pick has no health panic (an unhealthy or ejected prefill endpoint is
never chosen over local prefill). No prefill endpoint passing its filters leaves the request on
its decode endpoint (`reason=no_prefill_endpoint`), never refused: the decode engine can always
prefill.

The pair's predicted TTFT is the prefill endpoint's predicted TTFT plus the KV transfer,
`uncached tokens × KV bytes per token (the model's architecture) ÷ link bandwidth`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.datastore.endpoints import Endpoint
from extproc.scheduling.framework import Profile, ProfileResult, SchedulingContext

__all__ = ["PDDecision", "PDHandler", "PREFILL_DECODE", "DECODE_ONLY", "NO_DECODE_ROLE", "transfer_seconds"]

PREFILL_DECODE = "prefill-decode"
"""`PDDecision.decision`: prefill on one endpoint, decode on another."""
DECODE_ONLY = "decode-only"
"""`PDDecision.decision`: the decode endpoint prefills locally."""

NO_DECODE_ROLE = "pd-decode-role"
"""`ProfileResult.rejected_by` when no endpoint of the model may decode (all `role: prefill`)."""

DECODE_ROLES = frozenset({"decode", "both"})
PREFILL_ROLES = frozenset({"prefill", "both"})


def transfer_seconds(tokens: int, kv_bytes_per_token: int, link_bytes_per_s: float) -> float:
    """Seconds to move `tokens` tokens of KV cache (`kv_bytes_per_token` bytes each, from the
    model's architecture: `extproc.pipeline.kv`) over a link of `link_bytes_per_s` bytes/s.

    Raises:
        ValueError: a negative count or a bandwidth that is not > 0.
    """
    if tokens < 0 or kv_bytes_per_token < 0:
        raise ValueError(f"tokens and bytes per token must be ≥ 0, got {tokens} and {kv_bytes_per_token}")
    if not link_bytes_per_s > 0:
        raise ValueError(f"link bandwidth must be > 0 bytes/s, got {link_bytes_per_s}")
    return tokens * kv_bytes_per_token / link_bytes_per_s


@dataclass(slots=True)
class PDDecision:
    """One P/D scheduling cycle.

    Attributes:
        decision: `PREFILL_DECODE` or `DECODE_ONLY`.
        reason: why: `long_prompt` (uncached tokens above the threshold), `short_prompt` (at or
            below it), `no_prefill_endpoint` (none passed the prefill profile's filters),
            `disabled` (disaggregation off), or `no_decode_endpoint` (the decode pick failed).
        decode: the decode pick's cycle (its `pick` is None when no endpoint can decode).
        prefill: the prefill pick's cycle, or None when it did not run.
        prefill_ctx: the context of the prefill pick (one output token), or None.
        uncached_tokens: prompt tokens not cached on the decode endpoint (tokens; 0 when none was picked).
        transfer_s: predicted KV transfer time (seconds; 0 without a prefill endpoint).
        predicted_ttft_s: predicted time to first token of the pair (prefill's TTFT plus the
            transfer; seconds), or None when the prefill profile has no TTFT estimate.
    """

    decision: str
    reason: str
    decode: ProfileResult
    prefill: ProfileResult | None = None
    prefill_ctx: SchedulingContext | None = None
    uncached_tokens: int = 0
    transfer_s: float = 0.0
    predicted_ttft_s: float | None = None

    @property
    def prefill_endpoint(self) -> Endpoint | None:
        """The prefill endpoint when disaggregated, else None."""
        if self.decision != PREFILL_DECODE or self.prefill is None or self.prefill.pick is None:
            return None
        return self.prefill.pick.primary.endpoint

    def explain(self) -> str:
        """The route-debug text: the decision, both picks' scores, the transfer."""
        out = f"pd={self.decision}/{self.reason} uncached={self.uncached_tokens}tok; decode: {self.decode.explain()}"
        if self.prefill is not None:
            out += f"; prefill: {self.prefill.explain()}"
        if self.prefill_endpoint is not None:
            out += f"; transfer={self.transfer_s * 1000:.1f}ms"
            if self.predicted_ttft_s is not None:
                out += f" pair_ttft={self.predicted_ttft_s * 1000:.1f}ms"
        return out


class PDHandler:
    """Runs the P/D rule (module doc) over a model's endpoints.

    Args:
        decode_profile / prefill_profile: the two picks' profiles.
        threshold_tokens: disaggregate above this many uncached tokens on the decode endpoint
            (tokens, ≥ 0).
        link_bytes_per_s: KV transfer bandwidth (bytes/s, > 0).
        enabled: False: decode endpoints only, never a prefill endpoint.

    Raises:
        ValueError: a negative threshold or a bandwidth that is not > 0.
    """

    def __init__(self, decode_profile: Profile, prefill_profile: Profile, threshold_tokens: int, link_bytes_per_s: float, enabled: bool = True) -> None:
        if threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be ≥ 0, got {threshold_tokens}")
        if not link_bytes_per_s > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {link_bytes_per_s}")
        self.decode_profile = decode_profile
        self.prefill_profile = prefill_profile
        self.threshold_tokens = threshold_tokens
        self.link_bytes_per_s = link_bytes_per_s
        self.enabled = enabled

    @staticmethod
    def applies(endpoints: Sequence[Endpoint]) -> bool:
        """True when any endpoint has a role other than `both`: a unified fleet is scheduled as
        without disaggregation."""
        return any(ep.role != "both" for ep in endpoints)

    def run(self, ctx: SchedulingContext, endpoints: Sequence[Endpoint], kv_bytes_per_token: int) -> PDDecision:
        """Pick the decode endpoint, decide, pick the prefill endpoint (module doc).

        Args:
            ctx: the request's context (its prefix view covers `endpoints`).
            endpoints: the model's endpoints, every role.
            kv_bytes_per_token: the model's KV bytes per token (bytes).
        """
        decoders = [ep for ep in endpoints if ep.role in DECODE_ROLES]
        if not decoders:  # every endpoint is prefill-only: nothing can answer
            return PDDecision(DECODE_ONLY, "no_decode_endpoint", ProfileResult(None, {}, NO_DECODE_ROLE, {}))
        decode = self.decode_profile.run(ctx, decoders)
        if decode.pick is None:
            return PDDecision(DECODE_ONLY, "no_decode_endpoint", decode)
        target = decode.pick.primary.endpoint
        uncached = ctx.uncached_tokens(target)
        if not self.enabled:
            return PDDecision(DECODE_ONLY, "disabled", decode, uncached_tokens=uncached)
        if uncached <= self.threshold_tokens:
            return PDDecision(DECODE_ONLY, "short_prompt", decode, uncached_tokens=uncached)
        # The prefill side holds the prompt's blocks only until the decode side pulls them.
        pctx = dataclasses.replace(ctx, expected_output_tokens=1, decode_output_tokens=1, data={})
        # No panic for this pick: an unhealthy or ejected prefill endpoint is never worth more
        # than the decode engine prefilling itself (healthy-filter would keep a lone failing one).
        usable = [ep for ep in endpoints if ep.role in PREFILL_ROLES and ep is not target and ep.healthy and not ep.ejected(ctx.now)]
        prefill = self.prefill_profile.run(pctx, usable)
        if prefill.pick is None:
            return PDDecision(DECODE_ONLY, "no_prefill_endpoint", decode, prefill, pctx, uncached)
        transfer = transfer_seconds(uncached, kv_bytes_per_token, self.link_bytes_per_s)
        predicted = pctx.data.get("predicted_ttft_s")
        ttft = None
        if isinstance(predicted, dict) and prefill.pick.primary.endpoint.address in predicted:
            ttft = predicted[prefill.pick.primary.endpoint.address] + transfer
        return PDDecision(PREFILL_DECODE, "long_prompt", decode, prefill, pctx, uncached, transfer, ttft)
