"""ISD step layout: what goes in, what is emitted, what becomes pending (pure functions), the
batched `ISDMode.finish` on hand-made logits, and the engine under oracle proposals that force
all-pass and rejection at every position."""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding.modes.isd import ISDConfig, ISDMode, ISDState, build_layout, consume
from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.step import DecodeSequence, StepContext, collate
from selfspec.engines.hf import HFEngine
from model_helpers import add_mask_token, random_prompts, tiny_qwen3

M = 99  # mask token id in the pure tests


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small forwards: 1 thread is faster


@pytest.mark.parametrize("stride", [2, 3, 4, 6])
def test_cold_start_layout(stride):
    fixed = build_layout(7, [], stride, M, fixed_width=True)
    assert fixed.tokens == [7] + [M] * (2 * stride - 2)
    assert fixed.gate == [False] + [True] * (2 * stride - 2)
    assert fixed.offsets is None and fixed.branch is None  # plain causal, positions 0..W-1
    var = build_layout(7, [], stride, M, fixed_width=False)
    assert var.tokens == [7] + [M] * (stride - 1)
    assert var.gate == [False] + [True] * (stride - 1)


@pytest.mark.parametrize("fixed", [True, False])
def test_propose_verify_layout(fixed):
    lay = build_layout(7, [1, 2, 3], 4, M, fixed_width=fixed)
    assert lay.tokens == [7, 1, 2, 3, M, M, M]
    assert lay.gate == [False] * 4 + [True] * 3
    with pytest.raises(ValueError):
        build_layout(7, [1, 2], 4, M, fixed_width=fixed)


def test_consume_cold_start():
    r = consume([], 0, 42, [5, 6, 7])
    assert r.emit == [42] and r.pending == 42 and r.keep == [0] and r.proposals == [5, 6, 7]


def test_consume_all_pass():
    r = consume([1, 2, 3], 3, 42, [5, 6, 7])
    assert r.emit == [1, 2, 3, 42]  # N new tokens
    assert r.pending == 42 and r.keep == [0, 1, 2, 3]  # pending + 3 accepted proposals cached
    assert r.proposals == [5, 6, 7]  # the MASK outputs become the bonus token's proposals


@pytest.mark.parametrize("k", [1, 2, 3])
def test_consume_rejection_at_every_position(k):
    r = consume([1, 2, 3], k - 1, 42, [5, 6, 7])
    assert r.emit == [1, 2, 3][: k - 1] + [42]  # k new tokens
    assert r.pending == 42 and r.keep == list(range(k))
    assert r.proposals == []  # MASK outputs discarded: a propose-only step follows


def test_config_validation():
    with pytest.raises(ValueError, match="1 with context_tokens > 0"):
        ISDConfig(stride=1)
    assert ISDConfig(stride=1, context_tokens=8).stride == 1  # a lookup step
    with pytest.raises(ValueError):
        ISDConfig(tau=-0.1)


def _logits_for(rows_argmax: list[list[int]], vocab: int = 16) -> torch.Tensor:
    width = max(len(r) for r in rows_argmax)
    logits = torch.zeros(len(rows_argmax), width, vocab)
    for b, row in enumerate(rows_argmax):
        for i, tok in enumerate(row):
            logits[b, i, tok] = 10.0
    return logits


def test_isd_mode_finish_batched():
    """Three sequences in one step: cold start, all-pass, rejection at q_2 (N = 3, fixed width)."""
    cfg = ISDConfig(stride=3)
    mode = ISDMode(cfg, mask_token_id=15)
    seqs = [DecodeSequence([1, 2, 3]) for _ in range(3)]
    for s in seqs:
        mode.start(s)
    seqs[1].state = ISDState([4, 5])
    seqs[2].state = ISDState([4, 5])
    lays = mode.layouts(seqs)
    assert [lay.tokens for lay in lays] == [[3, 15, 15, 15, 15], [3, 4, 5, 15, 15], [3, 4, 5, 15, 15]]
    assert all(lay.gate is None for lay in lays)  # ISD: no LoRA gate
    batch = collate(lays)
    # row i predicts token i+1: anchors then MASK outputs
    logits = _logits_for([
        [8, 9, 10, 0, 0],  # cold start: row 0 -> exact token 8; MASK rows 1, 2 -> proposals 9, 10
        [4, 5, 6, 11, 12],  # q_1=4, q_2=5 pass; bonus 6; MASK rows 3, 4 -> 11, 12
        [4, 7, 6, 11, 12],  # q_1 passes, q_2=5 rejected (anchor says 7)
    ])
    ctx = StepContext.from_params([SamplingParams()] * 3, torch.zeros(3, mode.seeds_per_step, dtype=torch.long))
    outs = mode.finish(seqs, batch, logits, ctx)
    assert [o.emit for o in outs] == [[8], [4, 5, 6], [4, 7]]
    assert [o.keep for o in outs] == [[0], [0, 1, 2], [0, 1]]
    assert [s.state.proposals for s in seqs] == [[9, 10], [11, 12], []]
    gated = ISDMode(cfg, mask_token_id=15, gated=True)
    assert gated.layouts(seqs)[0].gate == [False, False, False, True, True]  # seq 0 now verifies [9, 10]
    assert gated.layouts(seqs)[2].gate == [False, True, True, True, True]  # propose-only after rejection


class OracleISD(ISDMode):
    """ISD whose proposals are replaced by the true greedy continuation, corrupted at a
    position that cycles through none, 1, …, N−1: forces all-pass and every rejection."""

    def __init__(self, config, mask_token_id, reference: dict, vocab: int):
        super().__init__(config, mask_token_id)
        self.reference, self.vocab, self.steps = reference, vocab, 0

    def start(self, seq):
        super().start(seq)
        seq.state.prompt = tuple(seq.history[:-1])

    def finish(self, seqs, batch, logits, ctx):
        outs = super().finish(seqs, batch, logits, ctx)
        n = self.config.stride
        for s, o in zip(seqs, outs):
            if not s.state.proposals:
                continue
            prompt = s.state.prompt
            done = len(s.history) + len(o.emit) - len(prompt)
            oracle = (self.reference[prompt][done : done + n - 1] + [0] * n)[: n - 1]
            bad = self.steps % n
            if bad:
                oracle[bad - 1] = (oracle[bad - 1] + 1) % self.vocab
            s.state.proposals = oracle
            self.steps += 1
        return outs


@pytest.mark.parametrize("stride,fixed", [(3, True), (4, False)])
def test_engine_with_oracle_proposals(stride, fixed):
    model = tiny_qwen3(64, seed=2)
    mask_id = add_mask_token(model)
    prompts = random_prompts(8, 64, 2, 10, seed=3)
    engine = HFEngine(model, mask_token_id=mask_id)
    ref = engine.generate(prompts, 40, stop_token_ids=[])
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    mode = OracleISD(ISDConfig(stride=stride, fixed_width=fixed), mask_id, reference, 65)
    for bs in (1, 8):
        outs = engine.generate(prompts, 40, stop_token_ids=[], mode=mode, batch_size=bs)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        hist = {}
        for o in outs:
            for k, v in o.metrics.accept_hist.items():
                hist[k] = hist.get(k, 0) + v
        # all-pass steps commit N tokens; rejection at q_k commits k (k = 1 … N−1)
        assert set(hist) == set(range(1, stride + 1)), hist
        width = 2 * stride - 1
        for o in outs:
            q = o.metrics.query_tokens - 1
            if fixed:
                assert q == width * (o.metrics.forwards - 1)
            else:
                assert stride * (o.metrics.forwards - 1) <= q <= width * (o.metrics.forwards - 1)
