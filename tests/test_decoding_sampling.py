"""Sampling: the verify rule alone against its analytical output distribution, and AR, ISD
(tau = 0; argmax and sampled proposals, with and without context candidates), RISD and
probabilistic SJD against the exact distribution of the first three tokens
of a 9-token-vocabulary model (chi-square at alpha = 0.01 over 20,000 seeded samples). For
tau > 0 the exact ISD output distribution is derived and both the empirical fit and the total
variation distance it introduces are reported."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.requests.sampling import SamplingParams, logits_to_probs, sample_from_probs
from selfspec.decoding.modes.verify import speculative_verify_reference as speculative_verify
from selfspec.engines.hf import HFEngine
from model_helpers import (
    add_mask_token, chi_square_pvalue, exact_distribution, save_random_adapter, tiny_qwen3, total_variation,
)

ALPHA = 0.01
SAMPLES = 20_000
PROMPT = [1, 2, 3]
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small forwards: 1 thread is faster


# ---------------------------------------------------------------- the verify rule alone
def _rule_output_distribution(p, q, tau):
    """Output law of one draft x ~ q under min(1, (1+tau) p/q) acceptance, residual max(0, p-q)."""
    accept = torch.minimum(q, (1 + tau) * p)  # P(draft = y and accepted) = q(y) min(1, (1+tau)p(y)/q(y))
    residual = (p - q).clamp_min(0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    return accept + (1 - accept.sum()) * residual


def test_a_draw_rounded_past_the_total_takes_the_last_token_with_mass(monkeypatch):
    """u * total can round up to the total, past every token's interval: the draw must go to the
    last token that has probability, never to a zero-probability one, and draws inside the
    intervals are unaffected."""
    from selfspec.decoding.requests import rng

    probs = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.5, 0.25, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4]])
    seeds = torch.tensor([1, 2, 3])
    monkeypatch.setattr(rng, "uniform_at", lambda seed, offset: torch.ones(seed.shape))
    assert sample_from_probs(probs, seeds).tolist() == [1, 2, 3]
    monkeypatch.setattr(rng, "uniform_at", lambda seed, offset: torch.full(seed.shape, 0.25))
    assert sample_from_probs(probs, seeds).tolist() == [1, 0, 1]


@pytest.mark.parametrize("tau", [0.0, 0.5])
@pytest.mark.parametrize("proposal", ["distribution", "one-hot"])
def test_verify_rule_matches_its_analytical_distribution(tau, proposal):
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 6, 100_000
    logits = torch.randn(2, vocab, generator=gen) * 1.5
    sampling = dict(temperature=0.9, top_k=5, top_p=0.95)
    p = logits_to_probs(logits, **sampling)  # what AR sampling draws from
    target = logits.unsqueeze(0).expand(rows, -1, -1)
    if proposal == "distribution":
        q = torch.softmax(torch.randn(vocab, generator=gen), -1)
        seeds = torch.randint(0, 2**31 - 1, (rows, 3), generator=gen)
        drafts = sample_from_probs(q.expand(rows, -1), seeds[:, 2])
        draft_probs = q.expand(rows, 1, -1)
    else:  # argmax proposal: q one-hot at a fixed token
        q = torch.nn.functional.one_hot(p[0].topk(2).indices[1], vocab).float()  # the 2nd likeliest
        seeds = torch.randint(0, 2**31 - 1, (rows, 2), generator=gen)
        drafts = q.argmax().expand(rows)
        draft_probs = None
    res = speculative_verify(target, drafts.unsqueeze(1), torch.ones(rows, dtype=torch.long), seeds[:, :2],
                             sampling["temperature"], sampling["top_k"], sampling["top_p"], tau, draft_probs)
    first = torch.where(res.accept_len == 1, drafts, res.next_tokens)
    expected = _rule_output_distribution(p[0], q, tau)
    if tau == 0:
        assert torch.allclose(expected, p[0], atol=1e-6)
    counts = Counter(first.tolist())
    stat, pvalue, dof = chi_square_pvalue(counts, {i: float(expected[i]) for i in range(vocab)})
    assert pvalue > ALPHA, (stat, dof, counts, expected)
    # the bonus token after an accepted draft follows the second anchor
    bonus = Counter(res.next_tokens[res.accept_len == 1].tolist())
    _, pvalue, _ = chi_square_pvalue(bonus, {i: float(p[1, i]) for i in range(vocab)})
    assert pvalue > ALPHA


def _verify_as_written(target_logits, draft_tokens, num_drafts, seeds, temperature, top_k=0, top_p=1.0, tau=0.0,
                       draft_probs=None, min_p=0.0):
    """The speculative verify rule with every step spelled out (one-hot q built over V, the
    acceptance's u * q and (1 + tau) * p always multiplied, both selections by torch.where): the
    reference takes exact shortcuts through it and must keep its every output."""
    from selfspec.decoding.requests import rng

    bsz, depth = draft_tokens.shape
    tau_b = torch.as_tensor(tau, dtype=torch.float32).expand(bsz)
    probs = logits_to_probs(target_logits, temperature, top_k, top_p, min_p)
    p_draft = probs[:, :depth].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    u = rng.uniform(seeds[:, :depth], torch.zeros((), dtype=torch.long))
    valid = torch.arange(depth).unsqueeze(0) < num_drafts.unsqueeze(1)
    accepted = (u * q_draft < (1.0 + tau_b).unsqueeze(1) * p_draft) & valid
    accept_len = accepted.long().cumprod(-1).sum(-1)
    rows = torch.arange(bsz)
    p_stop = probs[rows, accept_len]
    target = p_stop
    if depth:  # with no drafts, no row rejects one
        stop = accept_len.clamp(max=depth - 1)
        if draft_probs is None:
            q_stop = torch.zeros_like(p_stop).scatter_(1, draft_tokens.gather(1, stop.unsqueeze(1)), 1.0)
        else:
            q_stop = draft_probs[rows, stop].float()
        residual = (p_stop - q_stop).clamp_min(0.0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
        target = torch.where((accept_len < num_drafts).unsqueeze(1), residual, p_stop)
    offsets = torch.arange(1, target.shape[-1] + 1)
    noise = -torch.log(rng.uniform(seeds[rows, accept_len].unsqueeze(1), offsets))
    return accept_len, first_argmax(target / noise)


@pytest.mark.parametrize("proposal", ["one-hot", "distribution", "equal to p"])
def test_verify_reference_keeps_the_rule_as_written(proposal):
    """Random batches (depth 0-4, padded rows, scalar and per-row tau, filters, near-certain
    drafts that get accepted, drafts with q == p whose residual vanishes): the reference's
    tokens equal the rule's written out."""
    from selfspec.decoding.requests import rng

    gen = torch.Generator().manual_seed(len(proposal))
    for trial in range(60):
        bsz, depth, vocab = int(torch.randint(1, 9, (1,), generator=gen)), trial % 5, int(torch.randint(2, 300, (1,), generator=gen))
        logits = torch.randn(bsz, depth + 1, vocab, generator=gen) * float(torch.rand((), generator=gen) * 8)
        temperature = [0.7, 1.0, torch.rand(bsz, generator=gen) + 0.1][trial % 3]
        filters = [(0, 1.0, 0.0), (5, 0.9, 0.0), (0, 1.0, 0.1)][trial % 3 if trial % 2 else 0]
        tau = [0.0, 0.5, torch.rand(bsz, generator=gen), torch.zeros(())][trial % 4]
        drafts = torch.randint(0, vocab, (bsz, depth), generator=gen)
        if trial % 2:  # the likeliest tokens, so that many drafts pass
            drafts = logits[:, :depth].argmax(-1)
        num = torch.randint(0, depth + 1, (bsz,), generator=gen)
        seeds = rng.draw_seeds((bsz, depth + 1), gen)
        draft_probs = None
        if proposal == "distribution":
            draft_probs = torch.softmax(torch.randn(bsz, depth, vocab, generator=gen) * 2, -1)
        elif proposal == "equal to p":
            draft_probs = logits_to_probs(logits[:, :depth], temperature if not isinstance(temperature, torch.Tensor)
                                          else temperature.unsqueeze(1), *filters)
        args = (logits, drafts, num, seeds, temperature, *filters[:2], tau, draft_probs, filters[2])
        res = speculative_verify(*args)
        want_len, want_tokens = _verify_as_written(*args)
        assert torch.equal(res.accept_len, want_len) and torch.equal(res.next_tokens, want_tokens), trial


def test_relaxed_tv_closed_form():
    """With an argmax (one-hot) proposal x, tau shifts exactly min(tau p(x), 1 - p(x)) of mass."""
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.0, 1.0, 0.0])
    for tau in (0.25, 1.0, 3.0):
        out = _rule_output_distribution(p, q, tau)
        tv = 0.5 * float((out - p).abs().sum())
        assert tv == pytest.approx(min(tau * 0.3, 1 - 0.3), abs=1e-6)


# ---------------------------------------------------------------- whole decoders
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model = tiny_qwen3(8, hidden_size=32, seed=4, initializer_range=0.3)
    mask_id = add_mask_token(model)
    adapter = save_random_adapter(model, tmp_path_factory.mktemp("adapter"), rank=4, seed=1)
    return model, mask_id, str(adapter)


def _samples(engine, sampling, mode, config=None, seed_base=0):
    """SAMPLES seeded runs; one token more than scored, so that a step accepting a draft at the
    last scored position is not cut to one token by max_new_tokens (seen in the histogram)."""
    seeds = list(range(seed_base, seed_base + SAMPLES))
    outs = engine.generate([PROMPT] * SAMPLES, STEPS + 1, sampling, seed=seeds, stop_token_ids=[], mode=mode,
                           mode_config=config, batch_size=5000)
    assert all(len(o.token_ids) == STEPS + 1 for o in outs)
    hist = Counter()
    for o in outs:
        hist.update(o.metrics.accept_hist)
    return Counter(tuple(o.token_ids[:STEPS]) for o in outs), hist


RULES = SamplingParams(0.9, top_k=7, top_p=0.85, min_p=0.05, frequency_penalty=0.8, presence_penalty=0.3,
                       repetition_penalty=1.6, logit_bias=((4, 1.5), (7, -2.0)))
CASES = [
    ("ar", None, SamplingParams(1.0)),
    ("isd", {"stride": 3}, SamplingParams(1.0)),
    ("isd", {"stride": 2, "fixed_width": False}, SamplingParams(0.8, top_k=6, top_p=0.9)),
    ("risd", {"stride": 3}, SamplingParams(1.0)),
    ("isd", {"stride": 3, "proposal": "sample"}, SamplingParams(1.0)),
    ("isd", {"stride": 2, "proposal": "sample", "fixed_width": False}, SamplingParams(0.8, top_k=6, top_p=0.9)),
    ("isd", {"stride": 3, "proposal": "sample", "context_tokens": 3, "context_match_sizes": (1,)}, SamplingParams(1.0)),
    ("risd", {"stride": 3, "proposal": "sample"}, SamplingParams(1.0)),
    ("sjd", {"window": 3, "history_offset": 1}, SamplingParams(1.0)),
    ("sjd", {"window": 2, "history_offset": 2}, SamplingParams(0.8, top_k=6, top_p=0.9)),
    ("ngram", {"num_draft": 2, "match_sizes": (1,)}, SamplingParams(1.0)),
    # per-position logits rules and SGLang's filters (top-p on the unfiltered mass, min_p)
    ("isd", {"stride": 3, "proposal": "sample"}, RULES),
    ("isd", {"stride": 2, "context_tokens": 3, "context_match_sizes": (1,)}, RULES),
    ("sjd", {"window": 3, "history_offset": 1}, RULES),
]


@pytest.mark.parametrize("mode,config,sampling", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_mode_reproduces_ar_sampling_distribution(small, mode, config, sampling):
    model, mask_id, adapter = small
    engine = HFEngine(model, mask_token_id=mask_id, adapter=adapter if mode == "risd" else None)
    exact = exact_distribution(model, PROMPT, STEPS, sampling)
    counts, hist = _samples(engine, sampling, mode, config, seed_base=1000 * len(mode))
    stat, pvalue, dof = chi_square_pvalue(counts, exact)
    tv = total_variation(counts, exact)
    print(f"{mode} {config} {sampling}: chi2 {stat:.1f} dof {dof} p {pvalue:.3f}, empirical TV {tv:.4f}, "
          f"accept hist {dict(sorted(hist.items()))}")
    assert pvalue > ALPHA
    if sampling.has_logits_rules:  # the rules matter: the samples reject the law without them
        plain = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        assert chi_square_pvalue(counts, exact_distribution(model, PROMPT, STEPS, plain))[1] < 1e-6
    if mode != "ar":  # both acceptances (>= 2 tokens) and rejections (1 token) happened
        assert hist[1] > 0 and any(k >= 2 for k in hist), hist


@pytest.mark.parametrize("tau", [0.5, 1.0])
def test_relaxed_isd_distribution_and_tv(small, tau):
    """ISD N=2 with tau > 0: tokens 1 and 2 are exact (prefill, propose-only step); token 3 is
    the first verified proposal x (argmax of the MASK row seen after token 1), distorted by
    tau exactly as the rule says. Derive that law, fit the samples to it, report its TV to AR."""
    model, mask_id, _ = small
    sampling = SamplingParams(1.0)
    exact = exact_distribution(model, PROMPT, STEPS, sampling)
    vocab = model.get_output_embeddings().weight.shape[0]
    with torch.no_grad():
        firsts = torch.arange(vocab).unsqueeze(1)
        ctx = torch.cat([torch.tensor(PROMPT).expand(vocab, -1), firsts, torch.full((vocab, 1), mask_id)], dim=1)
        proposal = model(input_ids=ctx).logits[:, -1].argmax(-1)  # x as a function of token 1
    relaxed = {}
    for (t1, t2, t3), _ in exact.items():
        prefix = sum(v for k, v in exact.items() if k[:2] == (t1, t2))
        if prefix == 0:
            relaxed[(t1, t2, t3)] = 0.0
            continue
        p3 = torch.tensor([exact[(t1, t2, y)] / prefix for y in range(vocab)])
        q = torch.nn.functional.one_hot(proposal[t1], vocab).float()
        relaxed[(t1, t2, t3)] = prefix * float(_rule_output_distribution(p3, q, tau)[t3])
    tv_exact = 0.5 * sum(abs(relaxed[k] - exact[k]) for k in exact)
    engine = HFEngine(model, mask_token_id=mask_id)
    # the law above is derived for argmax proposals (q one-hot at x); sampled proposals have their own
    counts, _ = _samples(engine, sampling, "isd", {"stride": 2, "tau": tau, "proposal": "argmax"}, seed_base=77)
    stat, pvalue, dof = chi_square_pvalue(counts, relaxed)
    print(f"ISD N=2 tau={tau}: exact TV to AR over 3 tokens {tv_exact:.4f} (empirical TV to AR "
          f"{total_variation(counts, exact):.4f}); fit to the relaxed law: chi2 {stat:.1f} dof {dof} p {pvalue:.3f}")
    assert pvalue > ALPHA
    assert tv_exact > 0.01  # tau really changes the distribution on this model
    _, p_ar, _ = chi_square_pvalue(counts, exact)
    assert p_ar < ALPHA  # and the samples show it


def test_an_unfiltered_row_keeps_its_bits_beside_a_filtered_one():
    """A row without top-k / top-p / min-p gets the same probabilities, bit for bit, alone and in
    a batch with a filtered row: a seeded sampled request must draw the same in any batch (the
    SJD mixed burst of tests/test_sglang_sjd.py diverged here before)."""
    from selfspec.decoding.requests.sampling import logits_to_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 200, generator=g) * 3
    alone = logits_to_probs(logits[:1], 0.9)
    mixed = logits_to_probs(logits, torch.tensor([0.9, 0.7]), torch.tensor([0, 20]), torch.tensor([1.0, 0.9]),
                            torch.tensor([0.0, 0.05]))
    assert torch.equal(mixed[0], alone[0])
    assert (mixed[1] == 0).any() and torch.allclose(mixed[1].sum(-1), torch.ones(3))
