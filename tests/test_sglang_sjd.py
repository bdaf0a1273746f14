"""SJD served by stock SGLang, with context candidates: greedy SJD equals AR; sampled SJD
follows the AR server's sampling distribution and is seed-reproducible."""

from __future__ import annotations

import pytest
from sglang_fixtures import (
    burst,
    check_lossless,
    check_sampling_matches_ar,
    mode_server_fixture,
    native_generate,
    wait_tokens_zero,
)

pytestmark = pytest.mark.server

server = mode_server_fixture("sjd", ["--speculative-algorithm", "SJD", "--selfspec-options", "window=4,history_offset=8,context_tokens=4"])


def test_sjd_greedy_equals_ar_sequential(server, heldout_ids, ar_reference):
    res = check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=False)
    assert all(m["selfspec_mode"] == "SJD" for m in res["metas"])


def test_sjd_greedy_equals_ar_burst_and_kv_released(server, heldout_ids, ar_reference):
    check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=True)
    assert wait_tokens_zero(server.base_url) == 0


def test_sjd_sampling_matches_the_ar_servers_sampling(server, ar_reference):
    check_sampling_matches_ar(server.base_url, ar_reference)


def test_sjd_sampling_reproducible_in_any_batch(server, heldout_ids, tokenizer):
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.9)
    ids = heldout_ids[0]
    alone = native_generate(server.base_url, ids, sampling_seed=42, **kw)["output_ids"]
    mixed = burst(lambda x: native_generate(server.base_url, x[0], sampling_seed=x[1], **kw),
                  [(ids, 42)] + [(heldout_ids[i], i) for i in range(1, 8)])
    assert mixed[0]["output_ids"] == alone
    assert all(0 <= t < len(tokenizer) for t in alone)
    assert wait_tokens_zero(server.base_url) == 0


def test_sjd_penalties_bias_min_tokens_equal_ar(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_rules_match_ar

    check_rules_match_ar(server.base_url, heldout_ids, ar_reference)


def test_sjd_logprobs_equal_ar(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_logprobs_match_ar

    check_logprobs_match_ar(server.base_url, heldout_ids, ar_reference)
