"""The HF reference engine in AR mode: exactness, batching, stop conditions, seeds, loading."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.step import ModeUnavailable
from selfspec.engines.hf import GenerationOutput, HFEngine
from model_helpers import compare_greedy, random_prompts, tiny_qwen3

VOCAB = 97


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small forwards: 1 thread is faster


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(VOCAB, seed=0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(24, VOCAB, 1, 14, seed=1)


@torch.no_grad()
def naive_greedy(model, prompt, max_new, stops):
    """Greedy decoding without a KV cache: a full forward per token."""
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stops:
            break
    return out


def pick_stop_token(outputs: list[list[int]]) -> int:
    """The token whose first occurrence ends about half of the sequences."""
    counts = {}
    for toks in outputs:
        for t in set(toks[1:]):
            counts[t] = counts.get(t, 0) + 1
    return min(counts, key=lambda t: abs(counts[t] - len(outputs) / 2))


def test_ar_greedy_matches_uncached_reference_batched_and_unbatched(model, prompts):
    engine = HFEngine(model)
    free = engine.generate(prompts, 20, stop_token_ids=[], batch_size=8)
    stop = pick_stop_token([o.token_ids for o in free])
    ref = [naive_greedy(model, p, 20, {stop}) for p in prompts]
    for bs in (1, 8, None):
        outs = engine.generate(prompts, 20, stop_token_ids=[stop], batch_size=bs)
        assert all(isinstance(o, GenerationOutput) for o in outs)
        cmp = compare_greedy(model, prompts, [o.token_ids for o in outs], ref)
        assert not cmp.failures, cmp.failures
        print(f"AR batch {bs}: {cmp.identical}/{cmp.compared} identical, {cmp.excused} excused near ties")
    reasons = {o.finish_reason for o in outs}
    assert reasons == {"stop", "length"}  # the chosen stop token really stops some sequences


def test_stop_tokens_and_max_new_tokens_are_exact(model, prompts):
    engine = HFEngine(model)
    free = engine.generate(prompts, 16, stop_token_ids=[])
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in free)
    stop = pick_stop_token([o.token_ids for o in free])
    outs = engine.generate(prompts, 16, stop_token_ids=[stop, 10_000])
    for f, o in zip(free, outs):
        if stop in f.token_ids:
            k = f.token_ids.index(stop)
            assert o.token_ids == f.token_ids[: k + 1] and o.finish_reason == "stop"
        else:
            assert o.token_ids == f.token_ids and o.finish_reason == "length"
    assert engine.generate(prompts[:2], 0) == [GenerationOutput([], "length", outs[0].metrics.__class__())] * 2
    one = engine.generate(prompts[:3], 1, stop_token_ids=[])
    assert [len(o.token_ids) for o in one] == [1, 1, 1]


def test_default_stop_ids_come_from_generation_config(prompts):
    model = tiny_qwen3(VOCAB, seed=0)
    engine = HFEngine(model)
    free = engine.generate(prompts, 12, stop_token_ids=[])
    stop = pick_stop_token([o.token_ids for o in free])
    model.generation_config.eos_token_id = [stop, 10_001]
    outs = engine.generate(prompts, 12)
    assert any(o.finish_reason == "stop" for o in outs)
    for o in outs:
        assert stop not in o.token_ids[:-1]
        assert (o.finish_reason == "stop") == (o.token_ids[-1] == stop)


def test_metrics_of_ar(model, prompts):
    outs = HFEngine(model).generate(prompts[:4], 9, stop_token_ids=[])
    for o in outs:
        m = o.metrics
        assert m.forwards == 9 and m.committed_tokens == 9 and m.query_tokens == 9
        assert m.tokens_per_forward == 1.0 and m.compute_overhead == 1.0
        assert dict(m.accept_hist) == {1: 8}


def test_sampling_is_seeded_and_independent_of_batch_composition(model, prompts):
    engine = HFEngine(model)
    params = [SamplingParams(1.0), SamplingParams(0.7, top_k=20), SamplingParams(1.2, top_p=0.8), SamplingParams()]
    params = (params * 6)[: len(prompts)]
    seeds = list(range(100, 100 + len(prompts)))
    a = engine.generate(prompts, 12, params, seed=seeds, stop_token_ids=[], batch_size=None)
    b = engine.generate(prompts, 12, params, seed=seeds, stop_token_ids=[], batch_size=5)
    c = engine.generate(prompts[::-1], 12, params[::-1], seed=seeds[::-1], stop_token_ids=[], batch_size=7)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] == [o.token_ids for o in c][::-1]
    # a single sequence alone gives the same tokens as inside the batch
    solo = engine.generate([prompts[5]], 12, params[5], seed=[seeds[5]], stop_token_ids=[])
    assert solo[0].token_ids == a[5].token_ids
    # greedy rows in a mixed batch are the greedy output
    greedy = engine.generate(prompts, 12, stop_token_ids=[])
    assert all(a[i].token_ids == greedy[i].token_ids for i in range(3, len(prompts), 4))
    # other seeds give other samples; an int seed gives seed + i to sequence i
    d = engine.generate(prompts, 12, params, seed=7, stop_token_ids=[])
    assert [o.token_ids for o in d] != [o.token_ids for o in a]
    e = engine.generate(prompts[1:2], 12, params[1], seed=8, stop_token_ids=[])
    assert e[0].token_ids == d[1].token_ids


def test_sampling_respects_top_k(model, prompts):
    engine = HFEngine(model)
    outs = engine.generate(prompts[:8], 10, SamplingParams(5.0, top_k=1), seed=0, stop_token_ids=[])
    greedy = engine.generate(prompts[:8], 10, stop_token_ids=[])
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_bad_arguments(model):
    engine = HFEngine(model)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], 4)
    with pytest.raises(ValueError, match="unknown decoding mode"):
        engine.generate([[1]], 4, mode="beam")
    with pytest.raises(ValueError, match="greedy only"):
        engine.generate([[1]], 4, SamplingParams(1.0), mode="jacobi")
    with pytest.raises(ModeUnavailable, match="MASK"):
        engine.generate([[1]], 4, mode="isd")
    with pytest.raises(ValueError, match="unknown isd option"):
        engine.generate([[1]], 4, mode="isd", mode_config={"strid": 3})


def test_from_pretrained_with_metadata(tmp_path, prompts):
    model = tiny_qwen3(VOCAB, seed=3, eos_token_id=5)
    model.save_pretrained(tmp_path)
    (tmp_path / "selfspec.json").write_text(json.dumps({"mode": "ISD", "stride": 3, "mask_token_id": 96}))
    engine = HFEngine.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert engine.metadata.stride == 3 and engine.resolve_mask_token() == 96
    assert engine.default_stop_ids() == [5]
    ref = HFEngine(model).generate(prompts[:6], 10)
    outs = engine.generate(prompts[:6], 10)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    isd = engine.generate(prompts[:6], 10, mode="isd")  # stride and mask token from selfspec.json
    assert [o.token_ids for o in isd] == [o.token_ids for o in ref]
    assert all(o.metrics.query_tokens - 1 == 5 * (o.metrics.forwards - 1) for o in isd)  # fixed width 2N-1


def test_sliding_window_models_are_refused():
    model = tiny_qwen3(VOCAB)
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    with pytest.raises(NotImplementedError, match="sliding"):
        HFEngine(model)
