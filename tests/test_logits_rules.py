"""Per-request logits rules (penalties, logit_bias, min_new_tokens) and SGLang's sampling filters.

- the step hook against a naive per-row computation that walks each row's ancestor path in a
  tree layout (what plain AR would have counted at that position);
- `logits_to_probs` against SGLang 0.5.23's own torch sampler (top-k, top-p on the unfiltered
  mass, min_p), whose kept set it must reproduce;
- on the reference engine, every mode's greedy output with rules equals AR's with the same
  rules (and differs from AR without them).
"""

from __future__ import annotations

import pytest
import torch

from selfspec.decoding.requests.logits_rules import apply_logits_rules
from selfspec.decoding.requests.sampling import SamplingParams, logits_to_probs
from selfspec.decoding.step import DecodeSequence, StepContext, StepLayout, collate
from selfspec.engines.hf import HFEngine
from model_helpers import add_mask_token, tiny_qwen3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _naive_row(logit: torch.Tensor, output: list[int], sp: SamplingParams, stop_ids: set[int]) -> torch.Tensor:
    """SGLang's penalizers for one position, written out token by token."""
    out = logit.clone().double()
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] -= sp.frequency_penalty * c + sp.presence_penalty
    if len(output) < sp.min_new_tokens:
        for t in stop_ids:
            out[t] = float("-inf")
    for t in counts:
        out[t] = out[t] * sp.repetition_penalty if out[t] < 0 else out[t] / sp.repetition_penalty
    for t, v in sp.logit_bias:
        out[t] += v
    return out.float()


def test_rules_follow_each_rows_ancestor_path():
    gen = torch.Generator().manual_seed(0)
    vocab = 11
    sp = SamplingParams(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.5,
                        logit_bias=((3, 2.0), (9, -1.5)), min_new_tokens=5)
    # prompt [1, 2] then output [5, 3] (3 is the pending token); a trunk of one draft and two
    # branches, the second longer, as a candidate tree lays them out
    seq = DecodeSequence([1, 2, 5, 3], sp, prompt_len=2, stop_ids=frozenset({4, 10}))
    layout = StepLayout(tokens=[3, 5, 4, 5, 3, 4], offsets=[0, 1, 2, 3, 2, 3], branch=[0, 0, 1, 1, 2, 2])
    plain = DecodeSequence([7, 8, 9], SamplingParams(), prompt_len=2)
    batch = collate([layout, StepLayout([9, 9])])
    logits = torch.randn(2, batch.width, vocab, generator=gen) * 3
    got = apply_logits_rules(logits, [seq, plain], batch)
    paths = {0: [], 1: [5], 2: [5, 4], 3: [5, 4, 5], 4: [5, 3], 5: [5, 3, 4]}  # ancestors of each row
    for row, path in paths.items():
        want = _naive_row(logits[0, row], seq.output + path, sp, {4, 10})
        assert torch.allclose(got[0, row], want, atol=1e-5), (row, got[0, row], want)
    assert torch.equal(got[1], logits[1])  # a sequence without rules is untouched
    # min_new_tokens: rows whose output before them is shorter than 5 hold the stop tokens back
    assert got[0, 1, 4] == float("-inf") and got[0, 3, 4] != float("-inf")


def test_prefill_row_counts_the_committed_output_only():
    sp = SamplingParams(frequency_penalty=1.0, min_new_tokens=1)
    logits = torch.zeros(1, 1, 6)
    # after a retraction the prefill row follows the output already generated
    got = apply_logits_rules(logits, [DecodeSequence([1, 2, 3, 3], sp, prompt_len=2, stop_ids=frozenset({5}))], None)
    assert got[0, 0].tolist() == [0.0, 0.0, 0.0, -2.0, 0.0, 0.0]  # prompt tokens 1, 2 not counted
    fresh = apply_logits_rules(logits, [DecodeSequence([1, 2], sp, stop_ids=frozenset({5}))], None)
    assert fresh[0, 0, 5] == float("-inf")


def _sglang_filtered(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    _, kept, idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(), top_k.int(), top_p, min_p, bool((min_p > 0).any()), None, torch.zeros(len(probs)),
        return_filtered_probs=True)
    dense = torch.zeros_like(probs).scatter(-1, idx.long(), kept)
    return dense / dense.sum(-1, keepdim=True)


@pytest.mark.parametrize("seed", range(4))
def test_filters_match_sglangs_sampler(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 64, 200
    logits = torch.randn(rows, vocab, generator=gen) * (1 + 3 * torch.rand(rows, 1, generator=gen))
    pick = lambda opts: torch.tensor(opts)[torch.randint(0, len(opts), (rows,), generator=gen)]  # noqa: E731
    temp = pick([0.3, 0.7, 1.0, 1.5]).float()
    top_k = pick([vocab, 1, 5, 40, 120]).long()
    top_p = pick([1.0, 0.95, 0.8, 0.5, 0.2]).float()
    min_p = pick([0.0, 0.0, 0.02, 0.1, 0.4]).float()
    probs = torch.softmax(logits / temp.unsqueeze(1), -1)  # SGLang's sampler takes softmax(logits / T)
    want = _sglang_filtered(probs, top_k, top_p, min_p)
    got = logits_to_probs(logits, temp, torch.where(top_k >= vocab, 0, top_k), top_p, min_p)
    assert torch.allclose(got, want, atol=1e-6)
    # the difference that mattered: top-p on the renormalised top-k mass would cut more
    k, p = torch.full((rows,), 5), torch.full((rows,), 0.5)
    renorm_first = logits_to_probs(logits_to_probs(logits, temp, k).log(), 1.0, 0, p)
    assert ((renorm_first > 0).sum(-1) < (logits_to_probs(logits, temp, k, p) > 0).sum(-1)).any()


# ---------------------------------------------------------------- engine: every mode, greedy
@pytest.fixture(scope="module")
def engine():
    model = tiny_qwen3(48, hidden_size=32, seed=3, initializer_range=0.25)
    mask_id = add_mask_token(model)
    return HFEngine(model, mask_token_id=mask_id)


GREEDY_RULES = [
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=1.2),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(frequency_penalty=0.3, presence_penalty=0.3, repetition_penalty=1.2,
                   logit_bias=((5, 2.5), (11, -3.0))),
]
MODES = [("ngram", None), ("isd", {"stride": 3}), ("isd", {"stride": 2, "context_tokens": 4}),
         ("jacobi", None), ("sjd", None), ("sjd", {"context_tokens": 4})]


@pytest.mark.parametrize("mode,config", MODES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(MODES)])
def test_modes_with_rules_equal_ar_with_rules(engine, mode, config):
    gen = torch.Generator().manual_seed(1)
    # prompts with repeated spans, so that candidates are found and penalties bite
    prompts = [(torch.randint(0, 47, (6,), generator=gen).tolist()) * 3 for _ in range(3)]
    for sp in GREEDY_RULES:
        ar = engine.generate(prompts, 24, sp, mode="ar", stop_token_ids=[])
        got = engine.generate(prompts, 24, sp, mode=mode, mode_config=config, stop_token_ids=[])
        assert [o.token_ids for o in got] == [o.token_ids for o in ar], (mode, sp)
        plain = engine.generate(prompts, 24, SamplingParams(), mode="ar", stop_token_ids=[])
        assert [o.token_ids for o in plain] != [o.token_ids for o in ar], f"{sp} changed nothing"


def test_min_new_tokens_holds_the_stop_token_back(engine):
    prompt = [3, 4, 5, 6, 3, 4, 5]
    free = engine.generate([prompt], 16, SamplingParams(), mode="ar", stop_token_ids=[])[0].token_ids
    stop = free[2]  # greedy AR would stop at its third token
    first = free.index(stop)
    for mode, config in MODES:
        short = engine.generate([prompt], 16, SamplingParams(), mode=mode, mode_config=config, stop_token_ids=[stop])
        held = engine.generate([prompt], 16, SamplingParams(min_new_tokens=8), mode=mode, mode_config=config,
                               stop_token_ids=[stop])
        ar = engine.generate([prompt], 16, SamplingParams(min_new_tokens=8), mode="ar", stop_token_ids=[stop])
        assert short[0].token_ids == free[: first + 1]
        assert held[0].token_ids == ar[0].token_ids, mode
        assert len(held[0].token_ids) >= 8 and stop not in held[0].token_ids[:7], held[0].token_ids


# ---------------------------------------------------------------- engine: grammars
GRAMMARS = [dict(regex=r"(def|class) [a-z_]{2,10}\((self)?\):"),
            dict(json_schema='{"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}'),
            dict(ebnf='root ::= "x = " [0-9]+ ("," [0-9]+)*')]


@pytest.fixture(scope="module")
def base_engine():
    from selfspec.models import resolve_model

    return HFEngine.from_pretrained(str(resolve_model("tiny-base")))


@pytest.mark.parametrize("grammar", GRAMMARS, ids=["regex", "json", "ebnf"])
def test_grammar_constrained_modes_equal_ar(base_engine, grammar):
    from selfspec.engines.grammar import XGrammar

    eng = base_engine
    vocab = eng.model.get_output_embeddings().weight.shape[0]
    prompts = [eng.encode("import os\nimport sys\n\n\n"), eng.encode("def main():\n    ")]
    fresh = lambda: [XGrammar.compile(eng.tokenizer, vocab, **grammar) for _ in prompts]  # noqa: E731
    ar = eng.generate(prompts, 20, mode="ar", grammars=fresh())
    free = eng.generate(prompts, 20, mode="ar")
    assert [o.token_ids for o in ar] != [o.token_ids for o in free]
    for o in ar:  # what AR emitted under the grammar is accepted by a fresh copy of it
        g = fresh()[0]
        assert g.commit(o.token_ids) == len(o.token_ids)
    for mode, config in [("ngram", None), ("ngram", {"num_draft": 12, "tree": 4}), ("jacobi", None),
                         ("sjd", {"context_tokens": 4}),
                         ("isd", {"stride": 3, "context_tokens": 4})]:
        got = eng.generate(prompts, 20, mode=mode, mode_config=config, grammars=fresh())
        assert [o.token_ids for o in got] == [o.token_ids for o in ar], mode


def test_a_grammar_that_must_end_before_min_tokens_ends_the_sequence(base_engine):
    """Digits up to 6 and min_tokens 8: once the digits run out the grammar allows only the end,
    which min_tokens holds back. Every mode ends the sequence there (the grammar wins), greedy
    and sampled; no row of -inf everywhere draws a token the grammar rejects (sampled AR drew
    the last vocabulary id and the grammar refused it)."""
    from selfspec.engines.grammar import XGrammar

    eng = base_engine
    vocab = eng.model.get_output_embeddings().weight.shape[0]
    eos = eng.tokenizer.eos_token_id
    prompts = [eng.encode("x = "), eng.encode("count: ")]
    for mode in ("ar", "isd", "sjd", "ngram"):
        for sp in (SamplingParams(min_new_tokens=8), SamplingParams(temperature=1.3, min_new_tokens=8)):
            grammars = [XGrammar.compile(eng.tokenizer, vocab, regex=r"[0-9]{1,6}") for _ in prompts]
            outs = eng.generate(prompts, 12, sp, mode=mode, grammars=grammars, stop_token_ids=[eos], seed=[3, 4])
            for o in outs:
                assert o.finish_reason == "stop" and o.token_ids[-1] == eos, (mode, o.token_ids)
                digits = eng.tokenizer.decode(o.token_ids[:-1])
                assert digits.isdigit() and len(digits) <= 6, (mode, digits)


class EvenTokens:
    """A stand-in grammar: only even token ids, whatever came before."""

    def allowed(self, path, vocab):
        return torch.arange(vocab) % 2 == 0

    def accepts(self, path):
        return next((i for i, t in enumerate(path) if t % 2), len(path))


def test_drafts_stop_at_the_first_token_the_grammar_rejects():
    from selfspec.decoding.modes.isd import ISDConfig, ISDMode
    from selfspec.decoding.requests.logits_rules import grammar_valid

    seq = DecodeSequence([1, 2, 4, 6, 8, 2, 4, 6], constraint=EvenTokens())
    assert grammar_valid(seq, [8, 2, 3, 4]) == [8, 2]
    assert grammar_valid(DecodeSequence([1]), [3, 5]) == [3, 5]  # no grammar: untouched
    # ISD's context candidate (what followed "4 6" before: 8 2 4 6 ...) is cut where the grammar
    # stops it, so the step verifies fewer query tokens
    mode = ISDMode(ISDConfig(stride=2, context_tokens=4, fixed_width=False), mask_token_id=99)
    seq = DecodeSequence([2, 4, 6, 8, 3, 5, 4, 6], constraint=EvenTokens())
    mode.start(seq)
    free = DecodeSequence(list(seq.history))
    mode.start(free)
    cut, whole = mode.layouts([seq])[0], mode.layouts([free])[0]
    assert len(cut) < len(whole)
    assert 3 not in cut.tokens and 3 in whole.tokens


def test_isd_proposes_only_what_the_grammar_allows():
    from selfspec.decoding.modes.isd import ISDConfig, ISDMode

    mode = ISDMode(ISDConfig(stride=4), mask_token_id=99)
    gen = torch.Generator().manual_seed(0)
    for temperature in (0.0, 1.0):
        seq = DecodeSequence([2, 4], SamplingParams(temperature=temperature), constraint=EvenTokens())
        ctx = StepContext.from_params([seq.sampling], torch.arange(mode.seeds_per_step).unsqueeze(0))
        rows = torch.randn(3, 50, generator=gen)
        rows[:, 1::2] += 5.0  # odd tokens are the likely ones
        proposals, q = mode._grammar_proposals(seq, [6], rows, ctx)
        assert len(proposals) == 3 and all(t % 2 == 0 for t in proposals)
        if temperature:
            assert q.shape == (3, 50) and float(q[:, 1::2].sum()) == 0.0
