"""Watermarked sampling (SGLang's keyed selection, `decoding/requests/watermark.py`) on the reference
engine: every mode emits AR's watermarked tokens wherever a position is forced, the forced
tokens do not depend on the seed, SGLang's detector finds the watermark, and the contexts
forced in a step are the ones AR would force."""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding.requests import watermark
from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.step import DecodeSequence, StepLayout, StepOutcome, collate
from selfspec.engines.hf import HFEngine
from model_helpers import add_mask_token, tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "0123456789abcdef"
WINDOW = 3


def wm() -> watermark.WatermarkConfig:
    # built in the tests, not at import: it validates its key with SGLang's code, whose import
    # brings triton in, which must not happen before test_cpu_compat sets TRITON_INTERPRET
    return watermark.WatermarkConfig(KEY, context_window=WINDOW)
HOT = SamplingParams(temperature=1.3)  # a flat distribution: sampling differs from the forced token often


def first_repeat(prompt: list[int], out: list[int], h: int) -> int:
    """Index of the first output position whose context (last h tokens) came up before: up to
    there every position is forced, from there on it samples normally."""
    from sglang.srt.sampling.watermarking.detector import hash_context

    seen = set()
    seq = list(prompt)
    for i, tok in enumerate(out):
        c = hash_context(seq[-h:])
        if c in seen:
            return i
        seen.add(c)
        seq.append(tok)
    return len(out)


@pytest.fixture(scope="module")
def engine():
    model = tiny_qwen3(64, hidden_size=32, seed=5, initializer_range=0.05)
    return HFEngine(model, mask_token_id=add_mask_token(model))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 63, (8,), generator=gen).tolist() for _ in range(6)]


MODES = [("isd", {"stride": 3}), ("isd", {"stride": 3, "proposal": "argmax"}),
         ("isd", {"stride": 2, "context_tokens": 4}), ("sjd", None), ("sjd", {"context_tokens": 4})]


@pytest.mark.parametrize("mode,config", MODES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(MODES)])
def test_modes_emit_ars_watermarked_tokens(engine, prompts, mode, config):
    n = len(prompts)
    for sp in (HOT, SamplingParams(temperature=0.3, top_k=20, top_p=0.9)):
        ar = engine.generate(prompts, 32, sp, seed=list(range(n)), mode="ar", stop_token_ids=[], watermarks=[wm()] * n)
        got = engine.generate(prompts, 32, sp, seed=list(range(100, 100 + n)), mode=mode, mode_config=config,
                              stop_token_ids=[], watermarks=[wm()] * n)
        _check_forced_prefixes_equal(prompts, ar, got)
    # at the lower temperature drafts were accepted against the forced rows, not only AR steps taken
    assert sum(o.metrics.forwards for o in got) < sum(o.metrics.forwards for o in ar)


def _check_forced_prefixes_equal(prompts, ar, got) -> None:
    forced = 0
    for p, a, g in zip(prompts, ar, got):
        k = first_repeat(p, a.token_ids, WINDOW)
        assert g.token_ids[:k] == a.token_ids[:k], k
        forced += k
    assert forced >= 4 * len(prompts)  # the check covered real spans, not only the first tokens


def test_watermark_makes_forced_tokens_seed_independent_and_detectable(engine, prompts):
    from sglang.srt.sampling.watermarking.detector import WatermarkDetector

    n = len(prompts)
    a = engine.generate(prompts, 32, HOT, seed=list(range(n)), mode="isd", mode_config={"stride": 3},
                        stop_token_ids=[], watermarks=[wm()] * n)
    b = engine.generate(prompts, 32, HOT, seed=list(range(50, 50 + n)), mode="isd", mode_config={"stride": 3},
                        stop_token_ids=[], watermarks=[wm()] * n)
    plain = engine.generate(prompts, 32, HOT, seed=list(range(n)), mode="isd", mode_config={"stride": 3},
                            stop_token_ids=[])
    other = engine.generate(prompts, 32, HOT, seed=list(range(50, 50 + n)), mode="isd", mode_config={"stride": 3},
                            stop_token_ids=[])
    assert [o.token_ids for o in plain] != [o.token_ids for o in other]  # without it, seeds matter
    det = WatermarkDetector(KEY, context_window=WINDOW)
    for p, x, y, z in zip(prompts, a, b, plain):
        k = first_repeat(p, x.token_ids, WINDOW)
        assert x.token_ids[:k] == y.token_ids[:k]
        marked = det.detect_tokens(x.token_ids, prompt_token_ids=p).combined
        unmarked = det.detect_tokens(z.token_ids, prompt_token_ids=p).combined
        assert marked.z_score > unmarked.z_score
    scores = [det.detect_tokens(x.token_ids, prompt_token_ids=p).combined for p, x in zip(prompts, a)]
    assert sum(s.z_score for s in scores) / n > 2.0


def test_greedy_requests_are_not_watermarked(engine, prompts):
    n = len(prompts)
    ar = engine.generate(prompts, 16, SamplingParams(), mode="ar", stop_token_ids=[])
    marked = engine.generate(prompts, 16, SamplingParams(), mode="isd", mode_config={"stride": 3}, stop_token_ids=[],
                         watermarks=[wm()] * n)
    assert [o.token_ids for o in marked] == [o.token_ids for o in ar]


def test_a_context_is_forced_once_along_the_rows_path():
    """Rows whose context was forced before, or is forced at an ancestor row, sample normally;
    a sibling on another branch with the same context is forced (AR would reach it first)."""
    from sglang.srt.sampling.watermarking.detector import hash_context

    vocab = 16
    seq = DecodeSequence([1, 2, 3, 7, 7], SamplingParams(temperature=1.0))
    seq.watermark = watermark.SequenceWatermark(watermark.WatermarkConfig(KEY, context_window=2))
    # pending 7, then branch 1: [7, 7]; branch 2: [7]. Row contexts (h=2): row0 (7,7), row1 (7,7),
    # row2 (7,7), row3 (7,7): every row repeats row 0's context.
    step = collate([StepLayout([7, 7, 7, 7], branch=[0, 1, 1, 2])])
    logits = torch.zeros(1, 4, vocab)
    out = watermark.force(logits, [seq], step)
    forced = {r for r in range(4) if torch.isinf(out[0, r]).any()}
    assert forced == {0}  # rows 1-3 all have row 0 as an ancestor
    watermark.commit([seq], [StepOutcome([5, 6], [0, 1], 1)])
    assert seq.watermark.forced == {hash_context([7, 7])}
    # a context already forced is not forced again
    out = watermark.force(torch.zeros(1, 1, vocab), [seq], None)
    assert not torch.isinf(out).any()
    # distinct contexts on sibling branches: both forced, and a row under a forced ancestor too
    seq2 = DecodeSequence([1, 2], SamplingParams(temperature=1.0))
    seq2.watermark = watermark.SequenceWatermark(watermark.WatermarkConfig(KEY, context_window=2))
    step = collate([StepLayout([2, 4, 5, 6], branch=[0, 1, 1, 2])])
    out = watermark.force(torch.zeros(1, 4, vocab), [seq2], step)
    assert all(torch.isinf(out[0, r]).any() for r in range(4))
    # rows seeing the skip token (ISD's [MASK]) make proposals and are left alone
    seq3 = DecodeSequence([1, 2], SamplingParams(temperature=1.0))
    seq3.watermark = watermark.SequenceWatermark(watermark.WatermarkConfig(KEY, context_window=2), skip_token=15)
    step = collate([StepLayout([2, 4, 15, 15])])
    out = watermark.force(torch.zeros(1, 4, vocab), [seq3], step)
    assert [bool(torch.isinf(out[0, r]).any()) for r in range(4)] == [True, True, False, False]


def test_entropy_gate_leaves_confident_rows_alone():
    seq = DecodeSequence([1, 2, 3], SamplingParams(temperature=1.0))
    seq.watermark = watermark.SequenceWatermark(watermark.WatermarkConfig(KEY, max_probability=0.5))
    confident = torch.full((1, 1, 8), -10.0)
    confident[0, 0, 3] = 10.0
    assert not torch.isinf(watermark.force(confident, [seq], None)).any()
    assert torch.isinf(watermark.force(torch.zeros(1, 1, 8), [seq], None)).any()
