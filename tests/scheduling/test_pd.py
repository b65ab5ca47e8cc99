"""The P/D profile handler (extproc.scheduling.pd): decode picked first, the threshold read on
that decode endpoint's uncached tokens, the prefill pick honouring health and KV admission, and
the pair's reservations released on every way a request ends."""

from __future__ import annotations

import pytest

from extproc.config.loader import ConfigError, config_from_mapping
from extproc.config.schema import EndpointConfig, SchedulingConfig
from extproc.datastore.endpoints import Datastore
from extproc.pipeline.request import build_profile
from extproc.prefix.match import PrefixMatch
from extproc.scheduling.pd import DECODE_ONLY, PREFILL_DECODE, PDHandler, transfer_seconds
from tests.scheduling.conftest import context, engine

QWEN3_8B_KV_BYTES = 2 * 36 * 8 * 128 * 2  # layers × KV heads × head dim × K and V × bf16 (bytes per token)


def pd_store(*roles: str) -> Datastore:
    store = Datastore([EndpointConfig(address=f"10.0.0.{i}:8000", models=["m"], role=r) for i, r in enumerate(roles, 1)])
    for ep in store.all():
        ep.engine = engine()
    return store


def handler(threshold: int = 256, gbytes_per_s: float = 25.0, enabled: bool = True) -> PDHandler:
    profiles = SchedulingConfig().all_profiles()
    return PDHandler(
        build_profile("pd-decode", profiles["pd-decode"]), build_profile("pd-prefill", profiles["pd-prefill"]), threshold, gbytes_per_s * 1e9, enabled
    )


def test_a_long_prompt_is_prefilled_elsewhere_and_a_short_one_stays_on_its_decode_endpoint():
    store = pd_store("prefill", "decode", "decode")
    pool = store.all()
    long = handler().run(context(prompt=5000), pool, QWEN3_8B_KV_BYTES)
    assert (long.decision, long.reason) == (PREFILL_DECODE, "long_prompt")
    assert long.prefill_endpoint is store.get("10.0.0.1:8000")
    assert long.decode.pick.primary.endpoint.role == "decode"
    # 5000 tokens × 147,456 B ÷ 25 GB/s
    assert long.transfer_s == pytest.approx(5000 * QWEN3_8B_KV_BYTES / 25e9) and 0.02 < long.transfer_s < 0.04
    assert long.predicted_ttft_s is not None and long.predicted_ttft_s > long.transfer_s
    assert "prefill: chose 10.0.0.1:8000" in long.explain() and "pd=prefill-decode/long_prompt" in long.explain()
    short = handler().run(context(prompt=256), pool, QWEN3_8B_KV_BYTES)
    assert (short.decision, short.reason, short.prefill_endpoint) == (DECODE_ONLY, "short_prompt", None)
    assert short.decode.pick.primary.endpoint.role == "decode"
    # Threshold 0: every prompt with a token to compute is disaggregated.
    assert handler(threshold=0).run(context(prompt=10), pool, QWEN3_8B_KV_BYTES).decision == PREFILL_DECODE


def test_the_threshold_counts_the_tokens_uncached_on_the_chosen_decode_endpoint_not_the_prompt():
    # 4,000 of the 4,100 prompt tokens are cached on the decode endpoint: 100 left to prefill,
    # under the threshold, so the decode engine prefills them itself.
    store = pd_store("prefill", "decode")
    ctx = context(prompt=4100)
    ctx.prefix = PrefixMatch(4100, matched={"10.0.0.2:8000": 250}, block_size={"10.0.0.2:8000": 16})
    d = handler().run(ctx, store.all(), QWEN3_8B_KV_BYTES)
    assert (d.decision, d.reason, d.uncached_tokens) == (DECODE_ONLY, "short_prompt", 100)
    # The same prompt cached on the prefill endpoint only: disaggregated, and the prefill side
    # is predicted faster than cold.
    ctx = context(prompt=4100)
    ctx.prefix = PrefixMatch(4100, matched={"10.0.0.1:8000": 250}, block_size={"10.0.0.1:8000": 16})
    d = handler().run(ctx, store.all(), QWEN3_8B_KV_BYTES)
    assert (d.decision, d.uncached_tokens) == (PREFILL_DECODE, 4100)


def test_prefill_pick_honours_health_ejection_and_kv_admission_and_falls_back_to_local_prefill():
    store = pd_store("prefill", "prefill", "decode")
    p1, p2, _ = store.all()
    p1.healthy = False
    assert handler().run(context(prompt=3000), store.all(), QWEN3_8B_KV_BYTES).prefill_endpoint is p2
    p1.healthy, p2.ejected_until = True, 1e18  # outlier detection
    assert handler().run(context(prompt=3000), store.all(), QWEN3_8B_KV_BYTES).prefill_endpoint is p1
    # No panic on the prefill side: both out → the decode engine prefills (healthy-filter alone
    # would keep every endpoint when all are ejected).
    p1.healthy = False
    d = handler().run(context(prompt=3000), store.all(), QWEN3_8B_KV_BYTES)
    assert (d.decision, d.reason) == (DECODE_ONLY, "no_prefill_endpoint")
    p1.healthy = True
    p2.ejected_until = 0.0
    p1.engine = engine(blocks=100)  # 3,000 tokens need 188 blocks of 16
    assert handler().run(context(prompt=3000), store.all(), QWEN3_8B_KV_BYTES).prefill_endpoint is p2
    p2.engine = engine(blocks=100)
    # No prefill endpoint can hold the prompt: the decode engine prefills it, never a refusal.
    d = handler().run(context(prompt=3000), store.all(), QWEN3_8B_KV_BYTES)
    assert (d.decision, d.reason, d.prefill.rejected_by) == (DECODE_ONLY, "no_prefill_endpoint", "kv-fit-filter")
    assert d.decode.pick.primary.endpoint.role == "decode"


def test_decode_is_never_picked_on_a_prefill_endpoint_and_a_unified_fleet_is_left_alone():
    store = pd_store("prefill", "both")
    d = handler().run(context(prompt=3000), store.all(), QWEN3_8B_KV_BYTES)
    # The `both` endpoint decodes; the prefill endpoint prefills.
    assert d.decode.pick.primary.endpoint.address == "10.0.0.2:8000" and d.prefill_endpoint.address == "10.0.0.1:8000"
    only_prefill = pd_store("prefill")
    d = handler().run(context(prompt=3000), only_prefill.all(), QWEN3_8B_KV_BYTES)
    assert d.decode.pick is None and d.decode.rejected_by == "pd-decode-role"
    assert not PDHandler.applies(pd_store("both", "both").all()) and PDHandler.applies(store.all())
    off = handler(enabled=False).run(context(prompt=3000), store.all(), QWEN3_8B_KV_BYTES)
    assert (off.decision, off.reason, off.prefill_endpoint) == (DECODE_ONLY, "disabled", None)


def test_pair_reservations_are_released_when_decode_streams_or_the_request_ends_any_way():
    store = pd_store("prefill", "decode")
    prefill, decode = store.all()
    for end in ("first_token", "release", "first_token_then_release"):
        d_res = store.reserve(decode, 10, prompt_tokens=0, context_tokens=5000)
        p_res = store.reserve(prefill, 313, prompt_tokens=5000)
        d_res.attach_prefill_side(p_res)
        assert (prefill.inflight, prefill.reserved_blocks, prefill.prefill_tokens) == (1, 313, 5000)
        if end.startswith("first_token"):
            d_res.mark_first_token()
            # The KV moved: the prefill side's part is over, the decode side decodes.
            assert (prefill.inflight, prefill.reserved_blocks, prefill.prefill_tokens) == (0, 0, 0)
            assert (decode.inflight, decode.decode_inflight) == (1, 1)
            assert prefill.prefill_fit.samples == 0 and decode.prefill_fit.samples == 0  # a remote prefill teaches neither fit
        if end != "first_token":
            d_res.release()
        else:
            d_res.release()
        d_res.release()  # idempotent on both sides
        assert (prefill.inflight, prefill.prefill_inflight, prefill.reserved_blocks, prefill.prefill_tokens) == (0, 0, 0, 0)
        assert (decode.inflight, decode.prefill_inflight, decode.decode_inflight, decode.reserved_blocks, decode.context_tokens) == (0, 0, 0, 0, 0)


def test_transfer_time_and_bad_settings_are_refused():
    assert transfer_seconds(1000, 100, 1e6) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        transfer_seconds(-1, 100, 1e6)
    with pytest.raises(ValueError):
        handler(gbytes_per_s=0.0)
    with pytest.raises(ValueError, match="threshold"):
        handler(threshold=-1)


def test_config_roles_labels_and_disaggregation_settings():
    base = {
        "models": [{"name": "m", "path": "builtin:qwen3-8b"}],
        "endpoints": [
            {"address": "10.0.0.1:8000", "models": ["m"], "role": "prefill"},
            {"address": "10.0.0.2:8000", "models": ["m"], "labels": {"llm-d.ai/role": "decode"}},
            {"address": "10.0.0.3:8000", "models": ["m"]},
        ],
    }
    cfg = config_from_mapping(base, env={})
    assert [e.role for e in cfg.endpoints] == ["prefill", "decode", "both"]
    assert cfg.scheduling.disaggregation.threshold_tokens == 256
    with pytest.raises(ConfigError, match="not a role"):
        config_from_mapping({**base, "endpoints": [{"address": "10.0.0.1:8000", "models": ["m"], "labels": {"llm-d.ai/role": "prefiller"}}]}, env={})
    with pytest.raises(ConfigError, match="disaggregation.prefill_profile: profile 'nope'"):
        config_from_mapping({**base, "scheduling": {"disaggregation": {"prefill_profile": "nope"}}}, env={})
