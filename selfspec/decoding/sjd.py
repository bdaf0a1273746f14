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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.decoding.sampling import logits_to_probs, sample_from_probs
from selfspec.decoding.step import (
    DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome, verify_drafts,
)


@dataclass
class SJDConfig:
    # CPU defaults (README "Mode defaults"): TPF barely moves with W on an untrained model while
    # the cost grows with it, so the window is small; H=1 catches the runs a small model falls into.
    # HB-SJD on image tokens uses W=16, H=one row up.

    window: int = 2  # W drafts per step (W + 1 query tokens)
    history_offset: int = 1  # H: history-filled drafts copy the token H positions back

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"SJD window must be >= 1, got {self.window}")
        if self.history_offset < 1:
            raise ValueError(f"SJD history_offset must be >= 1, got {self.history_offset}")


@dataclass
class SJDState:
    drafts: list[int] = field(default_factory=list)  # always W tokens after `start`
    q: torch.Tensor | None = None  # [W, V] proposal distributions (probabilistic only)
    q_known: list[bool] = field(default_factory=list)  # False: history draft, q one-hot


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
    """After a step that accepted `accept_len` of W drafts (history already extended by the
    emitted tokens): the new drafts are the predictions of rows accept_len+1 … W followed by
    history-offset fills; returns (drafts, how many came from predictions)."""
    reused = list(predictions[accept_len + 1 : window + 1])
    fill = history_drafts(history + reused, window - len(reused), offset)
    return reused + fill, len(reused)


class SJDMode(Mode):
    name = "sjd"

    def __init__(self, config: SJDConfig):
        self.config = config
        w = config.window
        self.seeds_per_step = 2 * w + 1  # W+1 verify seeds, then one per new sampled draft
        self.max_width = w + 1

    def start(self, seq: DecodeSequence) -> None:
        w, h = self.config.window, self.config.history_offset
        seq.state = SJDState(history_drafts(seq.history, w, h), None, [False] * w)

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        return [StepLayout([s.pending, *s.state.drafts]) for s in seqs]

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        w = self.config.window
        device = logits.device
        vocab = logits.shape[-1]
        drafts = torch.tensor([s.state.drafts for s in seqs], dtype=torch.long, device=device)
        num = torch.full((len(seqs),), w, dtype=torch.long, device=device)
        target = logits[:, : w + 1]
        probabilistic = not ctx.all_greedy
        draft_probs = None
        if probabilistic:
            draft_probs = torch.nn.functional.one_hot(drafts, vocab).float()
            for b, s in enumerate(seqs):
                if s.state.q is not None:
                    known = torch.tensor(s.state.q_known, device=device)
                    draft_probs[b, known] = s.state.q[known]
        result = verify_drafts(target, drafts, num, ctx, draft_probs=draft_probs)

        # predictions of every row (only the rows after each sequence's rejection are reused);
        # rows 1 … W are sampled with seed columns W+1 … 2W, row 0 is never reused
        if probabilistic:
            probs = logits_to_probs(target, ctx.temperature, ctx.top_k, ctx.top_p)  # [B, W+1, V]
            sampled = sample_from_probs(probs[:, 1:], ctx.seeds[:, w + 1 : 2 * w + 1])
            preds = torch.cat([sampled[:, :1], sampled], dim=1)
        else:
            probs = None
            preds = target.argmax(-1)
        outcomes = []
        for b, (s, a, t) in enumerate(zip(seqs, result.accept_len.tolist(), result.next_tokens.tolist())):
            emit = s.state.drafts[:a] + [t]
            new_drafts, reused = next_window(s.history + emit, a, preds[b].tolist(), w, self.config.history_offset)
            q = None
            if probs is not None and not bool(ctx.greedy[b]):
                q = torch.zeros(w, vocab, device=device)
                if reused:
                    q[:reused] = probs[b, a + 1 : a + 1 + reused]
            s.state = SJDState(new_drafts, q, [i < reused for i in range(w)])
            outcomes.append(StepOutcome(emit, list(range(a + 1)), a))
        return outcomes
