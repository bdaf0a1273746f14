"""Every mode under SGLang's own tensor and data parallelism, on this CPU: 2 scheduler processes
per server (gloo collectives, one CPU each), each compared with the single-process AR server.

Per server (ISD, RISD, JACOBI, SJD at `--tp-size 2`; ISD at `--dp-size 2`, see CASES):
- a 16-concurrent burst of the held-out prompts returns AR's greedy output token for token (through
  the OpenAI client and the native API), and KV usage is back to 0 after it on every
  data-parallel rank (/server_info reports rank 0 of a tensor-parallel group, whose ranks run the
  same scheduler decisions: a divergence would hang their collectives, not show up here);
- the worker runs the decoding core's plan on every rank: per request, as many forwards as the
  reference engine takes (a rank that decided differently would desynchronise the collectives or
  change the count), and RISD's sharded adapter proposes exactly what the whole adapter does.
  Context candidates come from the request's own text here (`context_corpus=false`): a server's
  corpus of earlier requests is not the reference engine's (it is tested on one process, in
  `test_sglang_sjd.py`; every rank feeds its corpus the same steps in the same order). Each
  server runs its mode alone (`--selfspec-policy own`): the default policy's buckets follow the
  batch, which a burst does not fix step by step; under tensor parallelism its run-time check
  is off (`worker.timing_check_allowed`), so every rank follows the plan as written;
- seeded sampled requests equal the reference engine's run of the same seed: every rank draws the
  same numbers (the seed is derived from the request, never from a rank's own RNG);
- the server-wide metrics summed over the data-parallel ranks are the per-request numbers summed
  (a tensor-parallel pair reports once, not twice).
"""

from __future__ import annotations

import pytest
import torch
from sglang_fixtures import (
    MAX_NEW,
    burst,
    check_lossless,
    native_generate,
    post_json,
    server_args,
    start_server,
)

pytestmark = pytest.mark.server

#: name -> (model as a user names it, SGLang arguments, the HF engine's mode and options)
MODES = {
    "isd": ("tiny-base", ["--speculative-algorithm", "ISD", "--selfspec-policy", "own", "--selfspec-stride", "3",
                          "--selfspec-options", "context_tokens=4,context_corpus=false"],
            ("isd", {"stride": 3, "context_tokens": 4, "context_corpus": False})),
    "risd": ("tiny-idlm-lora", ["--selfspec-policy", "own"], ("risd", {})),
    "jacobi": ("tiny-base", ["--speculative-algorithm", "JACOBI", "--selfspec-policy", "own", "--selfspec-options",
                             "block_size=8,max_blocks=2,verify_size=3,ngram_size=4,context_tokens=7,context_corpus=false"],
               ("jacobi", {"block_size": 8, "max_blocks": 2, "verify_size": 3, "ngram_size": 4,
                           "context_tokens": 7, "context_corpus": False})),
    "sjd": ("tiny-base", ["--speculative-algorithm", "SJD", "--selfspec-policy", "own", "--selfspec-options",
                          "window=4,history_offset=8,context_tokens=4,context_corpus=false"],
            ("sjd", {"window": 4, "history_offset": 8, "context_tokens": 4, "context_corpus": False})),
}
PARALLEL = {"tp": ["--tp-size", "2"], "dp": ["--dp-size", "2"]}
#: Every selfspec mode at --tp-size 2: its ranks must take the same decisions in lock step (one
#: rank's different choice hangs the collectives), RISD's adapter is sharded. At --dp-size 2 each
#: rank is a whole single-process scheduler running the code the single-process tests cover; what
#: data parallelism adds (requests split over ranks, metrics summed over them) is mode-independent,
#: so one mode covers it. AR at either size is SGLang's own code alone (the CPU fixes it needs are
#: exercised by every row). Each case is a server start (~1 min here), hence no full matrix.
CASES = [("tp", m) for m in MODES if m != "jacobi"] + [("dp", "isd"), ("tp", "jacobi")]
#: (JACOBI last: it is not in SAMPLED_CASES, and only this order lets pytest keep each server's tests
#: together: otherwise a server is started twice and a test meets a fresh server)
#: the sampled selfspec modes (JACOBI is greedy by design)
SAMPLED_CASES = [c for c in CASES if c[1] in ("isd", "risd", "sjd")]


def cases(which: list) -> pytest.MarkDecorator:
    """Run a test on these servers (one module-scoped server per case, shared by the tests)."""
    return pytest.mark.parametrize("case", which, indirect=True, ids=[f"{p}-{m}" for p, m in which])


@pytest.fixture(scope="module")
def case(request, tmp_path_factory, ar_reference):  # ar_reference first: its server is gone by now
    parallel, mode = request.param
    model, extra, engine_mode = MODES[mode]
    # SGLang's default path (radix cache, prompts prefilled in 16-token chunks)
    proc = start_server(tmp_path_factory, f"{parallel}-{mode}",
                        server_args("--chunked-prefill-size", "16", *PARALLEL[parallel], *extra), model=model)
    yield {"server": proc, "parallel": parallel, "mode": mode, "model": model, "engine_mode": engine_mode}
    proc.stop()


@pytest.fixture(scope="module")
def engines():
    """Reference engines by model name, loaded once per module."""
    from selfspec.engines.hf import HFEngine

    cache: dict = {}

    def get(model: str):
        if model not in cache:
            cache[model] = HFEngine.from_pretrained(model, dtype=torch.float32)
        return cache[model]
    return get


def server_info(base_url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(base_url + "/server_info", timeout=60) as r:
        return json.loads(r.read())


def rank_states(base_url: str) -> list[dict]:
    """/server_info's internal state of each data-parallel rank (tensor-parallel ranks share one)."""
    return server_info(base_url)["internal_states"]


def wait_all_ranks_idle(base_url: str, timeout: float = 30.0) -> list[int]:
    import time

    deadline = time.time() + timeout
    used = [s["kv_tokens_in_use"] for s in rank_states(base_url)]
    while any(used) and time.time() < deadline:
        time.sleep(0.5)
        used = [s["kv_tokens_in_use"] for s in rank_states(base_url)]
    return used


@cases(CASES)
def test_started_with_the_parallel_layout(case):
    info = server_info(case["server"].base_url)
    assert (info["tp_size"], info["dp_size"]) == ((2, 1) if case["parallel"] == "tp" else (1, 2)), info
    assert len(info["internal_states"]) == (2 if case["parallel"] == "dp" else 1)


@cases(CASES)
def test_burst_equals_single_process_ar_and_every_rank_releases_kv(case, heldout_ids, ar_reference):
    res = check_lossless(case["server"].base_url, heldout_ids, ar_reference, concurrent=True)
    assert all(m["selfspec_mode"] == case["mode"].upper() for m in res["metas"])
    states = [s["selfspec"] for s in rank_states(case["server"].base_url)]  # the worker's own counts
    assert all(s["mode"] == case["mode"].upper() for s in states), [s["mode"] for s in states]
    own = [s["steps_by_kind"].get("own", {}).get("tokens", 0) for s in states]
    assert sum(own) > 0, f"no tokens from {case['mode']}'s own steps on any rank: {states}"
    used = wait_all_ranks_idle(case["server"].base_url)
    assert used == [0] * len(used), used


@cases(CASES)
def test_every_rank_runs_the_reference_engines_plan(case, heldout_ids, engines):
    mode, options = case["engine_mode"]
    ids = heldout_ids[:8]
    ref = engines(case["model"]).generate(ids, MAX_NEW, mode=mode, mode_config=options)
    served = burst(lambda p: native_generate(case["server"].base_url, p)["meta_info"], ids, len(ids))
    # (for RISD: the sharded adapter proposes what the whole adapter does, or the counts differ)
    assert [m["spec_verify_ct"] + 1 for m in served] == [o.metrics.forwards for o in ref]


@cases(SAMPLED_CASES)
def test_seeded_sampling_equals_the_reference_engine(case, heldout_ids, engines, ar_reference):
    from selfspec.decoding.requests.sampling import SamplingParams

    mode, options = case["engine_mode"]
    ar_greedy = ar_reference["output_ids"]
    sp = SamplingParams(0.8, top_k=30, top_p=0.9)
    items = [10, 11, 12, 13]
    got = burst(lambda i: native_generate(case["server"].base_url, heldout_ids[i], 24, temperature=0.8, top_k=30,
                                          top_p=0.9, sampling_seed=4321 + i)["output_ids"], items, len(items))
    engine = engines(case["model"])
    for i, out in zip(items, got):
        ref = engine.generate([heldout_ids[i]], 24, sp, seed=[4321 + i], mode=mode, mode_config=options)
        assert out == ref[0].token_ids, i
    assert any(out != ar_greedy[i][:24] for i, out in zip(items, got))  # sampled, not greedy


@cases(CASES)
def test_metrics_sum_over_ranks_to_the_per_request_numbers(case, heldout_ids):
    url = case["server"].base_url
    wait_all_ranks_idle(url)
    before = [s["selfspec"] for s in rank_states(url)]
    outs = burst(lambda ids: native_generate(url, ids, max_new_tokens=13, stop_token_ids=[ids[-1]]), heldout_ids[:8])
    wait_all_ranks_idle(url)
    after = [s["selfspec"] for s in rank_states(url)]
    metas = [o["meta_info"] for o in outs]

    def total(states, key):
        return sum(s[key] for s in states)
    assert total(after, "requests") - total(before, "requests") == len(metas)
    assert total(after, "committed_tokens") - total(before, "committed_tokens") == sum(m["completion_tokens"]
                                                                                      for m in metas)
    assert total(after, "forwards") - total(before, "forwards") == sum(m.get("spec_verify_ct", 0) + 1 for m in metas)
    if case["parallel"] == "dp":  # round-robin: both data-parallel ranks served some
        assert all(a["requests"] > b["requests"] for a, b in zip(after, before))


@cases(CASES)
def test_batch_request_with_several_prompts(case, heldout_ids, ar_reference):
    """One native request carrying 4 prompts (SGLang splits it over the ranks' batches)."""
    body = {"input_ids": heldout_ids[:4], "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}}
    outs = post_json(case["server"].base_url, "/generate", body)
    assert [o["output_ids"] for o in outs] == ar_reference["output_ids"][:4]
