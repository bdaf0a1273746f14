"""The reference engine's seams: logits processors between the forward and the verify, per-step
callbacks, per-token logprobs, the caller's train/eval state, and the verify implementation
chosen once."""

from __future__ import annotations

import pytest
import torch

from selfspec.engines.generate import StepEvent
from selfspec.engines.hf import HFEngine
from model_helpers import add_mask_token, random_prompts, tiny_qwen3

VOCAB = 96
MAX_NEW = 20

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    m = tiny_qwen3(VOCAB, seed=3)
    m.mask_id = add_mask_token(m)
    return m.eval()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, VOCAB, 2, 12, seed=9)


def ban(tokens: list[int]):
    def processor(logits, seqs, batch):
        logits = logits.clone()
        logits[..., tokens] = float("-inf")
        return logits

    return processor


def test_processors_change_what_every_mode_verifies_against(model, prompts):
    plain = HFEngine(model, mask_token_id=model.mask_id).generate(prompts, MAX_NEW, stop_token_ids=[])
    common = sorted({t for o in plain for t in o.token_ids}, key=lambda t: -sum(o.token_ids.count(t) for o in plain))
    banned = common[:3]  # the most frequent tokens of the unconstrained output
    engine = HFEngine(model, mask_token_id=model.mask_id, processors=[ban(banned)])
    ar = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    assert not any(t in banned for o in ar for t in o.token_ids)
    assert [o.token_ids for o in ar] != [o.token_ids for o in plain]
    for mode, cfg in [("isd", {"stride": 3}), ("jacobi", {"block_size": 4}), ("sjd", {}), ("ngram", {})]:
        outs = engine.generate(prompts, MAX_NEW, stop_token_ids=[], mode=mode, mode_config=cfg, batch_size=4)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ar], mode


def test_callbacks_see_every_forward(model, prompts):
    events: list[StepEvent] = []
    engine = HFEngine(model, mask_token_id=model.mask_id)
    outs = engine.generate(prompts, MAX_NEW, stop_token_ids=[], mode="isd", mode_config={"stride": 3},
                           callbacks=[events.append])
    assert events[0].step == 0 and events[0].rows == list(range(len(prompts)))
    per_row: dict[int, int] = {}
    emitted: dict[int, list[int]] = {}
    for ev in events:
        assert ev.logits.shape[0] == len(ev.rows) == len(ev.outcomes) == len(ev.layouts)
        for i, out in zip(ev.rows, ev.outcomes):
            per_row[i] = per_row.get(i, 0) + 1
            emitted.setdefault(i, []).extend(out.emit)
    for i, o in enumerate(outs):
        assert per_row[i] == o.metrics.forwards  # one event per forward of the sequence, prefill included
        assert emitted[i][: len(o.token_ids)] == o.token_ids


def test_logprobs_are_the_models_and_agree_across_modes(model, prompts):
    engine = HFEngine(model, mask_token_id=model.mask_id)
    ar = engine.generate(prompts, MAX_NEW, stop_token_ids=[], logprobs=True)
    for p, o in zip(prompts[:4], ar):
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        want = [float(logp[len(p) - 1 + k, t]) for k, t in enumerate(o.token_ids)]
        assert o.logprobs == pytest.approx(want, abs=1e-4)
    for mode in ("isd", "jacobi", "sjd"):
        outs = engine.generate(prompts, MAX_NEW, stop_token_ids=[], mode=mode, logprobs=True, batch_size=4)
        for a, b in zip(outs, ar):
            assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4), mode


def test_logprobs_follow_stop_truncation(model, prompts):
    engine = HFEngine(model, mask_token_id=model.mask_id)
    free = engine.generate(prompts, MAX_NEW, stop_token_ids=[])
    stop = free[0].token_ids[5]
    for mode in ("ar", "isd"):
        outs = engine.generate(prompts, MAX_NEW, stop_token_ids=[stop], mode=mode, logprobs=True)
        assert outs[0].finish_reason == "stop"
        assert all(len(o.logprobs) == len(o.token_ids) for o in outs), mode


def test_engine_leaves_the_callers_train_state_alone(model, prompts):
    model.train()
    try:
        HFEngine(model).generate(prompts[:2], 4)
        assert model.training
    finally:
        model.eval()
    HFEngine(model).generate(prompts[:2], 4)
    assert not model.training


def test_verify_implementation_is_chosen_when_the_engine_is_built(model, prompts, monkeypatch):
    from selfspec.decoding.modes.verify import greedy_verify_reference

    monkeypatch.setenv("SELFSPEC_KERNELS", "reference")
    engine = HFEngine(model, mask_token_id=model.mask_id)
    assert engine.verify_ops.greedy is greedy_verify_reference
    monkeypatch.setenv("SELFSPEC_KERNELS", "no-such-choice")  # read once: a later change is not seen
    outs = engine.generate(prompts[:2], 8, mode="isd")
    assert all(len(o.token_ids) == 8 for o in outs)
