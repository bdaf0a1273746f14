"""AR: one token per forward, the baseline every other mode must reproduce."""

from __future__ import annotations

import torch

from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.requests.sampling import sample
from selfspec.decoding.step import DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome


def next_tokens(logits: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """[B, V] -> [B]: the AR sampling rule (greedy rows: first argmax), seed column 0."""
    if ctx.all_greedy:
        return first_argmax(logits)
    return sample(logits, ctx.seeds[:, 0], ctx.sampling_args())


class ARMode(Mode):
    name = "ar"
    seeds_per_step = 1
    max_width = 1

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        return [StepLayout([s.pending]) for s in seqs]

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        toks = next_tokens(logits[:, 0], ctx).tolist()
        return [StepOutcome([t], [0], 0) for t in toks]
