"""JACOBI (multi-block + rejection recycling) served by stock SGLang: exactly greedy AR."""

from __future__ import annotations

import openai
import pytest
from sglang_fixtures import (
    check_lossless,
    mode_server_fixture,
    native_generate,
    wait_tokens_zero,
)

pytestmark = pytest.mark.server

# small blocks keep the CPU verify tree at 1 + 4 + 4 + 3*3 + 12 = 30 query tokens per request
# (the last 12: a context n-gram candidate, longer than a block, so a win runs past the real-active
# block and restarts the blocks); the server builds its tree mask in the GPU backends'
# full [W, L + W] layout (SELFSPEC_FULL_MASK), so the CPU run also checks the mask the GPU path
# hands to SGLang. It runs on SGLang's default path (radix cache on, prompts prefilled in chunks
# of 16 tokens): the burst after the sequential pass reuses cached prefixes of the same prompts.
server = mode_server_fixture("jacobi", [
    "--speculative-algorithm", "JACOBI",
    "--selfspec-options", "block_size=4,max_blocks=2,verify_size=3,ngram_size=4,context_tokens=12",
], env={"SELFSPEC_FULL_MASK": "1"}, default_path=True)


def test_jacobi_greedy_equals_ar_sequential(server, heldout_ids, ar_reference):
    res = check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=False)
    metas = res["metas"]
    assert all(m["selfspec_mode"] == "JACOBI" for m in metas)
    # recycling must find something on code: some request commits more than one token per forward
    assert max(m["selfspec_tpf"] for m in metas) > 1.0


def test_jacobi_greedy_equals_ar_burst_and_kv_released(server, heldout_ids, ar_reference):
    check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=True)
    assert wait_tokens_zero(server.base_url) == 0


def test_jacobis_default_policy_speculates(server):
    """The server runs JACOBI's default policy (no plan file; the options above go to its own
    step): after the sequential and burst passes, its greedy tokens came from speculative steps."""
    from sglang_fixtures import check_default_speculates, check_own_steps

    check_default_speculates(server.base_url)
    check_own_steps(server.base_url, "JACOBI")  # the mode's own step served the batches of one


def test_jacobi_refuses_sampling(server, heldout_ids):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="default", prompt=heldout_ids[0], max_tokens=4, temperature=0.7)
    assert info.value.status_code == 400
    assert "greedy only" in str(info.value)
    ok = native_generate(server.base_url, heldout_ids[0], max_new_tokens=4)
    assert len(ok["output_ids"]) == 4


def test_jacobi_penalties_bias_min_tokens_equal_ar(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_rules_match_ar

    check_rules_match_ar(server.base_url, heldout_ids, ar_reference)


def test_jacobi_logprobs_equal_ar(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_logprobs_match_ar

    check_logprobs_match_ar(server.base_url, heldout_ids, ar_reference)


def test_fuzzed_request_mixes_jacobi(server, heldout_ids, ar_reference, tokenizer, tiny_base_path):
    """Mixes of every request feature sent at once (`sglang_fixtures.check_fuzz`): no 5xx, AR's
    statuses, greedy outputs equal to AR's, no [MASK] token, no KV left."""
    from sglang_fixtures import check_fuzz

    statuses = check_fuzz(server.base_url, heldout_ids, ar_reference, tiny_base_path,
                          mask_token_id=tokenizer.mask_token_id, greedy_only=True)
    assert statuses.get(200, 0) >= 20, statuses
