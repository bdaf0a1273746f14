"""Greedy Jacobi decoding with multi-block decoding and rejection recycling (Jacobi Forcing §3.4).

Per sequence there is one real-active block (RA) and up to K−1 pseudo-active blocks (PA) of
n positions each, laid end to end after the pending token:

    main branch:  [pending | RA draft (n − accepted − 1) | PA_1 (n) | PA_2 (n) …]
    candidates:   [pending | pool n-gram c]   for up to `verify_size` n-grams from the pool

all in one forward, as a tree: the main branch and each candidate see the cached prefix, the
pending token and their own earlier tokens (`StepLayout.branch`). Positions are relative to
the pending token, so a candidate's i-th token shares its position with the main branch's.

Verification (`selfspec.decoding.modes.verify.greedy_verify_candidates_reference`): the RA draft and each
candidate (a pool n-gram capped at the RA draft's length; the context candidate uncapped) are
checked greedily against their own anchors;
the branch with the longest accepted prefix wins (the main branch on ties); its accepted
tokens plus the greedy token after them are committed, so the output is exactly greedy AR.

Then (`update_blocks`):
- the RA draft's rejected tail goes into the n-gram pool;
- RA: accepted += committed tokens; its draft becomes the greedy predictions after the new
  pending token (the winning branch's where it has them, the main branch's after that);
- each PA is pseudo-verified on the main branch: the longest prefix of its unfrozen tokens
  matching the predictions there, plus one, joins its frozen (pseudo-accepted) prefix, and
  its remaining tokens take the new predictions (a Jacobi update). Pseudo-accepted tokens are
  never emitted; they are drafts the block will verify for real once promoted;
- a context candidate that won past RA's last position restarts the blocks: no pseudo-active
  block, a fresh RA after the new pending token;
- promotion: when RA has accepted all n positions, the first PA becomes RA, its first position
  now holding the pending token (its other tokens are the new RA draft); when the pending token
  lands on RA's last position, the first PA becomes RA at once with all n of its tokens as the
  draft (so no forward goes without a draft); without a PA a fresh block is initialised;
- spawning: when the newest block has (pseudo-)accepted >= ceil(r·n) tokens and fewer than K
  blocks exist, a new PA is appended (RA's current draft, then initial tokens, to n).
Fresh tokens come from `init`: "random" (the paper's choice; seeded vocab draws), "context"
(seeded draws with replacement from the sequence's own tokens: what Jacobi Forcing's trajectories
start from, `context_draft`) or "history" (the sequence's last committed tokens: rejected, they
fill the pool with n-grams of the recent text, which the candidates then reuse, much like prompt
lookup).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from selfspec.decoding.requests import rng
from selfspec.decoding.modes.corpus import SharedCorpus
from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES, SuffixIndex, context_index, match_sizes
from selfspec.decoding.modes.ngram_pool import NgramPool
from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.step import DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome


INITS = ("history", "context", "random")


def _draws(history: list[int], count: int, modulus: int, salt: int = 0) -> list[int]:
    """`count` hashed draws in [0, modulus), seeded by the history's last token, its length and
    `salt`, so that a run repeats."""
    seed = rng.hash_u32(torch.tensor(history[-1]), torch.tensor(len(history) + (salt << 20)))
    return (rng.hash_u32(seed, torch.arange(count)) % modulus).tolist()


def context_draft(history: list[int], count: int, salt: int = 0) -> list[int]:
    """`count` tokens drawn with replacement from `history`: the initial draft of a Jacobi block."""
    return [history[i] for i in _draws(history, count, len(history), salt)]


@dataclass
class JacobiConfig:
    # CPU defaults, chosen by measured CPU time against AR (docs/results.md: mode defaults on CPU); the reference
    # GPU setting is block_size=64, max_blocks=2, init="random" (larger blocks pay on a GPU).

    block_size: int = 8  # n
    max_blocks: int = 1  # K: one real-active + up to K-1 pseudo-active blocks
    spawn_ratio: float = 0.85  # r: spawn when the newest block has accepted ceil(r*n)
    pool_size: int = 4  # n-grams kept per first token
    verify_size: int = 4  # pool candidates verified per step beside the main draft
    ngram_size: int = 4  # pool n-gram length (a candidate drafts ngram_size - 1 tokens)
    init: str = "history"  # fresh block tokens: "history" | "context" | "random" (the paper's)
    # context n-gram candidate: up to this many tokens that followed the latest earlier match of
    # the sequence's suffix, one more candidate branch beside the pool's (0 = off). Unlike the
    # pool's n-grams it may run past the real-active block: a win that long restarts the blocks
    context_tokens: int = 0
    context_match_sizes: tuple[int, ...] = CONTEXT_MATCH_SIZES  # suffix lengths tried, longest first
    # context candidates also from the other sequences served (`corpus.py`), for greedy rows
    context_corpus: bool = True
    # weak matches draft short candidates (`ngram.WEAK_MATCH_CAPS`; off: it did not pay served)
    context_caps: bool = False
    # > 0: a candidate is at most this many times as long as its match (`ngram.SuffixIndex`)
    context_length_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError("JACOBI block_size must be >= 2")
        if self.max_blocks < 1:
            raise ValueError("JACOBI max_blocks must be >= 1")
        if not 0 < self.spawn_ratio <= 1:
            raise ValueError("JACOBI spawn_ratio must be in (0, 1]")
        if self.init not in INITS:
            raise ValueError(f"JACOBI init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.ngram_size < 2:
            raise ValueError(f"JACOBI ngram_size must be >= 2 (a candidate drafts ngram_size - 1 tokens), got {self.ngram_size}")
        if self.pool_size < 1 or self.verify_size < 0:
            raise ValueError("JACOBI needs pool_size >= 1 and verify_size >= 0")
        if self.context_tokens < 0:
            raise ValueError(f"JACOBI context_tokens must be >= 0 (0 = off), got {self.context_tokens}")
        self.context_match_sizes = match_sizes(self.context_match_sizes, "JACOBI context_match_sizes")
        if self.context_length_factor < 0:
            raise ValueError(f"JACOBI context_length_factor must be >= 0 (0 = off), got {self.context_length_factor}")

    @property
    def spawn_threshold(self) -> int:
        return math.ceil(self.spawn_ratio * self.block_size)


@dataclass
class Block:
    tokens: list[int]  # RA: the draft after the pending token; PA: its n tokens
    # RA: positions committed before the pending token's (-1: the pending token precedes the
    # block, which then drafts all n); PA: frozen (pseudo-accepted) prefix length
    accepted: int = 0


@dataclass
class JacobiState:
    ra: Block
    pseudo: list[Block] = field(default_factory=list)
    pool: NgramPool | None = None
    index: SuffixIndex | None = None  # the context lookup (context_tokens > 0)
    candidates: list[list[int]] = field(default_factory=list)  # this step's pool drafts
    starts: list[int] = field(default_factory=list)  # where each candidate branch starts


def build_layout(pending: int, state: JacobiState) -> tuple[StepLayout, list[int]]:
    """The step's tree; returns it and the start index of each candidate branch."""
    main = list(state.ra.tokens)
    for blk in state.pseudo:
        main.extend(blk.tokens)
    tokens = [pending, *main]
    offsets = list(range(len(tokens)))
    branch = [0] + [1] * len(main)
    starts = []
    for c, cand in enumerate(state.candidates):
        starts.append(len(tokens))
        tokens.extend(cand)
        offsets.extend(range(1, len(cand) + 1))
        branch.extend([c + 2] * len(cand))
    return StepLayout(tokens, offsets, branch), starts


def pseudo_verify(block: Block, predictions: list[int]) -> Block:
    """Jacobi-update a pseudo-active block: predictions[j] is the main branch's greedy token for
    the block's position j. The unfrozen tokens matching it, plus one, join the frozen prefix;
    every unfrozen token takes its prediction."""
    n = len(block.tokens)
    a = block.accepted
    k = 0
    while a + k < n and block.tokens[a + k] == predictions[a + k]:
        k += 1
    tokens = block.tokens[:a] + list(predictions[a:n])
    return Block(tokens, min(n, a + k + 1))


def update_blocks(
    state: JacobiState,
    cfg: JacobiConfig,
    committed: int,
    predictions: list[int],
    main_predictions: list[int],
    fresh: list[int],
) -> None:
    """Advance the blocks after a step that committed `committed` tokens (accepted drafts + 1).

    predictions[r]: greedy token for relative position r+1 (r = 0 is the new pending's slot
    before the step, i.e. row r of the winning branch, falling back to the main branch);
    main_predictions: the same on the main branch, covering the pseudo-active blocks;
    fresh: n initial tokens for a new block (used only when one is created).
    """
    n = cfg.block_size
    ra = state.ra
    d = len(ra.tokens)
    a = committed - 1  # drafts accepted
    # pseudo-active blocks: their j-th token sits at relative position d + 1 + p*n + j
    updated = []
    for p, blk in enumerate(state.pseudo):
        start = d + 1 + p * n
        updated.append(pseudo_verify(blk, main_predictions[start - 1 : start - 1 + n]))
    state.pseudo = updated
    ra.accepted += committed
    if a < d - 1:  # RA continues: draft = predictions after the new pending token (rel a+2 .. d)
        ra.tokens = list(predictions[a + 1 : d])
    elif a > d:
        # a context candidate ran past RA's last slot: the pseudo-active blocks' positions are
        # committed or stale, so the blocks start afresh after the new pending token
        state.pseudo = []
        state.ra = Block((list(predictions[a + 1 :]) + list(fresh))[: n - 1], 0)
        return
    elif a == d - 1:
        # the new pending token fills RA's last slot, so RA has nothing left to draft: the next
        # block becomes RA now, all n of its tokens drafting after the pending one (accepted -1:
        # the pending token sits before its first position). Waiting for the promotion would
        # spend a forward without a draft (one token) and drop the recycled candidates with it.
        nxt = state.pseudo.pop(0).tokens if state.pseudo else list(fresh[:n])
        state.ra = Block(list(nxt), -1)
    else:  # RA full: promote the next block (its first position holds the new pending token)
        if state.pseudo:
            nxt = state.pseudo.pop(0)
            state.ra = Block(nxt.tokens[1:], 0)
        else:
            state.ra = Block(list(fresh[: n - 1]), 0)
    newest = state.pseudo[-1] if state.pseudo else state.ra
    if 1 + len(state.pseudo) < cfg.max_blocks and newest.accepted >= cfg.spawn_threshold:
        head = list(state.ra.tokens[:n])
        state.pseudo.append(Block(head + list(fresh[: n - len(head)]), 0))


class JacobiMode(Mode):
    name = "jacobi"
    greedy_only = True

    def __init__(self, config: JacobiConfig, vocab_size: int, corpus: SharedCorpus | None = None):
        self.config = config
        self.corpus = corpus
        self.vocab_size = vocab_size
        c = config
        self.seeds_per_step = 1  # unused: greedy only
        # the RA draft holds up to n tokens (an RA promoted while the pending token fills the last slot)
        self.max_width = (1 + c.max_blocks * c.block_size + c.verify_size * (c.ngram_size - 1)
                          + c.context_tokens)

    def _fresh(self, history: list[int], count: int) -> list[int]:
        """Initial tokens for a new block. Decoding is greedy, so they only affect speed; the
        random ones are seeded by the sequence itself (last token, length) so that runs repeat."""
        if self.config.init == "history":
            hist = history[-count:]
            return (hist * (count // max(1, len(hist)) + 1))[:count]
        if self.config.init == "context":
            return context_draft(history, count)
        return _draws(history, count, self.vocab_size)

    def start(self, seq: DecodeSequence) -> None:
        cfg = self.config
        seq.state = JacobiState(Block(self._fresh(seq.history, cfg.block_size - 1)), [],
                                NgramPool(cfg.ngram_size, cfg.pool_size),
                                context_index(seq, cfg, self.corpus))

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        out = []
        for s in seqs:
            st = s.state
            d = len(st.ra.tokens)
            cands = st.pool.candidates(s.pending, self.config.verify_size) if d else []
            cands = [c[:d] for c in cands]
            if st.index is not None and d:
                found = st.index.propose(s.history, self.config.context_tokens)
                if found and found != st.ra.tokens[: len(found)]:
                    # a pool n-gram the candidate starts with verifies nothing the candidate does not
                    cands = [found] + [c for c in cands if c != found[: len(c)]]
            st.candidates = cands
            lay, starts = build_layout(s.pending, st)
            st.starts = starts
            out.append(lay)
        return out

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        device = logits.device
        bsz = len(seqs)
        n_branch = 1 + max(len(s.state.candidates) for s in seqs)
        depth = max(len(c) for s in seqs for c in (s.state.ra.tokens, *s.state.candidates))
        rows = torch.zeros(bsz, n_branch, depth + 1, dtype=torch.long)
        drafts = torch.zeros(bsz, n_branch, depth, dtype=torch.long)
        num = torch.zeros(bsz, n_branch, dtype=torch.long)
        for b, s in enumerate(seqs):
            st = s.state
            d = len(st.ra.tokens)
            rows[b, 0, : d + 1] = torch.arange(d + 1)
            drafts[b, 0, :d] = torch.tensor(st.ra.tokens, dtype=torch.long)
            num[b, 0] = d
            for c, (cand, start) in enumerate(zip(st.candidates, st.starts)):
                g = len(cand)
                rows[b, c + 1, 1 : g + 1] = torch.arange(start, start + g)
                drafts[b, c + 1, :g] = torch.tensor(cand, dtype=torch.long)
                num[b, c + 1] = g
        rows, drafts, num = rows.to(device), drafts.to(device), num.to(device)
        target = logits.gather(1, rows.view(bsz, -1, 1).expand(-1, -1, logits.shape[-1]))
        result = ctx.ops.greedy_candidates(target.view(bsz, n_branch, depth + 1, -1), drafts, num)
        argmax = first_argmax(logits).tolist()
        outcomes = []
        for b, (s, a, t, w) in enumerate(zip(seqs, result.accept_len.tolist(), result.next_tokens.tolist(),
                                             result.best_candidate.tolist())):
            st = s.state
            am = argmax[b]
            main_len = 1 + len(st.ra.tokens) + sum(len(p.tokens) for p in st.pseudo)
            main_pred = am[:main_len]  # main_pred[r] predicts relative position r + 1
            if w == 0:
                accepted = st.ra.tokens[:a]
                keep = list(range(a + 1))
                pred = list(main_pred)
            else:
                cand, start = st.candidates[w - 1], st.starts[w - 1]
                accepted = cand[:a]
                keep = [0] + list(range(start, start + a))
                branch_pred = [am[0]] + am[start : start + len(cand)]
                pred = branch_pred + list(main_pred[len(branch_pred):])
            st.pool.add(st.ra.tokens[a:])
            emit = list(accepted) + [t]
            fresh = self._fresh(s.history + emit, self.config.block_size)
            update_blocks(st, self.config, len(emit), pred, main_pred, fresh)
            outcomes.append(StepOutcome(emit, keep, a))
        return outcomes
