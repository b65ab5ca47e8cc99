"""The engine model on its virtual clock: timing properties, KV pool, prefix cache, queueing.

All times are simulated seconds; no event loop, no HTTP. Expected values come from the default
profile's coefficients (h100-qwen3-8b: a ≈ 6.5 ms floor, b ≈ 23.5 µs/prefill token,
d ≈ 49 ns/context token).
"""

from __future__ import annotations

import random

import pytest

from extproc.sim.engine import Engine, EngineConfig, RequestStatus, RequestTooLargeError, SimRequest
from extproc.sim.profiles import get_profile
from extproc.sim.workload import synthetic_prompt_ids

PROFILE = get_profile("h100-qwen3-8b")
CO = PROFILE.coefficients


def make_engine(blocks: int = 20_000, **kw: int | bool) -> Engine:
    return Engine(EngineConfig(num_gpu_blocks=blocks, **kw), CO)


def ids(n: int, seed: int) -> list[int]:
    return synthetic_prompt_ids(n, random.Random(seed))


def run_one(prompt: list[int], out: int = 8, engine: Engine | None = None) -> SimRequest:
    eng = engine or make_engine()
    req = SimRequest(prompt, out, eng.now)
    eng.add_request(req)
    eng.run()
    assert req.finished
    return req


@pytest.mark.parametrize(
    ("short", "long"),
    [(128, 1024), (1024, 8192), (8192, 32768)],
    ids=["128-vs-1k", "1k-vs-8k", "8k-vs-32k"],
)
def test_ttft_grows_with_prompt_length(short: int, long: int) -> None:
    t_short = run_one(ids(short, 1)).ttft
    t_long = run_one(ids(long, 2)).ttft
    assert t_short is not None and t_long is not None
    # Above the step floor prefill is linear (b) plus quadratic attention (q), so 8× the
    # tokens costs well over 2× (the 128-token prompt sits on the 6.5 ms floor).
    assert t_long > 2 * t_short


def test_ttft_of_single_request_matches_the_model() -> None:
    # One 8k-token prompt fits one step (budget 8192): a_c + b·8192 + q·8192².
    req = run_one(ids(8192 - 1, 3))
    n = 8191
    expected = max(CO.a, CO.a_c + CO.b * n) + CO.q * n * n
    assert req.ttft == pytest.approx(expected, rel=1e-9)


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    eng = make_engine(max_num_batched_tokens=2048)
    req = SimRequest(ids(5000, 4), 1, 0.0)
    eng.add_request(req)
    eng.run()
    assert eng.stats.steps == 3  # 2048 + 2048 + 904 prompt tokens
    assert req.finished and req.num_output == 1


def _mean_itl(batch: int, prompt: int = 1024, out: int = 64) -> float:
    eng = make_engine()
    for i in range(batch):
        eng.add_request(SimRequest(ids(prompt, 100 + i), out, 0.0))
    eng.run()
    assert eng.stats.finished["length"] == batch
    return eng.stats.itl.mean


def test_itl_grows_with_the_batch() -> None:
    itl = {b: _mean_itl(b) for b in (1, 16, 64, 256)}
    assert itl[1] < itl[16] < itl[64] < itl[256]
    # d·Σctx: 256 sequences × ~1.1k context × 49 ns ≈ 14 ms on top of the 6.5 ms floor.
    assert itl[256] > 2.5 * itl[1]
    assert itl[1] == pytest.approx(CO.a + CO.c + CO.d * 1056, rel=0.05)


def test_prefix_hit_lowers_ttft_and_is_counted() -> None:
    eng = make_engine()
    shared = ids(4000, 7)
    first = run_one(shared + ids(10, 8), engine=eng)
    second = run_one(shared + ids(10, 9), engine=eng)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 4000 // 16 * 16
    assert second.ttft is not None and first.ttft is not None
    assert second.ttft < first.ttft / 5
    assert eng.stats.prefix_hits == second.cached_tokens
    assert eng.stats.prefix_queries == 2 * 4010


def test_identical_prompt_recomputes_at_least_the_last_block() -> None:
    eng = make_engine()
    prompt = ids(64, 10)  # exactly 4 blocks
    run_one(prompt, engine=eng)
    again = run_one(prompt, engine=eng)
    assert again.cached_tokens == 48  # vLLM leaves the last token (hence its block) to compute


def test_prefix_caching_off_never_hits() -> None:
    eng = make_engine(enable_prefix_caching=False)
    shared = ids(2000, 11)
    run_one(shared, engine=eng)
    again = run_one(shared, engine=eng)
    assert again.cached_tokens == 0 and eng.stats.prefix_hits == 0


def test_freed_blocks_stay_cached_until_evicted() -> None:
    eng = make_engine(blocks=200)
    a = ids(1600, 12)  # 100 blocks
    run_one(a, out=1, engine=eng)
    assert eng.pool.num_cached >= 99 and eng.pool.num_free == 200
    run_one(ids(3000, 13), out=1, engine=eng)  # 188 blocks: evicts most of a
    assert run_one(a, out=1, engine=eng).cached_tokens < 1600 // 2


def test_requests_queue_when_blocks_run_out_and_the_queue_drains() -> None:
    # 1k prompt + 64 output = 67 blocks each; 400 blocks hold 5 at once.
    eng = make_engine(blocks=400)
    reqs = [SimRequest(ids(1024, 200 + i), 64, 0.0) for i in range(20)]
    for r in reqs:
        eng.add_request(r)
    peak_waiting = 0
    peak_usage = 0.0

    def sample(e: Engine) -> None:
        nonlocal peak_waiting, peak_usage
        peak_waiting = max(peak_waiting, len(e.waiting))
        peak_usage = max(peak_usage, e.pool.usage)
        assert len(e.running) <= 6

    eng.run(on_step=sample)
    assert peak_waiting >= 10
    assert peak_usage > 0.9
    assert all(r.finished and r.num_output == 64 for r in reqs)
    assert eng.pool.num_free == 400 and not eng.waiting and not eng.running
    # FCFS: requests start in arrival order
    starts = [r.first_scheduled for r in reqs]
    assert starts == sorted(starts)


def test_decode_growth_preempts_the_newest_request() -> None:
    # Prompts fit, but decoding 512 tokens each needs more blocks than the pool has.
    eng = make_engine(blocks=120)
    reqs = [SimRequest(ids(256, 300 + i), 512, 0.0) for i in range(4)]
    for r in reqs:
        eng.add_request(r)
    eng.run()
    assert eng.stats.preemptions > 0
    assert all(r.finished and r.num_output == 512 for r in reqs)
    assert eng.stats.generation_tokens == 4 * 512
    assert eng.stats.prompt_tokens == 4 * 256  # counted once, not again after recompute


def test_request_larger_than_the_pool_is_rejected() -> None:
    eng = make_engine(blocks=10)
    with pytest.raises(RequestTooLargeError, match="pool holds 160"):
        eng.add_request(SimRequest(ids(150, 1), 20, 0.0))


def test_max_num_seqs_caps_the_batch() -> None:
    eng = make_engine(max_num_seqs=4)
    for i in range(10):
        eng.add_request(SimRequest(ids(32, 400 + i), 16, 0.0))
    seen = 0

    def sample(e: Engine) -> None:
        nonlocal seen
        seen = max(seen, len(e.running))

    eng.run(on_step=sample)
    assert seen == 4 and eng.stats.finished["length"] == 10


def _open_loop(max_steps: int, blocks: int) -> tuple[Engine, list[SimRequest]]:
    rng = random.Random(5)
    eng = make_engine(blocks=blocks)
    t = 0.0
    reqs = []
    for i in range(150):
        t += rng.expovariate(15.0)
        r = SimRequest(ids(rng.randint(50, 1500), 500 + i), rng.randint(1, 300), t)
        reqs.append(r)
        eng.add_request(r)
    eng.run(max_steps=max_steps)
    return eng, reqs


@pytest.mark.parametrize("blocks", [20_000, 1_500], ids=["roomy", "tight-kv"])
def test_multi_step_decode_equals_single_stepping(blocks: int) -> None:
    one, reqs1 = _open_loop(1, blocks)
    many, reqs2 = _open_loop(64, blocks)
    for a, b in zip(reqs1, reqs2, strict=True):
        assert a.first_token_time == pytest.approx(b.first_token_time, abs=1e-9)
        assert a.finish_time == pytest.approx(b.finish_time, abs=1e-9)
    assert one.stats.steps == many.stats.steps
    assert one.stats.itl.count == many.stats.itl.count
    assert one.stats.itl.sum == pytest.approx(many.stats.itl.sum, rel=1e-9)
    assert one.stats.preemptions == many.stats.preemptions


def test_counters_match_what_was_asked() -> None:
    eng, reqs = _open_loop(64, 20_000)
    s = eng.stats
    assert s.finished["length"] == len(reqs)
    assert s.generation_tokens == sum(r.target_output for r in reqs)
    assert s.prompt_tokens == sum(r.prompt_len for r in reqs)
    assert s.ttft.count == s.e2e.count == s.queue.count == len(reqs)
    assert s.itl.count == sum(r.target_output - 1 for r in reqs)


def test_abort_frees_blocks_and_counts() -> None:
    eng = make_engine()
    req = SimRequest(ids(1000, 20), 100, 0.0)
    eng.add_request(req)
    plan = eng.plan()
    assert plan is not None
    eng.commit(plan)
    assert eng.pool.num_used > 0
    eng.abort(req)
    assert eng.pool.num_used == 0 and req.status is RequestStatus.FINISHED
    assert eng.stats.finished["abort"] == 1


def started(n: int, prompt: int, seed: int) -> tuple[Engine, list[SimRequest]]:
    """An engine with `n` requests that has run its first (prefill) step."""
    eng = make_engine()
    reqs = [SimRequest(ids(prompt, seed + i), 50, 0.0) for i in range(n)]
    for r in reqs:
        eng.add_request(r)
    plan = eng.plan()
    assert plan is not None
    eng.commit(plan)
    return eng, reqs


def test_restart_drops_everything_and_zeroes_counters() -> None:
    eng, reqs = started(3, 500, 30)
    stale = eng.plan()
    dropped = eng.restart()
    assert set(dropped) == set(reqs)
    assert eng.pool.num_free == eng.config.num_gpu_blocks and eng.pool.num_cached == 0
    assert eng.stats.generation_tokens == 0 and not eng.has_work()
    assert stale is not None and eng.commit(stale) == 0  # a plan from before the restart is void


def test_commit_until_stops_after_the_step_in_progress() -> None:
    eng, reqs = started(4, 100, 40)
    plan = eng.plan(max_steps=32)
    assert plan is not None and plan.steps == 32
    done = eng.commit(plan, until=plan.ends[4] + 1e-12)
    assert done == 6 and eng.now == plan.ends[5]
    assert all(r.num_output == 7 for r in reqs)
