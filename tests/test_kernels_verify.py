"""Triton verify kernels against the torch references of selfspec.decoding.modes.verify.

On a CPU machine the kernels run in the Triton interpreter (see _kernels_run_in_this_process). Discrete outputs are compared exactly. The only tolerated
differences are float knife-edges: an accept test `u*q < (1+tau)*p` or a Gumbel argmax whose
two sides are within rounding of each other (the kernel's online softmax rounds differently from
torch.softmax), and the reference's sort-order-dependent choice inside a tie group at the top-p
boundary. Every such case is detected from the reference's own quantities, counted, printed and
bounded; a mismatch anywhere else fails.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import torch


import pytest

from kernel_interpreter import _interpreter_env, skip_unless_kernels_run_here  # noqa: E402,F401

skip_unless_kernels_run_here()

from selfspec.decoding.requests import rng  # noqa: E402
from selfspec.decoding.requests.sampling import logits_to_probs  # noqa: E402
from selfspec.decoding.modes.verify import (  # noqa: E402
    greedy_verify_candidates_reference,
    greedy_verify_reference,
    speculative_verify_reference,
)
from selfspec.kernels import verify_triton as vt  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf - inf
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

POISON = -987654321
ACC_REL = 1e-5  # accept-test knife edge: |u*q - (1+tau)*p| within this (relative) + scaled-logit ulps
GAP_ABS = 2e-5  # sampling knife edge: best two scores within this + scaled-logit ulps
AUDIT: Counter = Counter()


@pytest.fixture(autouse=True)
def _poison_scratch(monkeypatch):
    monkeypatch.setattr(vt, "POISON_SCRATCH", True)


def teardown_module(module):
    print(f"\n[verify kernel audit] {dict(AUDIT)}")


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def make_logits(gen, bsz, rows, vocab, dtype, scale=3.0, peak=8.0):
    """Random logits; about half the rows have a clear favourite so drafts often pass."""
    logits = torch.randn(bsz, rows, vocab, generator=gen) * scale
    hot = torch.randint(0, vocab, (bsz, rows), generator=gen)
    boost = (torch.rand(bsz, rows, generator=gen) < 0.5).float() * peak
    logits.scatter_add_(-1, hot.unsqueeze(-1), boost.unsqueeze(-1))
    return logits.to(dtype).to(DEVICE)


def make_drafts(gen, logits, depth):
    """Mostly the row argmax, otherwise a random token."""
    bsz, _, vocab = logits.shape
    argmax = logits[:, :depth].float().argmax(-1).cpu()
    rand = torch.randint(0, vocab, (bsz, depth), generator=gen)
    pick = torch.rand(bsz, depth, generator=gen) < 0.75
    return torch.where(pick, argmax, rand).to(DEVICE)


def make_dense_q(gen, logits, depth):
    """A draft distribution near p and drafts sampled from it."""
    bsz, _, vocab = logits.shape
    q = torch.softmax(logits[:, :depth].float().cpu() + torch.randn(bsz, depth, vocab, generator=gen), -1)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(bsz, depth)
    return q.to(DEVICE), drafts.to(DEVICE)


def make_seeds(gen, bsz, rows):
    return rng.draw_seeds((bsz, rows), gen).to(DEVICE)


def mixed_settings(gen, bsz, vocab):
    """Per-sequence temperature / top-k / top-p / tau, covering greedy, T -> 0 and the filters."""
    pick = lambda options: torch.tensor(options)[torch.randint(0, len(options), (bsz,), generator=gen)]  # noqa: E731
    temp = pick([0.0, 1e-3, 0.5, 1.0, 1.0, 1.7]).float()
    top_k = pick([0, 0, 1, 5, 40, vocab]).long()
    top_p = pick([1.0, 1.0, 0.95, 0.8, 0.5]).float()
    tau = pick([0.0, 0.0, 0.25]).float()
    return temp.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), tau.to(DEVICE)


# ----------------------------------------------------------------------------------------------
# knife-edge audit from the reference's own quantities
# ----------------------------------------------------------------------------------------------


def _per_row(value, dtype, bsz):
    return torch.as_tensor(value, dtype=dtype, device=DEVICE).expand(bsz)


def audit_flags(logits, drafts, nd, seeds, temperature, top_k, top_p, tau, draft_probs, ref, min_p=0.0):
    """[B] bool: the reference's decision for this sequence rests on a float knife edge or on
    top-p tie order, so a faithful implementation may legitimately decide differently."""
    bsz, depth = drafts.shape
    vocab = logits.shape[-1]
    temp = _per_row(temperature, torch.float32, bsz)
    k = _per_row(top_k, torch.long, bsz)
    top = _per_row(top_p, torch.float32, bsz)
    tau_b = _per_row(tau, torch.float32, bsz)
    greedy = temp <= 0
    safe_t = torch.where(greedy, torch.ones_like(temp), temp)
    scaled = logits.float() / safe_t.view(-1, 1, 1)
    smax = scaled.amax(-1)  # [B, D+1]
    probs = logits_to_probs(logits, temp, k, top, _per_row(min_p, torch.float32, bsz))
    idx = torch.arange(depth + 1, device=DEVICE)
    relevant_rows = idx.unsqueeze(0) <= ref.accept_len.unsqueeze(1)  # rows whose decision was used

    flags = torch.zeros(bsz, dtype=torch.bool, device=DEVICE)
    ties = torch.zeros(bsz, dtype=torch.bool, device=DEVICE)
    if depth:
        p_d = probs[:, :depth].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.float().gather(
            -1, drafts.unsqueeze(-1)).squeeze(-1)
        u = rng.uniform(seeds[:, :depth], torch.zeros((), dtype=torch.long, device=DEVICE))
        lhs, rhs = u * q_d, (1.0 + tau_b).unsqueeze(1) * p_d
        s_x = scaled[:, :depth].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        tol = ACC_REL + 2.0**-21 * (s_x.abs() + smax[:, :depth].abs())
        knife = ((lhs - rhs).abs() <= tol * rhs.abs()) & (rhs > 0) & ~greedy.unsqueeze(1)
        flags |= (knife & relevant_rows[:, :depth] & (idx[:depth].unsqueeze(0) < nd.unsqueeze(1))).any(1)

    # the draw at the stop row, recomputed the reference's way
    rows = torch.arange(bsz, device=DEVICE)
    j = ref.accept_len
    p_stop = probs[rows, j]
    rejected = j < nd
    if draft_probs is None:
        q_stop = torch.zeros_like(p_stop)
        if depth:
            q_stop.scatter_(1, drafts.gather(1, j.clamp(max=depth - 1).unsqueeze(1)), 1.0)
    else:
        q_stop = torch.cat([draft_probs.float(), torch.zeros_like(p_stop).unsqueeze(1)], 1)[rows, j]
    residual = (p_stop - q_stop).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
    target = torch.where(rejected.unsqueeze(1), residual, p_stop)
    noise = rng.gumbel(seeds[rows, j].unsqueeze(1), torch.arange(1, vocab + 1, device=DEVICE).unsqueeze(0))
    scores = target.log() + noise
    special = (scores.isnan() | scores.isinf() & (scores > 0)).any(1)  # exact integer decisions
    top2 = scores.nan_to_num(neginf=-1e30).topk(min(2, vocab), dim=-1).values
    gap = top2[:, 0] - top2[:, -1] if vocab > 1 else torch.full((bsz,), 1e30, device=DEVICE)
    s_stop = scaled[rows, j]
    scale_ulps = 2.0**-21 * (smax[rows, j].abs() + s_stop.gather(1, scores.nan_to_num(neginf=-1e30).argmax(
        -1, keepdim=True)).squeeze(1).abs())
    flags |= (gap <= GAP_ABS + scale_ulps) & ~special & ~greedy

    # top-p boundary: tie groups split by sort order, or cumulative mass within rounding of top_p
    p_act = (top < 1.0) & ~greedy
    if bool(p_act.any()):
        pre = logits_to_probs(logits, temp, 0, 1.0)  # top-p is measured on the unfiltered mass
        sorted_p = pre.sort(dim=-1, descending=True).values
        mass_before = sorted_p.cumsum(-1) - sorted_p
        n_keep = (mass_before <= top.view(-1, 1, 1)).long().cumprod(-1).sum(-1).clamp(1, vocab - 1)
        pb = sorted_p.gather(-1, (n_keep - 1).unsqueeze(-1)).squeeze(-1)
        nxt = sorted_p.gather(-1, n_keep.unsqueeze(-1)).squeeze(-1)
        mb_drop = mass_before.gather(-1, n_keep.unsqueeze(-1)).squeeze(-1)
        mb_keep = mass_before.gather(-1, (n_keep - 1).unsqueeze(-1)).squeeze(-1)
        near = ((mb_drop - top.view(-1, 1)).abs() <= 1e-5) | ((mb_keep - top.view(-1, 1)).abs() <= 1e-5)
        live = idx.unsqueeze(0) <= nd.clamp(0, depth).unsqueeze(1)
        split_tie = (pb == nxt) & (pb > 0)
        ties |= ((split_tie | near) & live & p_act.unsqueeze(1)).any(1)
    return flags, ties


def compare_speculative(logits, drafts, nd, seeds, temperature, top_k=0, top_p=1.0, tau=0.0, draft_probs=None,
                        max_knife_flips=None, min_p=0.0, **launch):
    ref = speculative_verify_reference(logits, drafts, nd, seeds, temperature, top_k, top_p, tau, draft_probs, min_p)
    bsz, depth = drafts.shape
    out = (torch.full((bsz,), POISON, dtype=torch.long, device=DEVICE),
           torch.full((bsz,), POISON, dtype=torch.long, device=DEVICE))
    tokens = torch.full((bsz, depth + 1), POISON, dtype=torch.long, device=DEVICE)
    stats: dict = {}
    got = vt.speculative_verify_triton(logits, drafts, nd, seeds, temperature, top_k, top_p, tau, draft_probs,
                                       min_p, out=out, out_tokens=tokens, stats=stats, **launch)
    assert got.accept_len is out[0] and got.next_tokens is out[1]
    assert (got.accept_len != POISON).all() and (got.next_tokens != POISON).all()
    check_tokens(tokens, drafts, got.accept_len, got.next_tokens)

    knife, ties = audit_flags(logits, drafts, nd, seeds, temperature, top_k, top_p, tau, draft_probs, ref, min_p)
    mismatch = (got.accept_len != ref.accept_len) | (got.next_tokens != ref.next_tokens)
    unexplained = mismatch & ~knife & ~ties
    AUDIT["sequences"] += bsz
    AUDIT["knife_edge_sequences"] += int(knife.sum())
    AUDIT["knife_edge_mismatches"] += int((mismatch & knife).sum())
    AUDIT["topp_tie_or_boundary_sequences"] += int(ties.sum())
    AUDIT["topp_tie_mismatches"] += int((mismatch & ties & ~knife).sum())
    assert not unexplained.any(), (
        f"kernel != reference at {unexplained.nonzero().flatten().tolist()}: "
        f"len {got.accept_len[unexplained].tolist()} vs {ref.accept_len[unexplained].tolist()}, "
        f"next {got.next_tokens[unexplained].tolist()} vs {ref.next_tokens[unexplained].tolist()}"
    )
    limit = max(1, bsz // 50) if max_knife_flips is None else max_knife_flips
    assert int((mismatch & knife).sum()) <= limit, "too many knife-edge flips"
    return ref, got, stats


def check_tokens(tokens, drafts, accept_len, next_tokens):
    """out_tokens: accepted drafts, then the next token, and nothing written past them."""
    depth = drafts.shape[1]
    for b in range(tokens.shape[0]):
        n = int(accept_len[b])
        assert tokens[b, :n].tolist() == drafts[b, :n].tolist()
        assert int(tokens[b, n]) == int(next_tokens[b])
        assert (tokens[b, n + 1:] == POISON).all(), f"row {b} written past position {n}"
        assert n <= depth


# ----------------------------------------------------------------------------------------------
# greedy verify
# ----------------------------------------------------------------------------------------------

GREEDY_CASES = [
    # vocab, sequences, depth, dtype, block, splits
    (97, 1, 0, torch.float32, 32, 2),
    (97, 16, 15, torch.float32, 32, 3),
    (97, 9, 4, torch.bfloat16, None, None),
    (4096, 4, 15, torch.bfloat16, 1024, 3),
    (4096, 16, 3, torch.float32, None, None),
    (32768, 3, 5, torch.bfloat16, None, None),
    (50021, 2, 2, torch.float32, None, 2),
]


@pytest.mark.parametrize("vocab,bsz,depth,dtype,block,splits", GREEDY_CASES)
def test_greedy_verify_matches_reference(vocab, bsz, depth, dtype, block, splits):
    gen = torch.Generator().manual_seed(vocab * 31 + bsz * 7 + depth)
    logits = make_logits(gen, bsz, depth + 1, vocab, dtype)
    if dtype == torch.bfloat16 and vocab == 97:
        logits = logits.round().to(dtype)  # many exact ties: the first argmax must win
    drafts = make_drafts(gen, logits, depth)
    nd = torch.randint(0, depth + 1, (bsz,), generator=gen).to(DEVICE)
    nd[0] = depth
    ref = greedy_verify_reference(logits, drafts, nd)
    out = tuple(torch.full((bsz,), POISON, dtype=torch.long, device=DEVICE) for _ in range(2))
    tokens = torch.full((bsz, depth + 1), POISON, dtype=torch.long, device=DEVICE)
    got = vt.greedy_verify_triton(logits, drafts, nd, out=out, out_tokens=tokens, block_v=block, num_splits=splits)
    assert torch.equal(got.accept_len, ref.accept_len)
    assert torch.equal(got.next_tokens, ref.next_tokens)
    check_tokens(tokens, drafts, got.accept_len, got.next_tokens)


@pytest.mark.parametrize("vocab,bsz,cands,depth,dtype", [
    (97, 3, 4, 5, torch.float32),
    (4096, 5, 3, 7, torch.bfloat16),
    (97, 2, 1, 0, torch.float32),
])
def test_greedy_candidates_match_reference(vocab, bsz, cands, depth, dtype):
    gen = torch.Generator().manual_seed(vocab + cands)
    logits = make_logits(gen, bsz * cands, depth + 1, vocab, dtype).view(bsz, cands, depth + 1, vocab)
    drafts = make_drafts(gen, logits.view(bsz * cands, depth + 1, vocab), depth).view(bsz, cands, depth)
    if depth:
        drafts[0] = drafts[0, :1]  # identical branches: the first must win the tie
    nd = torch.randint(0, depth + 1, (bsz, cands), generator=gen).to(DEVICE)
    ref = greedy_verify_candidates_reference(logits, drafts, nd)
    out = tuple(torch.full((bsz,), POISON, dtype=torch.long, device=DEVICE) for _ in range(3))
    tokens = torch.full((bsz, depth + 1), POISON, dtype=torch.long, device=DEVICE)
    got = vt.greedy_verify_candidates_triton(logits, drafts, nd, out=out, out_tokens=tokens, block_v=64,
                                             num_splits=2)
    assert torch.equal(got.accept_len, ref.accept_len)
    assert torch.equal(got.next_tokens, ref.next_tokens)
    assert torch.equal(got.best_candidate, ref.best_candidate)
    best_drafts = drafts[torch.arange(bsz, device=DEVICE), got.best_candidate]
    check_tokens(tokens, best_drafts, got.accept_len, got.next_tokens)


# ----------------------------------------------------------------------------------------------
# speculative verify: random inputs
# ----------------------------------------------------------------------------------------------

SPEC_CASES = [
    # vocab, sequences, depth, dtype, block, splits
    (97, 1, 0, torch.float32, 32, 2),
    (97, 16, 15, torch.float32, 32, 3),
    (97, 12, 3, torch.bfloat16, None, None),
    (4096, 16, 4, torch.float32, None, None),
    (4096, 6, 15, torch.bfloat16, 1024, 3),
    (32768, 3, 3, torch.bfloat16, None, None),
    (40000, 2, 1, torch.float32, None, 3),
]


#: each case under each sampling setting, less those that cannot run or would only repeat one:
#: a large vocabulary under the mixed setting alone (it keeps the interpreter run short), and no
#: dense q where there are no drafts (depth 0)
SPEC_PARAMS = [
    pytest.param(*case, settings, id="-".join(map(str, (*case[:3], str(case[3]).split(".")[-1], *case[4:], settings))))
    for case in SPEC_CASES for settings in ("scalar", "mixed", "dense_q")
    if (case[0] < 32768 or settings == "mixed") and not (settings == "dense_q" and case[2] == 0)
]


@pytest.mark.parametrize("vocab,bsz,depth,dtype,block,splits,settings", SPEC_PARAMS)
def test_speculative_verify_matches_reference(vocab, bsz, depth, dtype, block, splits, settings):
    gen = torch.Generator().manual_seed(vocab * 13 + bsz * 5 + depth + len(settings))
    logits = make_logits(gen, bsz, depth + 1, vocab, dtype)
    drafts = make_drafts(gen, logits, depth)
    nd = torch.randint(0, depth + 1, (bsz,), generator=gen).to(DEVICE)
    nd[0] = depth
    seeds = make_seeds(gen, bsz, depth + 1)
    launch = dict(block_v=block, num_splits=splits)
    if settings == "scalar":
        compare_speculative(logits, drafts, nd, seeds, 0.8, **launch)
        compare_speculative(logits, drafts, nd, seeds, 1.0, 20, 0.9, 0.1, **launch)
    elif settings == "mixed":
        temp, top_k, top_p, tau = mixed_settings(gen, bsz, vocab)
        compare_speculative(logits, drafts, nd, seeds, temp, top_k, top_p, tau, **launch)
        min_p = torch.tensor([0.0, 0.05, 0.3])[torch.randint(0, 3, (bsz,), generator=gen)].to(DEVICE)
        compare_speculative(logits, drafts, nd, seeds, temp, top_k, top_p, tau, min_p=min_p, **launch)
    else:
        q, drafts = make_dense_q(gen, logits, depth)
        temp, top_k, top_p, tau = mixed_settings(gen, bsz, vocab)
        compare_speculative(logits, drafts, nd, seeds, temp, top_k, top_p, tau, q.to(dtype), **launch)
        compare_speculative(logits, drafts, nd, seeds, 1.0, 0, 1.0, 0.0, q, **launch)


def test_many_seeds_small_vocab():
    """Many sequences over a small vocabulary: every accept length, corrections and bonuses."""
    gen = torch.Generator().manual_seed(7)
    bsz, depth, vocab = 128, 4, 11  # 128 rows still cover every accept length (asserted below)
    logits = make_logits(gen, bsz, depth + 1, vocab, torch.float32, scale=1.0, peak=2.0)
    q, drafts = make_dense_q(gen, logits, depth)
    nd = torch.randint(0, depth + 1, (bsz,), generator=gen).to(DEVICE)
    seeds = make_seeds(gen, bsz, depth + 1)
    temp, top_k, top_p, tau = mixed_settings(gen, bsz, vocab)
    ref, _, stats = compare_speculative(logits, drafts, nd, seeds, temp, top_k, top_p, tau, q)
    assert len(set(ref.accept_len.tolist())) == depth + 1  # the sample covers every length
    compare_speculative(logits, drafts, nd, seeds, temp, top_k, top_p, tau)


# ----------------------------------------------------------------------------------------------
# edge cases
# ----------------------------------------------------------------------------------------------


def _case(vocab=97, bsz=6, depth=4, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(gen, bsz, depth + 1, vocab, dtype)
    return gen, logits, make_seeds(gen, bsz, depth + 1), torch.full((bsz,), depth, device=DEVICE)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_all_accept_skips_the_correction(temperature):
    gen, logits, seeds, nd = _case()
    drafts = logits[:, :-1].float().argmax(-1)
    tau = 0.0 if temperature == 0 else 1e30  # (1 + tau) p(x) > u for every draft with p(x) > 0
    ref, got, stats = compare_speculative(logits, drafts, nd, seeds, temperature, tau=tau, block_v=32, num_splits=2)
    assert (ref.accept_len == 4).all()
    # one streaming pass: the correction pass ran for no sequence (unless a row drew u == 1.0)
    assert stats["slow_path"].sum() == 0


def test_first_draft_rejected():
    gen, logits, seeds, nd = _case()
    argmax = logits.float().argmax(-1)
    drafts = (argmax[:, :-1] + 1) % logits.shape[-1]
    for temperature in (0.0, 0.9):
        ref, _, stats = compare_speculative(logits, drafts, nd, seeds, temperature, top_k=1)
        assert (ref.accept_len == 0).all()
        assert torch.equal(ref.next_tokens, argmax[:, 0])
        assert (stats["slow_path"] == 1).all()


def test_onehot_dense_q_equals_implicit_q():
    gen, logits, seeds, nd = _case(vocab=211, bsz=10, depth=5)
    drafts = make_drafts(gen, logits, 5)
    onehot = torch.nn.functional.one_hot(drafts, 211).float()
    _, a, _ = compare_speculative(logits, drafts, nd, seeds, 0.7, 0, 0.9, 0.0)
    _, b, _ = compare_speculative(logits, drafts, nd, seeds, 0.7, 0, 0.9, 0.0, onehot)
    assert torch.equal(a.accept_len, b.accept_len) and torch.equal(a.next_tokens, b.next_tokens)


def test_draft_with_zero_probability():
    gen, logits, seeds, nd = _case(bsz=4, depth=3)
    logits[:, :, 5] = float("-inf")  # p(5) == 0 everywhere
    drafts = torch.full((4, 3), 5, device=DEVICE)
    drafts[:, 0] = logits[:, 0].argmax(-1)
    for dense in (False, True):
        q = torch.full((4, 3, 97), 1 / 97, device=DEVICE) if dense else None
        ref, got, _ = compare_speculative(logits, drafts, nd, seeds, 1.0, tau=0.5, draft_probs=q)
        assert (ref.accept_len <= 1).all()
        assert (got.next_tokens != 5).all()


def test_top_k_one_is_argmax():
    gen, logits, seeds, nd = _case(vocab=4096, bsz=5, depth=3, dtype=torch.bfloat16)
    drafts = make_drafts(gen, logits, 3)
    ref, got, _ = compare_speculative(logits, drafts, nd, seeds, 1.3, top_k=1)
    rows = torch.arange(5, device=DEVICE)
    assert torch.equal(got.next_tokens, logits.float().argmax(-1)[rows, got.accept_len])


@pytest.mark.parametrize("temperature", [1e-2, 1e-4, 1e-6])
def test_temperature_to_zero(temperature):
    gen, logits, seeds, nd = _case(vocab=4096, bsz=6, depth=5, seed=3)
    drafts = make_drafts(gen, logits, 5)
    ref_zero = speculative_verify_reference(logits, drafts, nd, seeds, 0.0)
    ref, got, _ = compare_speculative(logits, drafts, nd, seeds, temperature)
    if temperature <= 1e-4:  # random normal logits: the gaps dwarf T, sampling is greedy
        assert torch.equal(got.accept_len, ref_zero.accept_len)
        assert torch.equal(got.next_tokens, ref_zero.next_tokens)


def test_no_drafts_and_padding():
    gen, logits, seeds, _ = _case(bsz=5, depth=6)
    drafts = make_drafts(gen, logits, 6)
    nd = torch.tensor([0, 1, 6, 3, 0], device=DEVICE)
    compare_speculative(logits, drafts, nd, seeds, 0.0)
    compare_speculative(logits, drafts, nd, seeds, 1.0)
    compare_speculative(logits[:, :1].contiguous(), drafts[:, :0], torch.zeros(5, dtype=torch.long, device=DEVICE),
                        seeds[:, :1].contiguous(), 0.9, 3, 0.8)


def test_non_contiguous_inputs():
    gen, logits, seeds, nd = _case(bsz=4, depth=3)
    wide = torch.cat([logits, logits], 0)[::2]  # a strided batch view
    drafts = make_drafts(gen, logits, 3)
    compare_speculative(wide, drafts, nd, seeds, 0.9, block_v=32, num_splits=3)


def test_knife_edges_are_detected_and_counted():
    """Rows built so that p(x) equals the accept uniform u to within float rounding: the audit
    must flag every one of them (whatever the kernel decides there), and the flips are counted."""
    bsz, vocab = 16, 2
    gen = torch.Generator().manual_seed(123)
    seeds = make_seeds(gen, bsz, 2)
    u = rng.uniform(seeds[:, :1], torch.zeros((), dtype=torch.long, device=DEVICE)).double().squeeze(1)
    logits = torch.zeros(bsz, 2, vocab, dtype=torch.float32, device=DEVICE)
    logits[:, 0, 0] = torch.log(u / (1 - u)).float()  # softmax([l, 0])[0] == u up to rounding
    drafts = torch.zeros(bsz, 1, dtype=torch.long, device=DEVICE)
    nd = torch.ones(bsz, dtype=torch.long, device=DEVICE)
    ref = speculative_verify_reference(logits, drafts, nd, seeds, 1.0)
    knife, _ = audit_flags(logits, drafts, nd, seeds, 1.0, 0, 1.0, 0.0, None, ref)
    assert knife.all()
    before = AUDIT["knife_edge_mismatches"]
    compare_speculative(logits, drafts, nd, seeds, 1.0, max_knife_flips=bsz)  # every difference is explained
    flips = AUDIT["knife_edge_mismatches"] - before
    print(f"[knife-edge probe] {flips}/{bsz} constructed knife edges flipped")
    # constructed, not random: keep the random-input counts clean
    AUDIT["sequences"] -= bsz
    AUDIT["knife_edge_sequences"] -= bsz
    AUDIT["knife_edge_mismatches"] -= flips
    AUDIT["constructed_knife_edges"] += bsz
    AUDIT["constructed_knife_edge_flips"] += flips


# ----------------------------------------------------------------------------------------------
# u == 1.0: the reference's Gumbel +inf / accept-uniform edge (see the report in kernels/)
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _seed_with_max_hash(offset_range, search=4_000_000):
    """A seed whose hash at some offset in `offset_range` is 0xFFFFFFxx (uniform rounds to 1.0)."""
    seeds = torch.arange(search, dtype=torch.long)
    for off in offset_range:
        hit = ((rng.hash_u32(seeds, torch.tensor(off)) >> 8) == 0xFFFFFF).nonzero()
        if hit.numel():
            return int(seeds[hit[0, 0]]), off
    raise AssertionError("no seed found")


def test_largest_hash_matches_reference():
    """The largest hash values: the uniform stays below 1 (finite noise); kernel and reference agree."""
    vocab = 97
    seed, off = _seed_with_max_hash(range(1, vocab + 1))
    assert rng.uniform(torch.tensor(seed), torch.tensor(off)).item() < 1.0
    gen, logits, _, _ = _case(vocab=vocab, bsz=3, depth=2)
    seeds = torch.full((3, 3), seed, device=DEVICE)
    drafts = logits[:, :2].float().argmax(-1)
    nd = torch.tensor([2, 0, 2], device=DEVICE)
    for temperature, top_k in ((0.0, 0), (1.0, 0), (1.0, 3)):
        ref, got, stats = compare_speculative(logits, drafts, nd, seeds, temperature, top_k, block_v=32, num_splits=2)
        assert torch.equal(got.next_tokens, ref.next_tokens)


def test_reference_greedy_row_never_leaves_the_argmax():
    # Regression: with a 24-bit uniform the largest hash gave u == 1.0, Gumbel noise +inf, and
    # log(0) + inf = NaN won torch's argmax. rng.uniform now keeps u strictly below 1.
    vocab = 97
    seed, off = _seed_with_max_hash(range(1, vocab + 1))
    logits = torch.zeros(1, 1, vocab, device=DEVICE)
    logits[0, 0, (off - 1 + 1) % vocab] = 5.0  # the argmax is not the +inf entry
    ref = speculative_verify_reference(logits, torch.zeros(1, 0, dtype=torch.long, device=DEVICE),
                                       torch.zeros(1, dtype=torch.long, device=DEVICE),
                                       torch.tensor([[seed]], device=DEVICE), 0.0)
    assert int(ref.next_tokens) == int(logits.argmax())


# ----------------------------------------------------------------------------------------------
# statistics: the kernel's draws follow the analytical distribution
# ----------------------------------------------------------------------------------------------


def _chi2_critical(df, z=3.719):  # upper 1e-4 quantile, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts, probs, n):
    expected = probs * n
    keep = expected >= 5
    lumped_obs = counts[~keep].sum()
    lumped_exp = expected[~keep].sum()
    obs = torch.cat([counts[keep], lumped_obs.view(1)]) if lumped_exp > 0 else counts[keep]
    exp = torch.cat([expected[keep], lumped_exp.view(1)]) if lumped_exp > 0 else expected[keep]
    assert counts[probs == 0].sum() == 0, "a token with probability 0 was drawn"
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, max(len(obs) - 1, 1)


@pytest.mark.parametrize("temperature,top_k,top_p,tau", [
    (1.0, 0, 1.0, 0.0),
    (0.7, 4, 0.9, 0.0),
    (1.0, 0, 1.0, 0.5),
])
def test_statistics_against_analytical_distribution(temperature, top_k, top_p, tau):
    """One draft from q per sequence: the first committed token must follow
    tau = 0: p;  tau > 0: q*a + (1 - sum q*a) * norm(max(0, p - q)) with a = min(1, (1+tau) p / q);
    and the bonus token after an accepted draft must follow p at the next anchor."""
    vocab, n = 9, 1200
    gen = torch.Generator().manual_seed(11)
    row_logits = torch.randn(2, vocab, generator=gen) * 1.5
    logits = row_logits.unsqueeze(0).expand(n, 2, vocab).contiguous().to(DEVICE)
    q_row = torch.softmax(torch.randn(vocab, generator=gen), -1)
    drafts = torch.multinomial(q_row, n, replacement=True, generator=gen).view(n, 1).to(DEVICE)
    q = q_row.view(1, 1, vocab).expand(n, 1, vocab).contiguous().to(DEVICE)
    seeds = make_seeds(gen, n, 2)
    nd = torch.ones(n, dtype=torch.long, device=DEVICE)
    # The kernel must equal the reference row for row; the statistics are then the reference's.
    # Under the Triton interpreter (one interpreted program per row) the kernel is compared on a
    # slice of the rows, on a GPU on all of them.
    rows = n if DEVICE == "cuda" else 200
    compare_speculative(logits[:rows], drafts[:rows], nd[:rows], seeds[:rows], temperature, top_k, top_p, tau,
                        q[:rows])
    got = speculative_verify_reference(logits, drafts, nd, seeds, temperature, top_k, top_p, tau, q)

    p = logits_to_probs(row_logits, temperature, top_k, top_p).double()
    qd = q_row.double()
    a = torch.clamp((1 + tau) * p[0] / qd, max=1.0)
    resid = (p[0] - qd).clamp_min(0)
    first_dist = qd * a + (1 - (qd * a).sum()) * resid / resid.sum()
    first = torch.where(got.accept_len == 1, drafts[:, 0], got.next_tokens).cpu()
    stat, df = _chi2(torch.bincount(first, minlength=vocab).double(), first_dist, n)
    assert stat < _chi2_critical(df), f"first token: chi2 {stat:.1f} on {df} df"
    accept_rate = (got.accept_len == 1).double().mean().item()
    expect = (qd * a).sum().item()
    assert abs(accept_rate - expect) < 4 * math.sqrt(expect * (1 - expect) / n) + 1e-9

    bonus = got.next_tokens[got.accept_len == 1].cpu()
    stat, df = _chi2(torch.bincount(bonus, minlength=vocab).double(), p[1], bonus.numel())
    assert stat < _chi2_critical(df), f"bonus token: chi2 {stat:.1f} on {df} df"
