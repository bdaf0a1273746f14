"""SGLang's default server path under memory pressure: radix cache and chunked prefill on
(`DEFAULT_PATH`), and SGLang's own retraction test mode (`SGLANG_TEST_RETRACT=1`: the scheduler
retracts running requests every few forwards, as when the KV pool is full). Greedy output stays
AR's, retracted seeded requests keep their random stream (sampling keeps the AR server's
distribution), KV is released; and the request that fills the context length exactly. One SJD
server (greedy and sampled); ISD and JACOBI run their own suites on the default path."""

from __future__ import annotations

import pytest
from sglang_fixtures import (
    burst,
    check_context_limit,
    check_lossless,
    check_rules_match_ar,
    check_sampling_matches_ar,
    mode_server_fixture,
    native_generate,
    wait_tokens_zero,
)

pytestmark = pytest.mark.server

server = mode_server_fixture("sjd-retract", ["--speculative-algorithm", "SJD", "--selfspec-options",
                                             "window=4,history_offset=8,context_tokens=4"],
                             env={"SGLANG_TEST_RETRACT": "1"}, default_path=True)


def test_greedy_equals_ar_through_retractions(server, heldout_ids, ar_reference):
    metas = check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=True)["metas"]
    retracted = sum(m.get("num_retractions", 0) for m in metas)
    assert retracted > 0, "the burst saw no retraction: the test would prove nothing"
    assert wait_tokens_zero(server.base_url) == 0


def test_rules_and_grammars_through_retractions(server, heldout_ids, ar_reference):
    check_rules_match_ar(server.base_url, heldout_ids, ar_reference)


def test_sampling_through_retractions_matches_the_ar_servers_sampling(server, ar_reference):
    """Seeded sampled requests retracted and prefilled again: their random stream carries on
    (a counter restarting at 0 would reuse the uniforms of their first tokens), so the joint
    distribution of their tokens is still the AR server's."""
    metas: list = []
    check_sampling_matches_ar(server.base_url, ar_reference, metas)
    assert sum(m.get("num_retractions", 0) for m in metas) > 0


def test_seeded_requests_under_retraction_are_valid_and_distinct(server, heldout_ids):
    kw = dict(max_new_tokens=32, temperature=0.9, top_k=40, ignore_eos=True)
    outs = burst(lambda s: native_generate(server.base_url, heldout_ids[0], sampling_seed=s, **kw)["output_ids"],
                 list(range(8)), 8)
    assert all(len(o) == 32 for o in outs) and len({tuple(o) for o in outs}) == 8
    assert wait_tokens_zero(server.base_url) == 0
    # the default policy serves sampled batches by plain AR steps, each prepared by SGLang's
    # plain decode preparation (no reservation of the verify width), retractions included
    from sglang_fixtures import internal_state

    state = internal_state(server.base_url)["selfspec"]
    assert state["ar_steps"] > 0 and state["ar_steps_plain"] == state["ar_steps"], state


def test_request_filling_the_context_length(server, ar_reference):
    check_context_limit(server.base_url, ar_reference)
