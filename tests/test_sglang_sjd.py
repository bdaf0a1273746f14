"""SJD served by stock SGLang, with context candidates (from every request served: the corpus):
greedy SJD equals AR; sampled SJD follows the AR server's sampling distribution and is
seed-reproducible. SJD alone on every step (`--selfspec-policy own`): its sampled steps are what
is tested here (the default policy serves sampled batches with AR steps)."""

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

server = mode_server_fixture("sjd", ["--speculative-algorithm", "SJD", "--selfspec-policy", "own",
                                     "--selfspec-options", "window=4,history_offset=8,context_tokens=4"])


def test_sjd_greedy_equals_ar_sequential(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_own_steps

    res = check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=False)
    assert all(m["selfspec_mode"] == "SJD" for m in res["metas"])
    kinds = check_own_steps(server.base_url, "SJD")  # SJD's own steps, and only they (policy `own`)
    assert {k for k, v in kinds.items() if v} == {"own"}, kinds


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


def test_sjd_mixed_greedy_and_sampled_burst(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_mixed_burst

    check_mixed_burst(server.base_url, heldout_ids, ar_reference)


def test_seeded_sampling_equals_the_reference_engine(server, heldout_ids, tiny_base_path):
    import torch

    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(tiny_base_path, dtype=torch.float32)
    opts = {"window": 4, "history_offset": 8, "context_tokens": 4}
    for i in (10, 11, 12):
        ref = engine.generate([heldout_ids[i]], 24, SamplingParams(0.8, top_k=30, top_p=0.9), seed=[99 + i],
                              mode="sjd", mode_config=opts)
        got = native_generate(server.base_url, heldout_ids[i], 24, temperature=0.8, top_k=30, top_p=0.9,
                              sampling_seed=99 + i)
        assert got["output_ids"] == ref[0].token_ids, i


def test_a_repeated_request_is_drafted_from_the_first(server, heldout_ids):
    """The server's context candidates draw on every request it served (`decoding/modes/corpus.py`): a
    prompt no earlier request held, sent twice, is decoded in far fewer forwards the second time
    (its own history has no match; the first answer has them all), with the same tokens."""
    ids = list(reversed(heldout_ids[3]))[:48]
    first, second = (native_generate(server.base_url, ids, 64, ignore_eos=True) for _ in range(2))
    assert second["output_ids"] == first["output_ids"]
    steps = [r["meta_info"]["spec_verify_ct"] for r in (first, second)]
    assert steps[1] <= 0.75 * steps[0], steps


def test_fuzzed_request_mixes_sjd(server, heldout_ids, ar_reference, tokenizer, tiny_base_path):
    """Mixes of every request feature sent at once (`sglang_fixtures.check_fuzz`): no 5xx, AR's
    statuses, greedy outputs equal to AR's, no [MASK] token, no KV left."""
    from sglang_fixtures import check_fuzz

    statuses = check_fuzz(server.base_url, heldout_ids, ar_reference, tiny_base_path,
                          mask_token_id=tokenizer.mask_token_id)
    assert statuses.get(200, 0) >= 60, statuses
