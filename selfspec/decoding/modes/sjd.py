"""Speculative Jacobi Decoding with per-sequence progress and history-offset drafts (HB-SJD).

Each sequence keeps a Jacobi window of W drafts for the positions after its pending token.
One step is one causal forward over [pending, z_1 … z_W]; row i−1 judges z_i and row W is the
bonus anchor. Verification is greedy (greedy sampling) or probabilistic SJD (sampling): z_i is
accepted with probability min(1, p(z_i) / q(z_i)), q being the distribution that produced z_i;
the first rejected position is resampled from normalize(max(0, p − q)) and becomes the next
pending token, the start of the next round (its KV is computed by the next forward).

Next window (`next_window`): the predictions of the rows after the first rejection (rows a+1 …
W, which predict the positions after the new pending token) are reused as drafts: their argmax
(greedy) or a sample with q = that row's sampling distribution (probabilistic). The remaining
positions are filled from committed history at offset H: the draft for absolute position t is
the token at t − H (`history_drafts`), with q one-hot. Each sequence advances by its own
accepted length; nothing is synchronised across the batch.

Context candidates (`context_tokens` > 0): when the latest earlier match of the sequence's
suffix in its own prompt + output (`ngram.SuffixIndex`) proposes a continuation other than the
window, it is verified in the same forward as a second branch over the pending token
(`tree_verify`): a one-hot draft beside the window's drafts, so recursive rejection sampling
keeps AR's distribution. The winning branch's rows give the next window as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.decoding.requests.logits_rules import grammar_valid
from selfspec.decoding.modes.corpus import SharedCorpus
from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES, SuffixIndex, context_index, match_sizes
from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.requests.sampling import sample_from_probs
from selfspec.decoding.step import (
    DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome, verify_drafts,
)
from selfspec.decoding.modes.tree_verify import TreePlan, build_branches, finish_split, path_outcome, verify_paths


@dataclass
class SJDConfig:
    # CPU defaults (docs/results.md: mode defaults on CPU): TPF barely moves with W on an untrained model while
    # the cost grows with it, so the window is small; H=1 catches the runs a small model falls into.
    # HB-SJD on image tokens uses W=16, H=one row up.

    window: int = 2  # W drafts per step (W + 1 query tokens)
    history_offset: int = 1  # H: history-filled drafts copy the token H positions back
    # context n-gram candidate: up to this many tokens that followed the latest earlier match of
    # the sequence's suffix, verified as a second branch beside the window (0 = off)
    context_tokens: int = 0
    context_match_sizes: tuple[int, ...] = CONTEXT_MATCH_SIZES  # suffix lengths tried, longest first
    # context candidates also from the other sequences served (`corpus.py`), for greedy rows
    context_corpus: bool = True
    # weak matches draft short candidates (`ngram.WEAK_MATCH_CAPS`; off: it did not pay served)
    context_caps: bool = False
    # > 0: a candidate is at most this many times as long as its match (`ngram.SuffixIndex`)
    context_length_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"SJD window must be >= 1, got {self.window}")
        if self.history_offset < 1:
            raise ValueError(f"SJD history_offset must be >= 1, got {self.history_offset}")
        if self.context_tokens < 0:
            raise ValueError(f"SJD context_tokens must be >= 0 (0 = off), got {self.context_tokens}")
        self.context_match_sizes = match_sizes(self.context_match_sizes, "SJD context_match_sizes")
        if self.context_length_factor < 0:
            raise ValueError(f"SJD context_length_factor must be >= 0 (0 = off), got {self.context_length_factor}")


@dataclass
class SJDState:
    drafts: list[int] = field(default_factory=list)  # always W tokens after `start`
    q: torch.Tensor | None = None  # [W, V] proposal distributions (probabilistic only)
    q_known: list[bool] = field(default_factory=list)  # False: history draft, q one-hot
    index: SuffixIndex | None = None  # the context lookup (context_tokens > 0)
    plan: TreePlan | None = None  # this step's branches, when it has a candidate branch


def history_drafts(sequence: list[int], count: int, offset: int) -> list[int]:
    """Extend `sequence` (committed history, then any drafts already chosen) by `count` drafts:
    the draft at absolute position t is the token at t − offset (positions before the start
    take the first token). Later drafts may copy earlier drafts when offset < count."""
    seq = list(sequence)
    out = []
    for _ in range(count):
        src = len(seq) - offset
        tok = seq[src] if src >= 0 else seq[0]
        seq.append(tok)
        out.append(tok)
    return out


def next_window(
    history: list[int], accept_len: int, predictions: list[int], window: int, offset: int
) -> tuple[list[int], int]:
    """After a step that accepted `accept_len` drafts of a chain whose rows predicted
    `predictions` (one per row, the last the bonus row; history already extended by the emitted
    tokens): the new drafts are the predictions of the rows after accept_len (at most W),
    followed by history-offset fills; returns (drafts, how many came from predictions)."""
    reused = list(predictions[accept_len + 1 :])[:window]
    fill = history_drafts(history + reused, window - len(reused), offset)
    return reused + fill, len(reused)


class SJDMode(Mode):
    name = "sjd"

    def __init__(self, config: SJDConfig, corpus: SharedCorpus | None = None):
        self.config = config
        self.corpus = corpus
        w, k = config.window, config.context_tokens
        self.depth = max(w, k)  # the deepest draft chain
        # seeds 0 … depth verify (one per depth, then the bonus); depth+1 … 2·depth sample the
        # predictions of rows 1 … depth
        self.seeds_per_step = 2 * self.depth + 1
        self.max_width = w + 1 + k

    def start(self, seq: DecodeSequence) -> None:
        c = self.config
        seq.state = SJDState(history_drafts(seq.history, c.window, c.history_offset), None, [False] * c.window,
                             context_index(seq, c, self.corpus))

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        out = []
        for s in seqs:
            st = s.state
            st.plan = None
            candidate = (st.index.propose(s.history, self.config.context_tokens, shared=s.sampling.greedy)
                         if st.index is not None else [])
            candidate = grammar_valid(s, candidate)
            if candidate and candidate != st.drafts[: len(candidate)]:
                lay, st.plan = build_branches(s.pending, [(st.drafts, 0), (candidate, 0)], s.pending)
                lay.gate = None
                out.append(lay)
            else:
                out.append(StepLayout([s.pending, *st.drafts]))
        return out

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        return finish_split(seqs, logits, ctx, self._finish_windows, self._finish_tree)

    def _window_q(self, states: list[SJDState], drafts: torch.Tensor, vocab: int) -> torch.Tensor:
        """[B, W, V] the distributions the window's drafts came from (one-hot for history drafts)."""
        q = torch.nn.functional.one_hot(drafts, vocab).float()
        for b, st in enumerate(states):
            if st.q is not None:
                known = torch.tensor(st.q_known, device=drafts.device)
                q[b, known] = st.q[known]
        return q

    def _predictions(self, rows: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's prediction for the position after it [B, R] (argmax, or a sample when
        sampling: row r ≥ 1 with seed column depth + r) and, when sampling, the rows' sampling
        distributions [B, R, V]. Row 0 is never reused (its position is verified)."""
        if ctx.all_greedy:
            return first_argmax(rows), None
        probs = ctx.probs(rows)
        r = rows.shape[1]
        sampled = sample_from_probs(probs[:, 1:], ctx.seeds[:, self.depth + 1 : self.depth + r])
        return torch.cat([sampled[:, :1], sampled], dim=1), probs

    def _advance(self, seq: DecodeSequence, emit: list[int], accept_len: int, preds: list[int],
                 probs: torch.Tensor | None, greedy: bool) -> None:
        """The next window from the winning chain's row predictions (`next_window`)."""
        w, vocab = self.config.window, None if probs is None else probs.shape[-1]
        new_drafts, reused = next_window(seq.history + emit, accept_len, preds, w, self.config.history_offset)
        q = None
        if probs is not None and not greedy:
            q = torch.zeros(w, vocab, device=probs.device)
            if reused:
                q[:reused] = probs[accept_len + 1 : accept_len + 1 + reused]
        seq.state = SJDState(new_drafts, q, [i < reused for i in range(w)], seq.state.index)

    def _finish_windows(self, seqs, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        """Steps without a candidate branch, verified as one batch."""
        w = self.config.window
        device = logits.device
        drafts = torch.tensor([s.state.drafts for s in seqs], dtype=torch.long, device=device)
        num = torch.full((len(seqs),), w, dtype=torch.long, device=device)
        target = logits[:, : w + 1]
        draft_probs = None if ctx.all_greedy else self._window_q([s.state for s in seqs], drafts, logits.shape[-1])
        result = verify_drafts(target, drafts, num, ctx, draft_probs=draft_probs)
        preds, probs = self._predictions(target, ctx)
        preds = preds.tolist()
        greedy = ctx.greedy.tolist()
        outcomes = []
        for b, (s, a, t) in enumerate(zip(seqs, result.accept_len.tolist(), result.next_tokens.tolist())):
            emit = s.state.drafts[:a] + [t]
            self._advance(s, emit, a, preds[b], None if probs is None else probs[b], bool(greedy[b]))
            outcomes.append(StepOutcome(emit, list(range(a + 1)), a))
        return outcomes

    def _finish_tree(self, seq: DecodeSequence, logits: torch.Tensor, ctx: StepContext) -> StepOutcome:
        """A step with a candidate branch: `verify_paths` picks the branch and the tokens; the
        winning branch's rows give the next window."""
        st, plan = seq.state, seq.state.plan
        if not ctx.all_greedy:
            drafts = torch.tensor([st.drafts], dtype=torch.long, device=logits.device)
            plan.paths[0].probs = self._window_q([st], drafts, logits.shape[-1])[0]
        res = verify_paths(logits, plan.paths, ctx.seeds[0], **ctx.row(0))
        path = plan.paths[res.path]
        rows = path.rows + [path.end_row]  # rows[r] predicts the chain's position r + 1
        preds, probs = self._predictions(logits[rows].unsqueeze(0), ctx)
        outcome = path_outcome(plan, res)
        self._advance(seq, outcome.emit, res.accepted, preds[0].tolist(), None if probs is None else probs[0],
                      bool(ctx.greedy[0]))
        return outcome
