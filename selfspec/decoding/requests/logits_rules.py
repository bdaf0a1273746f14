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
negative, for tokens that have appeared); then the grammar mask (-inf outside the tokens the
sequence's `TokenConstraint` allows after the row's path); then logit_bias is added. Where the
grammar allows nothing but the stop tokens min_new_tokens holds back (a grammar that must end
before min_new_tokens), the grammar wins at that row: every engine ends the sequence there, where
a row of -inf everywhere would have drawn a token the grammar rejects.

A row whose path the constraint cannot follow (a draft the grammar rejects) is left unmasked:
its parent row masks that draft to -inf, so verification rejects it and the row decides
nothing. ISD's `[MASK]` rows are not paths of real tokens either; their proposals are checked
when they are verified, like any draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from selfspec.decoding.step import DecodeSequence, StepBatch


class TokenConstraint(Protocol):
    """Grammar-constrained decoding as the rules see it (SGLang's grammar objects are adapted to
    it in `selfspec.sglang_ext.grammar`). The constraint's state is the committed output."""

    def allowed(self, path: Sequence[int], vocab: int) -> torch.Tensor | None:
        """Bool [vocab]: the tokens allowed after the committed output followed by `path`
        (the state is left as it was); None when `path` cannot be followed."""
        ...

    def accepts(self, path: Sequence[int]) -> int:
        """How many leading tokens of `path` the grammar accepts after the committed output
        (the state is left as it was)."""
        ...


def bitmask_to_bool(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [ceil(V / 32)] bitmask (bit j of word w: token 32w + j allowed; xgrammar's layout)
    -> bool [V]."""
    bits = (words.to(torch.int64).unsqueeze(-1) >> torch.arange(32, device=words.device)) & 1
    return bits.flatten()[:vocab].bool()


class GrammarWalk:
    """A `TokenConstraint` over a grammar object with SGLang's `BaseGrammarObject` methods
    (accept_token raising ValueError on a rejected token, rollback(k), is_terminated(),
    allocate_vocab_mask(V, 1, device), fill_vocab_mask(mask, 0)), whose state is the committed
    output. A row's mask: walk the row's path on it, fill the next-token bitmask, roll the walk
    back. `get_grammar` is read at every call (SGLang's scheduler owns and advances the object);
    paths holding `skip_token` (ISD's [MASK]) are not followed."""

    def __init__(self, get_grammar, skip_token: int | None = None):
        self.get_grammar = get_grammar
        self.skip_token = skip_token
        self._bitmask = None

    def allowed(self, path: Sequence[int], vocab: int) -> torch.Tensor | None:
        grammar = self.get_grammar()
        if grammar is None or (self.skip_token is not None and self.skip_token in path):
            return None
        walked = 0
        try:
            if grammar.is_terminated():  # the sequence ends here (its engine stops it)
                return None
            for token in path:
                grammar.accept_token(int(token))
                walked += 1
                if grammar.is_terminated():  # the path ends the sequence: nothing follows it
                    return None
            if self._bitmask is None or self._bitmask.shape[-1] * 32 < vocab:
                self._bitmask = grammar.allocate_vocab_mask(vocab, 1, "cpu")
            grammar.fill_vocab_mask(self._bitmask, 0)
            return bitmask_to_bool(self._bitmask[0], vocab)
        except ValueError:  # a draft the grammar rejects: this row decides nothing
            return None
        finally:
            if walked:
                grammar.rollback(walked)

    def accepts(self, path: Sequence[int]) -> int:
        grammar = self.get_grammar()
        if grammar is None:
            return len(path)
        walked = 0
        try:
            for token in path:
                if token == self.skip_token or grammar.is_terminated():
                    break
                grammar.accept_token(int(token))
                walked += 1
        except ValueError:  # the first token the grammar rejects
            pass
        finally:
            if walked:
                grammar.rollback(walked)
        return walked


def grammar_valid(seq: DecodeSequence, drafts: list[int]) -> list[int]:
    """`drafts` (for the positions after the pending token) cut at the first token the
    sequence's grammar rejects: no forward spends query tokens on drafts that cannot be accepted."""
    if seq.constraint is None or not drafts:
        return drafts
    return drafts[: seq.constraint.accepts(drafts)]


def mask_disallowed(row: torch.Tensor, seq: DecodeSequence, path: Sequence[int]) -> torch.Tensor:
    """A logits row [V] for the position after the committed output + `path`, with what the
    sequence's grammar rejects there at -inf (unchanged without a grammar, or off its path)."""
    if seq.constraint is None:
        return row
    allowed = seq.constraint.allowed(path, row.shape[-1])
    return row if allowed is None else row.masked_fill(~allowed.to(row.device), float("-inf"))


def _row_paths(batch: StepBatch | None, b: int, rows: int) -> list[list[int]]:
    """Each query row's ancestor tokens in the step (the pending token excluded), in order."""
    if batch is None:
        return [[] for _ in range(rows)]
    tokens = batch.tokens[b].tolist()
    return [[tokens[j] for j in seen] for seen in batch.seen(b, rows)]


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
    active = [b for b, s in enumerate(seqs) if s.sampling.has_logits_rules or s.constraint is not None]
    if not active:
        return logits
    logits = logits.clone()
    _, rows, vocab = logits.shape
    dev = logits.device
    for b in active:
        sp, seq = seqs[b].sampling, seqs[b]
        row = logits[b].float()
        counted = bool(sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0)
        if counted or sp.min_new_tokens:  # a grammar-only request skips the counting
            anc, depth = _ancestor_counts(batch, b, rows, vocab, dev)
        if counted:
            out = torch.tensor(seq.output, dtype=torch.long, device=dev)
            committed = torch.bincount(out, minlength=vocab)[:vocab].float() if out.numel() else torch.zeros(vocab, device=dev)
            counts = committed.unsqueeze(0) + anc  # [W, V]
            if sp.frequency_penalty:
                row = row - sp.frequency_penalty * counts
            if sp.presence_penalty:
                row = row - sp.presence_penalty * (counts > 0).float()
        held = None  # the stop tokens' logits min_new_tokens holds back, and the rows it holds them in
        if sp.min_new_tokens and seq.stop_ids:
            short = (len(seq.output) + depth) < sp.min_new_tokens  # [W]
            stops = torch.tensor(sorted(t for t in seq.stop_ids if 0 <= t < vocab), dtype=torch.long, device=dev)
            held = (stops, row[:, stops].clone(), short)
            row[:, stops] += torch.where(short.unsqueeze(-1), float("-inf"), 0.0)
        if sp.repetition_penalty != 1.0:  # scaling after every additive term, as SGLang orders them
            r = sp.repetition_penalty
            scaled = torch.where(row < 0, row * r, row / r)
            row = torch.where(counts > 0, scaled, row)
        if seq.constraint is not None:
            for i, path in enumerate(_row_paths(batch, b, rows)):
                allowed = seq.constraint.allowed(path, vocab)
                if allowed is not None:
                    row[i] = torch.where(allowed.to(dev), row[i], float("-inf"))
                    if held is not None and bool(held[2][i]) and not torch.isfinite(row[i]).any():
                        # the grammar allows only what min_new_tokens holds back (it must end
                        # here): the grammar wins, the sequence ends short of min_new_tokens
                        # rather than with a token the grammar rejects
                        stops, before, _ = held
                        row[i, stops] = torch.where(allowed.to(dev)[stops], before[i], float("-inf"))
        if sp.logit_bias:
            ids = torch.tensor([t for t, _ in sp.logit_bias], dtype=torch.long, device=dev)
            vals = torch.tensor([v for _, v in sp.logit_bias], dtype=torch.float32, device=dev)
            row[:, ids] += vals
        logits[b] = row.to(logits.dtype)
    return logits
