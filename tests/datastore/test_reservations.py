"""Reservation accounting: phases, KV blocks, settling on scrapes, idempotent release."""

from __future__ import annotations

import time

from extproc.config.schema import EndpointConfig
from extproc.datastore.endpoints import Datastore


def make():
    store = Datastore([EndpointConfig(address="10.0.0.1:8000", models=["m"])])
    return store, store.all()[0]


def test_reserve_then_first_token_then_release():
    store, ep = make()
    r = store.reserve(ep, 10, prompt_tokens=500)
    assert (ep.inflight, ep.prefill_inflight, ep.decode_inflight, ep.reserved_blocks, ep.prefill_tokens) == (1, 1, 0, 10, 500)
    r.mark_first_token()
    r.mark_first_token()  # idempotent
    assert (ep.prefill_inflight, ep.decode_inflight, ep.prefill_tokens) == (0, 1, 0)
    r.release()
    r.release()  # idempotent
    assert (ep.inflight, ep.decode_inflight, ep.reserved_blocks, store.open_reservations) == (0, 0, 0, 0)


def test_blocks_settle_on_a_scrape_after_the_first_token():
    store, ep = make()
    r = store.reserve(ep, 10, settle_after_s=60)
    before = time.monotonic()
    assert store.settle_scraped(ep, before) == 0  # no first token yet: the engine may not show it
    r.mark_first_token(before + 0.01)
    assert store.settle_scraped(ep, before) == 0  # that scrape predates the first token
    assert store.settle_scraped(ep, before + 0.02) == 1
    assert ep.reserved_blocks == 0 and ep.inflight == 1  # still in flight, blocks now the engine's
    r.release()
    assert ep.reserved_blocks == 0 and ep.inflight == 0


def test_blocks_settle_after_the_deadline_without_a_first_token():
    store, ep = make()
    store.reserve(ep, 7, settle_after_s=0.5)
    assert store.settle_scraped(ep, time.monotonic()) == 0
    assert store.settle_scraped(ep, time.monotonic() + 1.0) == 1
    assert ep.reserved_blocks == 0


def test_release_before_settling_returns_the_blocks():
    store, ep = make()
    r = store.reserve(ep, 7)
    r.release()
    assert ep.reserved_blocks == 0 and not ep.unsettled


def test_unseen_counts_requests_since_the_last_scrape_started():
    store, ep = make()
    rs = [store.reserve(ep) for _ in range(3)]
    assert ep.unseen == 3
    ep.routed_at_scrape = ep.routed_total  # a scrape started now and succeeded
    store.reserve(ep)
    assert ep.unseen == 1
    for r in rs:
        r.release()
    assert ep.unseen == 1  # bounded by what is still in flight
