"""Triton kernels for the verify rules of `selfspec.decoding.modes.verify` (drop-in, same signatures).

The rules themselves are defined once, by the torch references in `selfspec.decoding.modes.verify`;
these kernels compute the same discrete results (accepted lengths, next tokens, winning branch)
from the same per-row seeds. They are selected by `selfspec.kernels.dispatch`.

Speculative (p/q) verify, four launches, no host synchronisation when top-k/top-p are off:

1. ``_spec_pass1`` -- the single streaming pass. One program per (row = (sequence, position),
   vocab split), rows past a sequence's ``num_drafts`` do nothing. Each program streams its slice
   of the logits once with an online softmax in base 2 (running max, per-lane rescaled sums):
   s2 = logit * log2(e) / T, partial max m and partial sum S of exp2(s2 - m). Temperature-0 rows
   keep the raw running max and its first index instead (p is one-hot at the first argmax).
   The row ``i == num_drafts`` (the bonus row, used only when every draft passes) also runs the
   Gumbel-max draw in the same pass: the winner of s2*ln2 + gumbel(seed, v + 1), which equals the
   winner of log p(v) + gumbel because log p = s2*ln2 - const. Candidates are compared pairwise
   as (s2_a - s2_b)*ln2 + (g_a - g_b), so huge scaled logits (T -> 0) lose no precision.
2. ``_spec_decide`` -- one program per sequence: merges the split partials, forms
   p(x_i) = exp2(s2(x_i) - m) / S for every draft (a gather of one logit per row), the accept test
   ``u * q(x_i) < (1 + tau) * p(x_i)`` with u = uniform(seed[b, i], 0) bit-identical to
   `selfspec.decoding.requests.rng`, the accepted prefix, and -- on the all-accept path -- the bonus token
   from the pass-1 candidates. Nothing else happens for an all-accept sequence: no correction.
3. ``_spec_pass2`` -- the correction, a second streaming pass over ONE row per sequence (the
   first rejected row), skipped (programs return at once) for sequences resolved in step 2.
   It evaluates the reference's formula literally: target = max(0, p - q) (q one-hot at the draft
   or the dense `draft_probs` row), falling back to p when the residual vanishes, and takes the
   argmax of log(target) + gumbel with torch's argmax semantics (first NaN, else first maximum).
   The bonus row also comes here in the rare case where a Gumbel value of the row is +inf
   (uniform == 1.0 exactly, probability 2^-24 per entry): the reference then scores
   log(0) + inf = NaN, which torch's argmax picks, and only the literal formula reproduces it.
4. ``_spec_finalize`` -- merges the pass-2 split partials and writes the next token.

Top-k / top-p: a clearly separated pre-pass (``_filter_thresholds``), run only when some row has
temperature > 0 and ``0 < top_k < V`` or ``top_p < 1`` (it synchronises with the host once when
the settings are tensors, like the reference). For the active sequences it reproduces the
reference's filter with torch ops, each filter measured on the unfiltered softmax as SGLang's
sampler does -- top-k: the k-th largest scaled logit (``torch.topk``), ties kept; top-p: the
softmax sorted (``topk`` over the largest 1024 probabilities, a full sort only for rows whose
kept mass is not reached there), ``cumsum - p > top_p`` drops; min-p: below min_p times the
largest probability drops -- and turns the kept set into one threshold per row *on the raw
logit*: keep v  <=>  logit(v) >= thr. That is exact because x -> x / T and softmax are monotone, so
the reference's kept set is always an upper set of the logits. The streaming kernels then apply
``logit >= thr`` as a mask inside the online softmax (so S is the kept mass and p is already
renormalised) at the cost of one comparison per element. One deliberate difference: when several
entries tie (equal probability) exactly at the top-p boundary, the reference keeps a subset that
depends on `torch.sort`'s (unstable) order; the kernel keeps the whole tie group, as top-k does.

Greedy verify: ``_argmax_pass`` (one streaming pass, per (row, split) first-argmax partials) and
``_greedy_combine`` (per sequence: row argmax, accepted prefix, next token; for the candidate /
tree variant it loops over the branches and keeps the first longest).

Every output is written by exactly one program; optional ``out_tokens [B, D+1]`` receives the
accepted drafts and the next token and nothing past them. Without top-k/top-p the whole call is
free of host synchronisation and can be captured in a CUDA graph.

Rounding: p here is exp2(s2 - m) / S with a different summation order and exp than
torch.softmax, so p(x) can differ from the reference's in the last bits. A discrete decision can
therefore differ only where the reference itself sits on a knife edge (u*q within rounding of
(1+tau)*p, or two Gumbel scores within rounding of each other); the tests detect and count those.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from typing import NamedTuple


class VerifyResult(NamedTuple):
    """Field for field the decoding core's result (kernels sit below decoding and do not import it)."""

    accept_len: torch.Tensor  # [B] long
    next_tokens: torch.Tensor  # [B] long


class CandidateVerifyResult(NamedTuple):
    accept_len: torch.Tensor
    next_tokens: torch.Tensor
    best_candidate: torch.Tensor

INTERPRETED = bool(knobs.runtime.interpret)
POISON_SCRATCH = False  # tests set this: scratch buffers are filled with garbage before every launch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BIG = 2147483647
TOPP_CANDIDATES = 1024

_sm_count: dict[int, int] = {}


def _device_fn(fn):
    """A device helper: `triton.jit` when compiling for a GPU; under the interpreter the same code
    as a plain function (the interpreter re-patches triton.language on every nested jit call,
    which otherwise dominates the CPU test time; the outer kernel's patch already covers it)."""
    return fn if INTERPRETED else triton.jit(fn)


# ----------------------------------------------------------------------------------------------
# shared device helpers
# ----------------------------------------------------------------------------------------------


@_device_fn
def _hash_u32(seed, offs):
    """murmur3 finaliser over seed * golden + offset, uint32 (== selfspec.decoding.requests.rng.hash_u32)."""
    x = seed * 0x9E3779B1 + offs
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    x = x ^ (x >> 16)
    return x


@_device_fn
def _uniform(h):
    # == selfspec.decoding.requests.rng.uniform: 23 bits, so the value stays strictly below 1.0
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@_device_fn
def _gumbel(h):
    return -tl.log(-tl.log(_uniform(h)))


@_device_fn
def _argmax_nan_update(score, offs, nan_idx, best, best_idx):
    """Running argmax with torch semantics: the first NaN wins, else the first maximum."""
    isnan = score != score
    nan_idx = tl.minimum(nan_idx, tl.min(tl.where(isnan, offs, 2147483647), axis=0))
    clean = tl.where(isnan, float("-inf"), score)
    bm = tl.max(clean, axis=0)
    bi = tl.min(tl.where(clean == bm, offs, 2147483647), axis=0)
    upd = bm > best
    return nan_idx, tl.where(upd, bm, best), tl.where(upd, bi, best_idx)


@_device_fn
def _load_tile(base, start, hi, BLOCK: tl.constexpr):
    """One tile of a logits row: the offsets [start, start + BLOCK), which of them lie below `hi`,
    and the logits there in fp32 (-inf past `hi`)."""
    offs = start + tl.arange(0, BLOCK)
    msk = offs < hi
    return offs, msk, tl.load(base + offs, mask=msk, other=float("-inf")).to(tl.float32)


@_device_fn
def _kept(x, msk, thr, HAS_FILTER: tl.constexpr):
    """The entries of `msk` the top-k / top-p / min-p filter keeps: logit >= the row's threshold."""
    keep = msk
    if HAS_FILTER:
        keep = keep & (x >= thr)
    return keep


@_device_fn
def _target_p(x, kept, c, m, S, at_argmax, greedy):
    """p at logits x: exp2(x * c - m) / S on the kept entries (m, S: the row's base-2 online
    softmax max and sum, c = log2(e) / T); a greedy row's p is one-hot at its first argmax."""
    p_s = tl.where(kept, tl.exp2(x * c - m) / S, 0.0)
    p_g = tl.where(at_argmax, 1.0, 0.0)
    return tl.where(greedy, p_g, p_s)


@_device_fn
def _inf_gumbel_flag(h, msk):
    """1 where the tile holds an entry whose Gumbel value from hash h is +inf (module doc), else 0."""
    return tl.max((msk & ((h >> 8) == 0xFFFFFF)).to(tl.int32), axis=0)


@_device_fn
def _gumbel_winner(s2, g, cand, s2_max, idx):
    """The first `idx` maximising s2 * ln2 + g among `cand` (2^31 - 1 when none), scored
    relative to the candidates' largest s2, `s2_max`, so that huge scaled logits lose no precision."""
    key = tl.where(cand, (s2 - tl.where(s2_max == float("-inf"), 0.0, s2_max)) * 0.6931471805599453 + g,
                   float("-inf"))
    kmax = tl.max(key, axis=0)
    return tl.min(tl.where(cand & (key == kmax), idx, 2147483647), axis=0)


@_device_fn
def _merge_split_max(pm, pidx, poff, pmask):
    """Rows of per-split maxima and first indices -> (the partial maxima [rows, splits], each
    row's maximum, its first index)."""
    M = tl.load(pm + poff, mask=pmask, other=float("-inf"))
    IP = tl.load(pidx + poff, mask=pmask, other=2147483647)
    m = tl.max(M, axis=1)
    return M, m, tl.min(tl.where(pmask & (M == m[:, None]), IP, 2147483647), axis=1)


@_device_fn
def _stream_argmax(base, lo, hi, seed, WITH_FLAG: tl.constexpr, BLOCK: tl.constexpr):
    """First argmax of raw logits over [lo, hi); optionally whether some gumbel(seed, v+1) is +inf."""
    best = tl.full((), float("-inf"), tl.float32)
    bidx = lo
    flag = tl.zeros((), tl.int32)
    for start in range(lo, hi, BLOCK):
        offs, msk, x = _load_tile(base, start, hi, BLOCK)
        bm = tl.max(x, axis=0)
        bi = tl.min(tl.where(msk & (x == bm), offs, 2147483647), axis=0)
        upd = bm > best
        best = tl.where(upd, bm, best)
        bidx = tl.where(upd, bi, bidx)
        if WITH_FLAG:
            flag = tl.maximum(flag, _inf_gumbel_flag(_hash_u32(seed, (offs + 1).to(tl.uint32)), msk))
    return best, bidx, flag


@_device_fn
def _stream_sampled(base, lo, hi, c, thr, seed, HAS_FILTER: tl.constexpr, WITH_GUMBEL: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Online softmax (base 2) over [lo, hi) and, for the bonus row, the Gumbel-max candidate."""
    m = tl.full((), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK,), tl.float32)
    bs = tl.full((), float("-inf"), tl.float32)
    bg = tl.zeros((), tl.float32)
    bidx = lo
    flag = tl.zeros((), tl.int32)
    for start in range(lo, hi, BLOCK):
        offs, msk, x = _load_tile(base, start, hi, BLOCK)
        keep = _kept(x, msk, thr, HAS_FILTER)
        s2 = tl.where(keep, x * c, float("-inf"))
        bm = tl.max(s2, axis=0)
        m_new = tl.maximum(m, bm)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp2(m - m_ref) + tl.exp2(s2 - m_ref)
        m = m_new
        if WITH_GUMBEL:
            h = _hash_u32(seed, (offs + 1).to(tl.uint32))
            flag = tl.maximum(flag, _inf_gumbel_flag(h, msk))
            g = _gumbel(h)
            ki = _gumbel_winner(s2, g, keep & (s2 > float("-inf")), bm, offs)
            cs = tl.max(tl.where(offs == ki, s2, float("-inf")), axis=0)
            cg = tl.max(tl.where(offs == ki, g, float("-inf")), axis=0)
            better = (ki != 2147483647) & ((bs == float("-inf")) | ((cs - bs) * 0.6931471805599453 + (cg - bg) > 0))
            bs = tl.where(better, cs, bs)
            bg = tl.where(better, cg, bg)
            bidx = tl.where(better, ki, bidx)
    return m, tl.sum(acc, axis=0), bs, bg, bidx, flag


# ----------------------------------------------------------------------------------------------
# speculative verify kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["V", "D", "NS", "CHUNK"])
def _spec_pass1(
    logits, s_lb, s_lt,
    seeds, s_sb, s_st,
    nd_ptr, temp_ptr, thr_ptr,
    pm, ps, pidx, pbs, pbg, pflag,
    V, D, NS, CHUNK,
    HAS_FILTER: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // (D + 1)
    i = row % (D + 1)
    nd = tl.minimum(tl.maximum(tl.load(nd_ptr + b), 0), D)
    if i <= nd:
        temp = tl.load(temp_ptr + b)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        base = logits + b.to(tl.int64) * s_lb + i.to(tl.int64) * s_lt
        seed = tl.load(seeds + b.to(tl.int64) * s_sb + i * s_st).to(tl.uint32)
        if temp <= 0.0:  # the raw maximum and its first index; no sum, no Gumbel candidate
            if i == nd:
                m, bidx, flag = _stream_argmax(base, lo, hi, seed, True, BLOCK)
            else:
                m, bidx, flag = _stream_argmax(base, lo, hi, seed, False, BLOCK)
            s = tl.zeros((), tl.float32)
            bs = tl.full((), float("-inf"), tl.float32)
            bg = tl.zeros((), tl.float32)
        else:
            c = 1.4426950408889634 / temp
            if HAS_FILTER:
                thr = tl.load(thr_ptr + row)
            else:
                thr = float("-inf")
            if i == nd:
                m, s, bs, bg, bidx, flag = _stream_sampled(base, lo, hi, c, thr, seed, HAS_FILTER, True, BLOCK)
            else:
                m, s, bs, bg, bidx, flag = _stream_sampled(base, lo, hi, c, thr, seed, HAS_FILTER, False, BLOCK)
        out = row * NS + split
        tl.store(pm + out, m)
        tl.store(ps + out, s)
        tl.store(pidx + out, bidx)
        tl.store(pbs + out, bs)
        tl.store(pbg + out, bg)
        tl.store(pflag + out, flag)


@triton.jit(do_not_specialize=["V", "D", "NS"])
def _spec_decide(
    logits, s_lb, s_lt,
    drafts, s_db, s_dt,
    nd_ptr, seeds, s_sb, s_st, temp_ptr, tau_ptr, thr_ptr,
    q_ptr, s_qb, s_qt,
    pm, ps, pidx, pbs, pbg, pflag,
    out_len, out_next, out_tok, s_ob,
    need, st_m, st_s, st_i,
    V, D, NS,
    HAS_FILTER: tl.constexpr, HAS_Q: tl.constexpr, HAS_OUT_TOK: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_NS: tl.constexpr,
):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    nd_raw = tl.load(nd_ptr + b)
    nd = tl.minimum(tl.maximum(nd_raw, 0), D)
    temp = tl.load(temp_ptr + b)
    greedy = temp <= 0.0
    c = 1.4426950408889634 / tl.where(greedy, 1.0, temp)
    ii = tl.arange(0, BLOCK_D)
    jj = tl.arange(0, BLOCK_NS)
    live = ii <= nd
    rows = b * (D + 1) + ii
    poff = rows[:, None] * NS + jj[None, :]
    pmask = live[:, None] & (jj[None, :] < NS)
    M, m, amax = _merge_split_max(pm, pidx, poff, pmask)
    SP = tl.load(ps + poff, mask=pmask, other=0.0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    S = tl.sum(tl.where(pmask, SP * tl.exp2(M - m_ref[:, None]), 0.0), axis=1)

    dmask = live & (ii < D)
    x = tl.load(drafts + b64 * s_db + ii * s_dt, mask=dmask, other=0)
    xin = dmask & (x >= 0) & (x < V)
    xl = tl.load(logits + b64 * s_lb + ii.to(tl.int64) * s_lt + x, mask=xin, other=float("-inf")).to(tl.float32)
    if HAS_FILTER:
        thr = tl.load(thr_ptr + rows, mask=live, other=float("-inf"))
    else:
        thr = float("-inf")
    p = _target_p(xl, _kept(xl, xin, thr, HAS_FILTER), c, m, S, xin & (x == amax), greedy)
    if HAS_Q:
        q = tl.load(q_ptr + b64 * s_qb + ii.to(tl.int64) * s_qt + x, mask=xin, other=0.0).to(tl.float32)
    else:
        q = 1.0
    sd = tl.load(seeds + b64 * s_sb + ii * s_st, mask=live, other=0).to(tl.uint32)
    u = _uniform(_hash_u32(sd, tl.zeros((BLOCK_D,), tl.uint32)))
    tau = tl.load(tau_ptr + b)
    acc = (u * q < (1.0 + tau) * p) & (ii < nd_raw) & dmask
    L = tl.min(tl.where(acc, 2147483647, ii), axis=0)

    sel = ii == L
    mj = tl.max(tl.where(sel, m, float("-inf")), axis=0)
    Sj = tl.sum(tl.where(sel, S, 0.0), axis=0)
    aj = tl.min(tl.where(sel, amax, 2147483647), axis=0)
    roff = (b * (D + 1) + L) * NS + jj
    rmask = jj < NS
    flag = tl.max(tl.load(pflag + roff, mask=rmask, other=0), axis=0)
    BS = tl.load(pbs + roff, mask=rmask, other=float("-inf"))
    BG = tl.load(pbg + roff, mask=rmask, other=0.0)
    BI = tl.load(pidx + roff, mask=rmask, other=2147483647)
    cand = rmask & (BS > float("-inf"))
    kj = _gumbel_winner(BS, BG, cand, tl.max(tl.where(cand, BS, float("-inf")), axis=0), jj)
    nxt_s = tl.min(tl.where(jj == kj, BI, 2147483647), axis=0)
    nxt = tl.where(greedy, aj, nxt_s)
    resolved = (L >= nd_raw) & (flag == 0) & (nxt >= 0) & (nxt < V)

    tl.store(out_len + b, L.to(tl.int64))
    tl.store(need + b, tl.where(resolved, 0, 1))
    tl.store(st_m + b, mj)
    tl.store(st_s + b, Sj)
    tl.store(st_i + b, aj)
    tl.store(out_next + b, nxt.to(tl.int64), mask=resolved)
    if HAS_OUT_TOK:
        tl.store(out_tok + b64 * s_ob + ii, x, mask=dmask & (ii < L))
        tl.store(out_tok + b64 * s_ob + L, nxt.to(tl.int64), mask=resolved)


@triton.jit(do_not_specialize=["V", "D", "NS", "CHUNK"])
def _spec_pass2(
    logits, s_lb, s_lt,
    drafts, s_db, s_dt,
    nd_ptr, seeds, s_sb, s_st, temp_ptr, thr_ptr,
    q_ptr, s_qb, s_qt,
    out_len, need, st_m, st_s, st_i,
    r_nan, r_best, r_idx, p_nan, p_best, p_idx, pos,
    V, D, NS, CHUNK,
    HAS_FILTER: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    b64 = b.to(tl.int64)
    if tl.load(need + b) != 0:
        j = tl.load(out_len + b)
        rejected = j < tl.load(nd_ptr + b)
        temp = tl.load(temp_ptr + b)
        greedy = temp <= 0.0
        c = 1.4426950408889634 / tl.where(greedy, 1.0, temp)
        m = tl.load(st_m + b)
        S = tl.load(st_s + b)
        am = tl.load(st_i + b)
        if HAS_FILTER:
            thr = tl.load(thr_ptr + b * (D + 1) + j)
        else:
            thr = float("-inf")
        seed = tl.load(seeds + b64 * s_sb + j * s_st).to(tl.uint32)
        # the reference's one-hot q sits at draft[min(j, D - 1)]; there is none when D == 0
        xs = tl.load(drafts + b64 * s_db + tl.maximum(tl.minimum(j, D - 1), 0) * s_dt)
        xs = tl.where(j * 0 + D > 0, xs, -1)
        base = logits + b64 * s_lb + j * s_lt
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        rn = tl.full((), 2147483647, tl.int32)
        rb = tl.full((), float("-inf"), tl.float32)
        ri = tl.full((), 2147483647, tl.int32)
        pn = tl.full((), 2147483647, tl.int32)
        pb = tl.full((), float("-inf"), tl.float32)
        pi = tl.full((), 2147483647, tl.int32)
        anypos = tl.zeros((), tl.int32)
        for start in range(lo, hi, BLOCK):
            offs, msk, xv = _load_tile(base, start, hi, BLOCK)
            p = _target_p(xv, _kept(xv, msk, thr, HAS_FILTER), c, m, S, offs == am, greedy)
            if HAS_Q:
                q = tl.load(q_ptr + b64 * s_qb + j * s_qt + offs, mask=msk & rejected & (j < D),
                            other=0.0).to(tl.float32)
            else:
                q = tl.where(rejected & (offs == xs), 1.0, 0.0)
            r = tl.maximum(p - q, 0.0)
            anypos = tl.maximum(anypos, tl.max((msk & (r > 0.0)).to(tl.int32), axis=0))
            g = _gumbel(_hash_u32(seed, (offs + 1).to(tl.uint32)))
            sr = tl.where(msk, tl.log(r) + g, float("-inf"))
            sp = tl.where(msk, tl.log(p) + g, float("-inf"))
            rn, rb, ri = _argmax_nan_update(sr, offs, rn, rb, ri)
            pn, pb, pi = _argmax_nan_update(sp, offs, pn, pb, pi)
        o = b * NS + split
        tl.store(r_nan + o, rn)
        tl.store(r_best + o, rb)
        tl.store(r_idx + o, ri)
        tl.store(p_nan + o, pn)
        tl.store(p_best + o, pb)
        tl.store(p_idx + o, pi)
        tl.store(pos + o, anypos)


@triton.jit(do_not_specialize=["NS"])
def _spec_finalize(
    need, out_len, nd_ptr,
    r_nan, r_best, r_idx, p_nan, p_best, p_idx, pos,
    out_next, out_tok, s_ob,
    NS,
    HAS_OUT_TOK: tl.constexpr, BLOCK_NS: tl.constexpr,
):
    b = tl.program_id(0)
    if tl.load(need + b) != 0:
        j = tl.load(out_len + b)
        rejected = j < tl.load(nd_ptr + b)
        jj = tl.arange(0, BLOCK_NS)
        mk = jj < NS
        o = b * NS + jj
        use_r = rejected & (tl.max(tl.load(pos + o, mask=mk, other=0), axis=0) > 0)
        N = tl.where(use_r, tl.load(r_nan + o, mask=mk, other=2147483647), tl.load(p_nan + o, mask=mk, other=2147483647))
        Bv = tl.where(use_r, tl.load(r_best + o, mask=mk, other=float("-inf")),
                      tl.load(p_best + o, mask=mk, other=float("-inf")))
        I = tl.where(use_r, tl.load(r_idx + o, mask=mk, other=2147483647), tl.load(p_idx + o, mask=mk, other=2147483647))
        first_nan = tl.min(N, axis=0)
        bm = tl.max(Bv, axis=0)
        bi = tl.min(tl.where(mk & (Bv == bm), I, 2147483647), axis=0)
        nxt = tl.where(first_nan < 2147483647, first_nan, bi)
        nxt = tl.where(nxt == 2147483647, 0, nxt)  # an all -inf row: torch's argmax says 0
        tl.store(out_next + b, nxt.to(tl.int64))
        if HAS_OUT_TOK:
            tl.store(out_tok + b.to(tl.int64) * s_ob + j, nxt.to(tl.int64))


# ----------------------------------------------------------------------------------------------
# greedy verify kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["V", "D", "NS", "CHUNK"])
def _argmax_pass(logits, s_ln, s_lt, nd_ptr, pm, pidx, V, D, NS, CHUNK, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    n = row // (D + 1)
    i = row % (D + 1)
    nd = tl.minimum(tl.maximum(tl.load(nd_ptr + n), 0), D)
    if i <= nd:
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        base = logits + n.to(tl.int64) * s_ln + i.to(tl.int64) * s_lt
        best, bidx, flag = _stream_argmax(base, lo, hi, 0, False, BLOCK)
        tl.store(pm + row * NS + split, best)
        tl.store(pidx + row * NS + split, bidx)


@triton.jit(do_not_specialize=["D", "NS", "C"])
def _greedy_combine(
    drafts, s_dn, s_dt, nd_ptr, pm, pidx,
    out_len, out_next, out_best, out_tok, s_ob,
    D, NS, C,
    HAS_BEST: tl.constexpr, HAS_OUT_TOK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_NS: tl.constexpr,
):
    b = tl.program_id(0)
    ii = tl.arange(0, BLOCK_D)
    jj = tl.arange(0, BLOCK_NS)
    best_len = tl.full((), -1, tl.int32)
    best_next = tl.zeros((), tl.int32)
    best_c = tl.zeros((), tl.int32)
    for cand in range(0, C):
        n = b * C + cand
        nd_raw = tl.load(nd_ptr + n)
        nd = tl.minimum(tl.maximum(nd_raw, 0), D)
        live = ii <= nd
        poff = (n * (D + 1) + ii)[:, None] * NS + jj[None, :]
        pmask = live[:, None] & (jj[None, :] < NS)
        M, m, am = _merge_split_max(pm, pidx, poff, pmask)
        dmask = live & (ii < D)
        x = tl.load(drafts + n.to(tl.int64) * s_dn + ii * s_dt, mask=dmask, other=-1)
        match = (am == x) & (ii < nd_raw) & dmask
        L = tl.min(tl.where(match, 2147483647, ii), axis=0)
        nxt = tl.min(tl.where(ii == L, am, 2147483647), axis=0)
        better = L > best_len
        best_len = tl.where(better, L, best_len)
        best_next = tl.where(better, nxt, best_next)
        best_c = tl.where(better, cand, best_c)
    tl.store(out_len + b, best_len.to(tl.int64))
    tl.store(out_next + b, best_next.to(tl.int64))
    if HAS_BEST:
        tl.store(out_best + b, best_c.to(tl.int64))
    if HAS_OUT_TOK:
        n = b * C + best_c
        x = tl.load(drafts + n.to(tl.int64) * s_dn + ii * s_dt, mask=(ii < D) & (ii < best_len), other=0)
        tl.store(out_tok + b.to(tl.int64) * s_ob + ii, x, mask=(ii < D) & (ii < best_len))
        tl.store(out_tok + b.to(tl.int64) * s_ob + best_len, best_next.to(tl.int64))


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------


def _default_block(vocab: int) -> int:
    if INTERPRETED:
        return min(1024, triton.next_power_of_2(max(vocab, 16)))
    return 2048


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: no reason to split
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return 4 * _sm_count[idx]


def _split(rows: int, vocab: int, block: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """(number of vocab splits, elements per split) for `rows` rows."""
    nblocks = triton.cdiv(vocab, block)
    want = num_splits if num_splits is not None else triton.cdiv(_target_programs(device), max(rows, 1))
    ns = max(1, min(nblocks, want))
    chunk = triton.cdiv(nblocks, ns) * block
    return triton.cdiv(vocab, chunk), chunk


def _scratch(sizes: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several scratch vectors carved out of one allocation (fewer allocator calls per verify)."""
    t = torch.empty(max(sum(sizes), 1), dtype=dtype, device=device)
    if POISON_SCRATCH:
        t.fill_(float("nan") if dtype.is_floating_point else -123456789)
    return list(t.split(sizes)) if sizes else []


def _output(out: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=torch.long, device=device)
    if out.shape != (n,) or out.dtype != torch.long or not out.is_contiguous():
        raise ValueError("output buffers must be contiguous int64 tensors of shape [B]")
    return out


def _check_out_tokens(out_tokens: torch.Tensor | None, rows: int, depth: int) -> None:
    if out_tokens is not None and (
        out_tokens.shape != (rows, depth + 1) or out_tokens.dtype != torch.long or out_tokens.stride(1) != 1
    ):
        raise ValueError("out_tokens must be int64 [B, D+1] with a unit last stride")


def _filter_thresholds(logits: torch.Tensor, temp: torch.Tensor, top_k, top_p, min_p=0.0) -> torch.Tensor | None:
    """Top-k / top-p / min-p pre-pass: per row (b, i) the smallest raw logit the filters keep
    (-inf: no filter).

    Mirrors `selfspec.decoding.requests.sampling.logits_to_probs` (temperature, softmax, then top-k with
    ties kept, top-p drop where `cumsum - p > top_p`, min-p drop below min_p * max, all on the
    unfiltered probabilities) on the sequences where a filter is active.
    None when no row is filtered (then the kernels skip the comparison altogether).
    """
    bsz, rows, vocab = logits.shape
    if not any(isinstance(v, torch.Tensor) for v in (top_k, top_p, min_p)):
        if not (0 < int(top_k) < vocab) and not (float(top_p) < 1.0) and not float(min_p) > 0:
            return None
    device = logits.device
    k = torch.as_tensor(top_k, dtype=torch.long, device=device).expand(bsz)
    p = torch.as_tensor(top_p, dtype=torch.float32, device=device).expand(bsz)
    m = torch.as_tensor(min_p, dtype=torch.float32, device=device).expand(bsz)
    k_act = (temp > 0) & (k > 0) & (k < vocab)
    p_act = (temp > 0) & (p < 1.0)
    m_act = (temp > 0) & (m > 0)
    seqs = (k_act | p_act | m_act).nonzero().squeeze(1)  # host sync (only when filters are requested)
    if seqs.numel() == 0:
        return None
    x = logits[seqs].float()  # [A, T, V]
    scaled = x / temp[seqs].view(-1, 1, 1)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    ka = k_act[seqs]
    if bool(ka.any()):
        kk = torch.where(ka, k[seqs], torch.ones_like(k[seqs]))
        kmax = int(kk.max())
        top = scaled.topk(kmax, dim=-1).values
        kth = top.gather(-1, (kk - 1).view(-1, 1, 1).expand(-1, rows, 1))
        kth = torch.where(ka.view(-1, 1, 1), kth, torch.full_like(kth, float("-inf")))
        keep = scaled >= kth
    pa, ma = p_act[seqs], m_act[seqs]
    probs = torch.softmax(scaled, dim=-1) if bool(pa.any() | ma.any()) else None
    if bool(pa.any()):
        pc = p[seqs].view(-1, 1, 1)
        boundary = _top_p_boundary(probs, pc)
        keep = keep & ((probs >= boundary) | ~pa.view(-1, 1, 1))
    if bool(ma.any()):
        floor = m[seqs].view(-1, 1, 1) * probs.amax(-1, keepdim=True)
        keep = keep & ((probs >= floor) | ~ma.view(-1, 1, 1))
    thr_active = torch.where(keep, x, torch.full_like(x, float("inf"))).amin(dim=-1)
    thr = torch.full((bsz, rows), float("-inf"), dtype=torch.float32, device=device)
    thr[seqs] = thr_active
    return thr.reshape(-1).contiguous()


def _top_p_boundary(probs: torch.Tensor, p_cut: torch.Tensor) -> torch.Tensor:
    """[A, T, V] probs -> [A, T, 1] probability of the last entry the top-p rule keeps."""
    vocab = probs.shape[-1]

    def boundary(sorted_p, cut):
        mass_before = sorted_p.cumsum(-1) - sorted_p
        n_keep = (mass_before <= cut).long().cumprod(-1).sum(-1, keepdim=True).clamp(min=1)
        return sorted_p.gather(-1, n_keep - 1), n_keep

    cand = min(vocab, TOPP_CANDIDATES)
    if cand < vocab:
        sorted_p = probs.topk(cand, dim=-1).values
        result, n_keep = boundary(sorted_p, p_cut)
        unresolved = (n_keep >= cand).squeeze(-1)  # the kept prefix may continue past the candidates
        if bool(unresolved.any()):
            full = probs[unresolved].sort(dim=-1, descending=True).values
            cut = p_cut.expand(*probs.shape[:2], 1)[unresolved]
            result[unresolved] = boundary(full, cut)[0]
        return result
    return boundary(probs.sort(dim=-1, descending=True).values, p_cut)[0]


def _per_row(value, dtype: torch.dtype, bsz: int, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(bsz).contiguous()
    # a fill, not a host->device copy: keeps the call capturable in a CUDA graph
    return torch.full((bsz,), value, dtype=dtype, device=device)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """The first n strides of an optional kernel operand (zeros when absent: never read)."""
    return tuple(t.stride()[:n]) if t is not None else (0,) * n


def _verify_io(target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor, bsz: int,
               depth: int, out: tuple[torch.Tensor, ...] | None, out_tokens: torch.Tensor | None):
    """The inputs as the kernels read them and the [B] outputs: (logits with a unit last stride,
    drafts and num_drafts as int64 -- one dummy draft column when there are none -- accept_len,
    next_tokens). `out_tokens` is checked against `bsz` rows of `depth` drafts."""
    device = target_logits.device
    logits = _unit_last(target_logits)
    drafts = draft_tokens.to(device=device, dtype=torch.long)
    if depth == 0:
        drafts = torch.zeros((drafts.shape[0], 1), dtype=torch.long, device=device)
    nd = num_drafts.to(device=device, dtype=torch.long).contiguous()
    _check_out_tokens(out_tokens, bsz, depth)
    accept_len = _output(out[0] if out is not None else None, bsz, device)
    next_tokens = _output(out[1] if out is not None else None, bsz, device)
    return logits, drafts, nd, accept_len, next_tokens


def speculative_verify_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    seeds: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    tau: torch.Tensor | float = 0.0,
    draft_probs: torch.Tensor | None = None,
    min_p: torch.Tensor | float = 0.0,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_tokens: torch.Tensor | None = None,
    block_v: int | None = None,
    num_splits: int | None = None,
    num_splits_pass2: int | None = None,
    num_warps: int = 4,
    stats: dict | None = None,
) -> VerifyResult:
    """Same contract as `speculative_verify_reference`; the keyword-only extras are for engines,
    tests and benchmarks: `out` (accept_len, next_tokens) buffers, `out_tokens` [B, D+1] (drafts
    accepted + the next token, nothing past them), launch geometry, and `stats` (receives the
    per-sequence `slow_path` flags: 1 where the correction pass ran)."""
    bsz, depth = draft_tokens.shape
    rows_per_seq = depth + 1
    vocab = target_logits.shape[-1]
    device = target_logits.device
    if target_logits.shape != (bsz, rows_per_seq, vocab):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} does not match drafts {tuple(draft_tokens.shape)}")
    logits, drafts, nd, accept_len, next_tokens = _verify_io(
        target_logits, draft_tokens, num_drafts, bsz, depth, out, out_tokens)
    seeds_l = seeds.to(device=device, dtype=torch.long)
    temp = _per_row(temperature, torch.float32, bsz, device)
    tau_b = _per_row(tau, torch.float32, bsz, device)
    thr = _filter_thresholds(logits, temp, top_k, top_p, min_p)
    has_q = draft_probs is not None
    q = _unit_last(draft_probs) if has_q else None
    if bsz == 0:
        return VerifyResult(accept_len, next_tokens)

    block = block_v or _default_block(vocab)
    nrows = bsz * rows_per_seq
    ns, chunk = _split(nrows, vocab, block, device, num_splits)
    f32, i32 = torch.float32, torch.int32
    ns2, chunk2 = _split(bsz, vocab, block, device, num_splits_pass2 if num_splits_pass2 is not None else num_splits)
    n1, n2 = nrows * ns, bsz * ns2
    pm, ps, pbs, pbg, st_m, st_s, r_best, p_best = _scratch([n1] * 4 + [bsz] * 2 + [n2] * 2, f32, device)
    pidx, pflag, need, st_i, r_nan, r_idx, p_nan, p_idx, pos = _scratch([n1] * 2 + [bsz] * 2 + [n2] * 5, i32, device)

    _spec_pass1[(nrows, ns)](
        logits, logits.stride(0), logits.stride(1),
        seeds_l, seeds_l.stride(0), seeds_l.stride(1),
        nd, temp, thr,
        pm, ps, pidx, pbs, pbg, pflag,
        vocab, depth, ns, chunk,
        HAS_FILTER=thr is not None, BLOCK=block, num_warps=num_warps,
    )
    block_d = triton.next_power_of_2(rows_per_seq)
    tok = out_tokens
    _spec_decide[(bsz,)](
        logits, logits.stride(0), logits.stride(1),
        drafts, drafts.stride(0), drafts.stride(1),
        nd, seeds_l, seeds_l.stride(0), seeds_l.stride(1), temp, tau_b, thr,
        q, *_strides(q, 2),
        pm, ps, pidx, pbs, pbg, pflag,
        accept_len, next_tokens, tok, *_strides(tok, 1),
        need, st_m, st_s, st_i,
        vocab, depth, ns,
        HAS_FILTER=thr is not None, HAS_Q=has_q, HAS_OUT_TOK=tok is not None,
        BLOCK_D=block_d, BLOCK_NS=triton.next_power_of_2(ns),
    )
    _spec_pass2[(bsz, ns2)](
        logits, logits.stride(0), logits.stride(1),
        drafts, drafts.stride(0), drafts.stride(1),
        nd, seeds_l, seeds_l.stride(0), seeds_l.stride(1), temp, thr,
        q, *_strides(q, 2),
        accept_len, need, st_m, st_s, st_i,
        r_nan, r_best, r_idx, p_nan, p_best, p_idx, pos,
        vocab, depth, ns2, chunk2,
        HAS_FILTER=thr is not None, HAS_Q=has_q, BLOCK=block, num_warps=num_warps,
    )
    _spec_finalize[(bsz,)](
        need, accept_len, nd,
        r_nan, r_best, r_idx, p_nan, p_best, p_idx, pos,
        next_tokens, tok, *_strides(tok, 1),
        ns2,
        HAS_OUT_TOK=tok is not None, BLOCK_NS=triton.next_power_of_2(ns2),
    )
    if stats is not None:
        stats["slow_path"] = need
        stats["num_splits"] = (ns, ns2)
    return VerifyResult(accept_len, next_tokens)


def _greedy(logits, drafts, nd, cands, out, out_best, out_tokens, block_v, num_splits, num_warps):
    nseq, rows_per_seq, vocab = logits.shape
    depth = rows_per_seq - 1
    bsz = nseq // cands
    device = logits.device
    logits, drafts, nd, accept_len, next_tokens = _verify_io(logits, drafts, nd, bsz, depth, out, out_tokens)
    if bsz == 0:
        return accept_len, next_tokens
    block = block_v or _default_block(vocab)
    nrows = nseq * rows_per_seq
    ns, chunk = _split(nrows, vocab, block, device, num_splits)
    (pm,) = _scratch([nrows * ns], torch.float32, device)
    (pidx,) = _scratch([nrows * ns], torch.int32, device)
    _argmax_pass[(nrows, ns)](
        logits, logits.stride(0), logits.stride(1), nd, pm, pidx, vocab, depth, ns, chunk,
        BLOCK=block, num_warps=num_warps,
    )
    tok = out_tokens
    _greedy_combine[(bsz,)](
        drafts, drafts.stride(0), drafts.stride(1), nd, pm, pidx,
        accept_len, next_tokens, out_best, tok, *_strides(tok, 1),
        depth, ns, cands,
        HAS_BEST=out_best is not None, HAS_OUT_TOK=tok is not None,
        BLOCK_D=triton.next_power_of_2(rows_per_seq), BLOCK_NS=triton.next_power_of_2(ns),
    )
    return accept_len, next_tokens


def greedy_verify_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_tokens: torch.Tensor | None = None,
    block_v: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
) -> VerifyResult:
    """Same contract as `greedy_verify_reference`."""
    accept_len, next_tokens = _greedy(
        target_logits, draft_tokens, num_drafts, 1, out, None, out_tokens, block_v, num_splits, num_warps
    )
    return VerifyResult(accept_len, next_tokens)


def greedy_verify_candidates_triton(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out_tokens: torch.Tensor | None = None,
    block_v: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
) -> CandidateVerifyResult:
    """Same contract as `greedy_verify_candidates_reference`: [B, C, D+1, V], [B, C, D], [B, C]."""
    bsz, cands, depth = draft_tokens.shape
    vocab = target_logits.shape[-1]
    best = _output(out[2] if out is not None else None, bsz, target_logits.device)
    accept_len, next_tokens = _greedy(
        target_logits.reshape(bsz * cands, depth + 1, vocab),
        draft_tokens.reshape(bsz * cands, depth),
        num_drafts.reshape(bsz * cands),
        cands, out[:2] if out is not None else None, best, out_tokens, block_v, num_splits, num_warps,
    )
    return CandidateVerifyResult(accept_len, next_tokens, best)


def logits_floor_bytes(target_logits: torch.Tensor, num_drafts: torch.Tensor | None = None) -> int:
    """Bytes a verify must read at least: every logit row it needs, once ([..., D+1, V])."""
    rows, vocab = target_logits.shape[-2], target_logits.shape[-1]
    if num_drafts is None:
        used = target_logits.numel() // vocab
    else:
        used = int((num_drafts.clamp(0, rows - 1) + 1).sum())
    return used * vocab * target_logits.element_size()
