"""A width plan served by stock SGLang (`--selfspec-config` with a `plan:`): each decode step
runs the bucket of its batch size (ISD with candidates, lookup steps (`mode: ngram`), plain AR steps
at mid sizes, stride 2 above), and the output stays exactly AR's when the width changes between steps
(sequential requests, a 16-request burst whose batch grows and shrinks), sampled output
follows the AR server's sampling; /server_info reports the plan, each step width served and
what the plan's online check measured."""

from __future__ import annotations


import pytest
import yaml
from sglang_fixtures import (
    check_lossless,
    check_sampling_matches_ar,
    server_args,
    start_server,
    wait_tokens_zero,
    DEFAULT_PATH,
)

pytestmark = pytest.mark.server

PLAN = [{"max_batch": 2, "stride": 3, "context_tokens": 4},
        {"max_batch": 5, "mode": "ngram", "num_draft": 4, "match_sizes": [8, 6, 4, 3, 2, 1], "corpus": True,
         "branches": 2, "caps": True, "adaptive": True},  # capped, adaptive: rows of one ragged forward
        # draft different lengths, each following its request's recent acceptance
        {"max_batch": 8, "mode": "ar"}, {"max_batch": None, "stride": 2}]
#: the forward widths of the buckets whose width is fixed: ISD 1 + 2(N-1) + candidate 4 + its MASK
#: tail N-1 at stride 3, 1 + 2(N-1) at stride 2, AR 1. (A lookup step's width is 1 + its drafts,
#: whose lengths follow each request's recent acceptance: `adaptive`; its steps are counted by kind.)
WIDTHS = {11, 1, 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory, ar_reference):
    cfg = tmp_path_factory.mktemp("plan") / "planned.yaml"
    cfg.write_text(yaml.safe_dump({"mode": "ISD", "plan": {"greedy": PLAN, "sampled": PLAN}}))
    proc = start_server(tmp_path_factory, "plan", server_args(*DEFAULT_PATH, "--speculative-algorithm", "ISD",
                                                              "--selfspec-config", str(cfg)))
    yield proc
    proc.stop()


def _widths_served(server) -> set[int]:
    """The forward widths of the decode steps served so far (/server_info)."""
    from sglang_fixtures import internal_state

    return {int(w) for w in internal_state(server.base_url)["selfspec"]["steps_by_width"]}


def test_plan_is_served(server):
    from sglang_fixtures import internal_state

    state = internal_state(server.base_url)["selfspec"]
    assert state["plan"] is not None, state
    assert {"max_batch": 8, "mode": "ar"} in [{k: b.get(k) for k in ("max_batch", "mode")} for b in state["plan"]["greedy"]]


def test_planned_greedy_equals_ar_sequential(server, heldout_ids, ar_reference):
    check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=False)
    assert 11 in _widths_served(server)  # batch 1: the first bucket


def test_planned_greedy_equals_ar_burst(server, heldout_ids, ar_reference):
    check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=True)
    assert WIDTHS <= _widths_served(server), _widths_served(server)
    assert wait_tokens_zero(server.base_url) == 0
    from sglang_fixtures import internal_state

    kinds = internal_state(server.base_url)["selfspec"]["steps_by_kind"]
    assert kinds.get("lookup", {}).get("steps", 0) > 0, kinds  # the lookup bucket ran
    # the AR bucket's one-token steps ran, at its batch sizes (6-8) on the ragged verify path
    # (this CPU's choice above batch 1), not SGLang's decode forward: a batch-16 AR step costs
    # ~20% less there
    state = internal_state(server.base_url)["selfspec"]
    assert state["ar_steps"] > state["ar_steps_as_decode"], state
    # ... and every one of them took SGLang's plain decode preparation (one KV slot per request,
    # no reservation of the verify width), between speculative steps of the same requests: the
    # KV back to 0 above says the two preparations share the requests' rows without a leak
    assert state["ar_steps_plain"] == state["ar_steps"], state
    # the online check measured the planned buckets against plain AR steps while serving
    checked = state["online_check"]
    assert any(c["plan_rate"] > 0 and c["ar_rate"] > 0 for c in checked.values()), checked


def test_planned_sampling_matches_the_ar_servers_sampling(server, ar_reference):
    check_sampling_matches_ar(server.base_url, ar_reference)


def test_fuzzed_request_mixes_isd_with_a_plan(server, heldout_ids, ar_reference, tokenizer, tiny_base_path):
    """Mixes of every request feature sent at once (`sglang_fixtures.check_fuzz`): no 5xx, AR's
    statuses, greedy outputs equal to AR's, no [MASK] token, no KV left."""
    from sglang_fixtures import check_fuzz

    statuses = check_fuzz(server.base_url, heldout_ids, ar_reference, tiny_base_path,
                          mask_token_id=tokenizer.mask_token_id)
    assert statuses.get(200, 0) >= 60, statuses
