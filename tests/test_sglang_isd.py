"""ISD served by stock SGLang through the selfspec plugin (`--speculative-algorithm ISD`).

One ISD server (module scope) on tiny-base: its tokenizer has a [MASK] token, so ISD runs on it
losslessly even though the untrained mask embedding proposes poorly. It runs ISD alone on every
step (`--selfspec-policy own`; the default policy is served by the JACOBI and RISD modules). It verifies context n-gram
candidates beside the proposals (`context_tokens=4`), so steps with and without a candidate
branch both run through the worker; from the request's own text only (`context_corpus=false`), so
that each request takes the forwards the reference engine takes (the corpus across requests is
tested on the SJD server). The server runs on SGLang's default path (radix cache on,
prefill in chunks of 16 tokens), so repeated prompts reuse cached prefixes. Besides the lossless check,
this module carries the request-level edge cases shared by every mode (they exercise the same
worker): seeded sampling, max_tokens, stop strings and stop tokens, streaming, abort, KV usage.
"""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from sglang_fixtures import (
    FUZZ_SCHEMA,
    MAX_NEW,
    burst,
    check_lossless,
    check_sampling_matches_ar,
    mode_server_fixture,
    native_generate,
    tokens_in_use,
    wait_tokens_zero,
)

pytestmark = pytest.mark.server

ISD_OPTIONS = {"stride": 3, "context_tokens": 4, "context_corpus": False}
# the aggregate gauges (and log line) every 2 steps (default 40): the metrics test sees its own
# steps flushed whichever test ran before it
server = mode_server_fixture("isd", ["--speculative-algorithm", "ISD", "--selfspec-stride", "3", "--enable-metrics",
                                     "--selfspec-policy", "own",
                                     "--selfspec-options", "context_tokens=4,context_corpus=false"],
                             env={"SELFSPEC_LOG_EVERY": "2"}, default_path=True)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)


def test_isd_greedy_equals_ar_sequential(server, heldout_ids, ar_reference):
    res = check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=False)
    meta = res["metas"][0]
    assert meta["selfspec_mode"] == "ISD"
    assert meta["spec_verify_ct"] >= 1
    assert meta["selfspec_tpf"] == pytest.approx(meta["completion_tokens"] / (meta["spec_verify_ct"] + 1))
    assert meta["selfspec_accept_length"] >= 1.0


def test_served_steps_are_the_reference_engines(server, heldout_ids, tiny_base_path):
    """The worker runs the decoding core's plan: per request, as many forwards as the HF engine
    takes for the same mode options (candidate branches included)."""
    import torch

    from selfspec.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(tiny_base_path, dtype=torch.float32)
    ids = heldout_ids[:8]
    ref = engine.generate(ids, MAX_NEW, mode="isd", mode_config=ISD_OPTIONS)
    served = [native_generate(server.base_url, p)["meta_info"] for p in ids]
    assert [m["spec_verify_ct"] + 1 for m in served] == [o.metrics.forwards for o in ref]
    plain = engine.generate(ids, MAX_NEW, mode="isd", mode_config={"stride": 3, "context_corpus": False})
    assert sum(o.metrics.forwards for o in ref) < sum(o.metrics.forwards for o in plain)


def test_isd_greedy_equals_ar_burst_and_kv_released(server, heldout_ids, ar_reference):
    check_lossless(server.base_url, heldout_ids, ar_reference, concurrent=True)
    assert wait_tokens_zero(server.base_url) == 0


def test_openai_client_text_equals_ar(client, heldout_ids, ar_reference, tokenizer):
    for ids, ref in list(zip(heldout_ids, ar_reference["output_ids"]))[:4]:
        out = client.completions.create(model="default", prompt=ids, max_tokens=MAX_NEW, temperature=0)
        assert out.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
        assert out.usage.completion_tokens == len(ref)


def test_chat_completion_equals_ar(client, ar_reference):
    from sglang_fixtures import CHAT_REQUEST

    want = ar_reference["endpoints"]["chat"]
    out = client.chat.completions.create(model="default", temperature=0, **CHAT_REQUEST)
    assert out.choices[0].message.content == want["content"]
    assert out.usage.completion_tokens == want["usage"]["completion_tokens"]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 7])
def test_max_tokens_exact(server, heldout_ids, ar_reference, max_tokens):
    ids, ref = heldout_ids[1], ar_reference["output_ids"][1]
    out = native_generate(server.base_url, ids, max_new_tokens=max_tokens)
    assert out["output_ids"] == ref[:max_tokens]
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_stop_token_exact(server, heldout_ids, ar_reference):
    ids, ref = heldout_ids[2], ar_reference["output_ids"][2]
    k = 5  # stop at the first occurrence of the reference's 6th token
    stop_tok = ref[k]
    first = ref.index(stop_tok)
    out = native_generate(server.base_url, ids, stop_token_ids=[stop_tok])
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["output_ids"][:first] == ref[:first]
    assert len(out["output_ids"]) <= first + 1


def test_stop_string_exact(client, heldout_ids, ar_reference, tokenizer):
    ids, ref = heldout_ids[3], ar_reference["output_ids"][3]
    full = tokenizer.decode(ref, skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop and stop in full
    want = full[: full.index(stop)]
    out = client.completions.create(model="default", prompt=ids, max_tokens=MAX_NEW, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == want


def test_streaming_equals_non_streaming(client, heldout_ids):
    kwargs = dict(model="default", prompt=heldout_ids[4], max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == whole.usage.completion_tokens


def test_streaming_with_stop_and_tiny_max_tokens(client, heldout_ids, tokenizer, ar_reference):
    ids, ref = heldout_ids[5], ar_reference["output_ids"][5]
    one = list(client.completions.create(model="default", prompt=ids, max_tokens=1, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in one if c.choices) == tokenizer.decode(ref[:1], skip_special_tokens=True)
    full = tokenizer.decode(ref, skip_special_tokens=True)
    stop = full[len(full) // 3: len(full) // 3 + 2]
    chunks = list(client.completions.create(model="default", prompt=ids, max_tokens=MAX_NEW, temperature=0,
                                            stream=True, stop=[stop]))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full[: full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1] == "stop"


def test_sampling_valid_and_reproducible_with_seed(server, heldout_ids, tokenizer, ar_reference):
    ids = heldout_ids[6]
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50)
    a = native_generate(server.base_url, ids, sampling_seed=1234, **kw)
    b = native_generate(server.base_url, ids, sampling_seed=1234, **kw)
    c = native_generate(server.base_url, ids, sampling_seed=99, **kw)
    assert a["output_ids"] == b["output_ids"]
    assert len(a["output_ids"]) == 24 or a["meta_info"]["finish_reason"]["type"] == "stop"
    assert all(0 <= t < len(tokenizer) for t in a["output_ids"]) and tokenizer.mask_token_id not in a["output_ids"]
    # sampled, not greedy; and the seed decides
    assert a["output_ids"] != ar_reference["output_ids"][6][:24] and c["output_ids"] != a["output_ids"]
    # a seeded request is reproducible whatever runs beside it
    outs = burst(lambda s: native_generate(server.base_url, ids, sampling_seed=s, **kw), [1234, 99, 7, 1234])
    assert outs[0]["output_ids"] == a["output_ids"] == outs[3]["output_ids"]
    assert outs[1]["output_ids"] == c["output_ids"]


def test_isd_sampling_matches_the_ar_servers_sampling(server, ar_reference):
    check_sampling_matches_ar(server.base_url, ar_reference)


def test_sampling_through_openai_client_with_seed(client, heldout_ids):
    kw = dict(model="default", prompt=heldout_ids[7], max_tokens=16, temperature=1.0, seed=5)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_aborted_stream_frees_kv_and_server_keeps_serving(client, server, heldout_ids, ar_reference):
    stream = client.completions.create(model="default", prompt=heldout_ids[8], max_tokens=3000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got >= 3:
            break
    assert tokens_in_use(server.base_url) > 0  # the request holds KV while it runs
    stream.close()
    deadline = time.time() + 60
    while tokens_in_use(server.base_url) and time.time() < deadline:
        time.sleep(0.5)
    assert tokens_in_use(server.base_url) == 0
    out = native_generate(server.base_url, heldout_ids[9])
    assert out["output_ids"] == ar_reference["output_ids"][9]


def test_unsupported_request_gets_400(server, heldout_ids):
    import urllib.error

    from sglang_fixtures import post_json

    with pytest.raises(urllib.error.HTTPError) as info:
        post_json(server.base_url, "/generate", {"input_ids": heldout_ids[0],
                                                 "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                                                     "beam_width": 2, "n": 2}})
    assert info.value.code == 400
    assert "beam" in info.value.read().decode()


def test_logprobs_through_the_openai_client_streaming_included(client, heldout_ids, ar_reference):
    want = ar_reference["logprobs"][0]
    kw = dict(model="default", prompt=heldout_ids[0], max_tokens=16, temperature=0, logprobs=3)
    out = client.completions.create(**kw)
    lps = out.choices[0].logprobs
    assert abs(lps.token_logprobs[0] - want["logprobs"][0]) < 1e-4 and len(lps.token_logprobs) == 16
    assert len(lps.top_logprobs[0]) == 3
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert len(streamed) == 16 and max(abs(a - b) for a, b in zip(streamed, want["logprobs"])) < 1e-4
    chat = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Sort a list."}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) >= 1 and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def test_aggregate_tpf_in_metrics_and_server_info(server, heldout_ids):
    from sglang_fixtures import check_own_steps, internal_state

    before = internal_state(server.base_url)["selfspec"]
    # short max_tokens and a stop token: steps emit runs that SGLang truncates
    outs = burst(lambda ids: native_generate(server.base_url, ids, max_new_tokens=13, stop_token_ids=[ids[-1]]),
                 heldout_ids[:8])
    state = internal_state(server.base_url)
    assert state["selfspec"]["mode"] == "ISD" and state["selfspec"]["tokens_per_forward"] >= 1.0
    after = state["selfspec"]
    metas = [o["meta_info"] for o in outs]
    assert after["requests"] - before["requests"] == 8
    # the aggregate is the per-request numbers summed: kept tokens, forwards = verify steps + prefill
    assert after["committed_tokens"] - before["committed_tokens"] == sum(m["completion_tokens"] for m in metas)
    assert after["forwards"] - before["forwards"] == sum(m.get("spec_verify_ct", 0) + 1 for m in metas)
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    assert "sglang:spec_accept_length" in text
    assert 'selfspec:tokens_per_forward{mode="ISD"}' in text
    # ISD's own steps committed every token of the burst but each request's first, its prefill's
    # (`--selfspec-policy own`: no lookup or AR steps); the steps also count what SGLang then cut
    # at the stop token or max_tokens
    kinds = check_own_steps(server.base_url, "ISD", before)
    assert {k for k, v in kinds.items() if v} == {"own"}, kinds
    assert kinds["own"] >= after["committed_tokens"] - before["committed_tokens"] - len(metas)


def test_a_request_finished_by_its_prefill_is_counted_at_once(server, heldout_ids):
    """SGLang's finish hook runs for requests a decode step finishes, not for one its prefill
    finishes (max_new_tokens=1); a metrics read in between must still count it (a fresh server's
    start-up probe did: a later burst read one request too many)."""
    from sglang_fixtures import internal_state, wait_tokens_zero

    before = internal_state(server.base_url)["selfspec"]
    out = native_generate(server.base_url, heldout_ids[0], max_new_tokens=1)
    assert wait_tokens_zero(server.base_url) == 0
    after = internal_state(server.base_url)["selfspec"]
    assert out["meta_info"]["completion_tokens"] == 1
    assert (after["requests"] - before["requests"], after["forwards"] - before["forwards"],
            after["committed_tokens"] - before["committed_tokens"]) == (1, 1, 1)


def test_isd_penalties_bias_min_tokens_equal_ar(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_rules_match_ar

    check_rules_match_ar(server.base_url, heldout_ids, ar_reference)


#: greedy requests with penalties under a grammar: a JSON schema with a string and an integer
#: member, and a digits regex with a biased digit (stock AR answered this one differently after
#: other requests had run: tests/sglang_fixtures.py, check_fuzz)
PENALISED_GRAMMARS = [
    (i, {"json_schema": FUZZ_SCHEMA, "frequency_penalty": 0.2, "repetition_penalty": 1.1}) for i in range(4)
] + [(3, {"regex": "[0-9]{1,6}", "frequency_penalty": 0.6, "repetition_penalty": 1.3, "min_new_tokens": 7,
          "logit_bias": {"92": -3.0, "176": -3.0, "20": 3.0}})]


def test_penalised_grammar_requests_equal_the_reference_engine(server, heldout_ids, tiny_base_path):
    """Penalties counted along a grammar-constrained greedy output, alone and in a burst: the
    reference engine's answer (penalties and the grammar applied token by token)."""
    from sglang_fixtures import reference_engine_greedy

    requests = [{"prompt": i, "return_logprob": False, "sampling_params": {"temperature": 0, "max_new_tokens": 24, **sp}}
                for i, sp in PENALISED_GRAMMARS]
    want = [reference_engine_greedy(r, heldout_ids, tiny_base_path) for r in requests]

    def answer(r):
        return native_generate(server.base_url, heldout_ids[r["prompt"]], **r["sampling_params"])["output_ids"]
    assert [answer(r) for r in requests] == want
    assert burst(answer, requests, len(requests)) == want


def test_isd_logprobs_equal_ar(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_logprobs_match_ar

    check_logprobs_match_ar(server.base_url, heldout_ids, ar_reference)


def test_isd_mixed_greedy_and_sampled_burst(server, heldout_ids, ar_reference):
    from sglang_fixtures import check_mixed_burst

    check_mixed_burst(server.base_url, heldout_ids, ar_reference)


@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.5, "min_p": 0.05}])
def test_seeded_sampling_equals_the_reference_engine(server, heldout_ids, tiny_base_path, extra):
    """A seeded sampled request served equals the HF engine's run of the same mode and seed."""
    import torch

    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(tiny_base_path, dtype=torch.float32)
    sp = SamplingParams(0.8, top_k=30, top_p=0.9, **extra)
    for i in (10, 11, 12):
        ref = engine.generate([heldout_ids[i]], 24, sp, seed=[4321 + i], mode="isd", mode_config=ISD_OPTIONS)
        got = native_generate(server.base_url, heldout_ids[i], 24, temperature=0.8, top_k=30, top_p=0.9,
                              sampling_seed=4321 + i, **extra)
        assert got["output_ids"] == ref[0].token_ids, i


def test_fuzzed_request_mixes_isd(server, heldout_ids, ar_reference, tokenizer, tiny_base_path):
    """Mixes of every request feature sent at once (`sglang_fixtures.check_fuzz`): no 5xx, AR's
    statuses, greedy outputs equal to AR's, no [MASK] token, no KV left."""
    from sglang_fixtures import check_fuzz

    statuses = check_fuzz(server.base_url, heldout_ids, ar_reference, tiny_base_path,
                          mask_token_id=tokenizer.mask_token_id)
    assert statuses.get(200, 0) >= 60, statuses
