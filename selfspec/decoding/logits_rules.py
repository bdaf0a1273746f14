"""Per-request logits rules, applied to every row of a step exactly as plain decoding applies
them at that row's position: repetition / frequency / presence penalties, logit_bias and
min_new_tokens.

A step row predicts the token after its query token; the output plain AR would have produced
before that token is the sequence's committed output (`DecodeSequence.output`, the pending
token included) followed by the row's ancestors in the step: the step tokens it sees
(`StepBatch.local`), the pending token excepted (it is already in the output). For a verify
row of any mode those ancestors are exactly the drafts that acceptance would commit before
the row's token, so each rule sees the counts and the length AR would see there — per position,
not once per step. Rows that see `[MASK]` tokens (ISD proposals) count them too; they only
shape proposals, which any distribution may do.

Semantics are SGLang 0.5.23's penalizers (`sampling/penaltylib/`) as its scheduler applies them
(`SamplingBatchInfo.copy_for_forward` then `apply_logits_bias`): counts over output tokens only
(not the prompt); frequency subtracts penalty × count; presence subtracts the penalty once a
token has appeared; min_new_tokens adds -inf to the stop tokens while the output is shorter;
these additive terms first, then repetition (logit / r where the logit is positive, × r where
negative, for tokens that have appeared); then the grammar mask (not built yet); then logit_bias
is added.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.decoding.step import DecodeSequence, StepBatch


def _ancestor_counts(batch: StepBatch | None, b: int, rows: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's per-query-row token counts over its step ancestors [W, V] and their number [W]."""
    if batch is None or batch.width <= 1:
        return torch.zeros(rows, vocab, device=device), torch.zeros(rows, device=device)
    sees = batch.local[b, :rows, 1:].to(device=device, dtype=torch.float32)  # [W, W-1]
    one_hot = torch.nn.functional.one_hot(batch.tokens[b, 1:].to(device), vocab).float()  # [W-1, V]
    return sees @ one_hot, sees.sum(-1)


def apply_logits_rules(logits: torch.Tensor, seqs: Sequence[DecodeSequence], batch: StepBatch | None) -> torch.Tensor:
    """logits [B, W, V] of a step (or [B, 1, V] at prefill, batch None) -> the rows with each
    sequence's rules applied; sequences without rules are left untouched (no copy is made when
    no sequence has any)."""
    active = [b for b, s in enumerate(seqs) if s.sampling.has_logits_rules]
    if not active:
        return logits
    logits = logits.clone()
    _, rows, vocab = logits.shape
    dev = logits.device
    for b in active:
        sp, seq = seqs[b].sampling, seqs[b]
        out = torch.tensor(seq.output, dtype=torch.long, device=dev)
        committed = torch.bincount(out, minlength=vocab)[:vocab].float() if out.numel() else torch.zeros(vocab, device=dev)
        anc, depth = _ancestor_counts(batch, b, rows, vocab, dev)
        counts = committed.unsqueeze(0) + anc  # [W, V]
        row = logits[b].float()
        additive = torch.zeros_like(row)
        if sp.frequency_penalty:
            additive -= sp.frequency_penalty * counts
        if sp.presence_penalty:
            additive -= sp.presence_penalty * (counts > 0).float()
        if sp.min_new_tokens and seq.stop_ids:
            short = (len(seq.output) + depth) < sp.min_new_tokens  # [W]
            stops = torch.tensor(sorted(t for t in seq.stop_ids if 0 <= t < vocab), dtype=torch.long, device=dev)
            additive[:, stops] += torch.where(short.unsqueeze(-1), float("-inf"), 0.0)
        row = row + additive
        if sp.repetition_penalty != 1.0:
            r = sp.repetition_penalty
            scaled = torch.where(row < 0, row * r, row / r)
            row = torch.where(counts > 0, scaled, row)
        if sp.logit_bias:
            ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.long, device=dev)
            vals = torch.tensor([v for _, v in sp.logit_bias], dtype=torch.float32, device=dev)
            row[:, ids] += vals
        logits[b] = row.to(logits.dtype)
    return logits
