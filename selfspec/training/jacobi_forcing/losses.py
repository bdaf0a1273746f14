"""The Jacobi Forcing loss: progressive consistency + w_ar * AR cross-entropy (+ w_anchor * AR anchor).

- **Consistency** (the seed's L_pc): at every offset t of noisy block j from its first wrong
  token d_j on (t >= d_j; offset n-1, which predicts the next block's first token, included),
  the soft cross-entropy from the noisy row's distribution to the clean row's distribution at
  the same offset, taken from the same forward and detached (the current model as its own
  teacher; soft CE has the gradient of KL, and KL is what is logged). Offsets before d_j see the
  same correct tokens as the clean row and are left out, as in the seed.
- **AR**: cross-entropy of the clean chain (the last prompt token predicts the first response
  token, every clean token the next), i.e. the model's own greedy responses; the prompt itself
  is not trained (it is not the model's output, and on chat data it is a system prompt).
- **Anchor** (optional): KL(frozen base || clean rows) at the AR positions, which holds the AR
  path (JACOBI's verify distribution) to the base's and so its perplexity.
- Nothing after the response's first EOS counts in any term (the public reference counts
  post-EOS positions in the consistency loss), nor padding.

Normalisation, defined once: each term is a mean over the positions it counts, in the whole
micro-batch (not per block, not per row), and the total is L_pc + w_ar * L_AR + w_anchor * L_anchor.
The public code divides L_pc by T a second time and multiplies L_AR by a hard-coded 10 (an
effective AR:consistency weight of about 10T:1); here the weights are the knobs, stated in the
config, and a token counts the same wherever it sits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.training.jacobi_forcing.data import JFBatch
from selfspec.training.jacobi_forcing.forward import JFLogits
from selfspec.training.losses import IGNORE_INDEX, _ce, ar_anchor_kl, self_distill_ce


def first_errors(noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """[B, T, n] x 2 -> [B, T]: d, the first offset where the state differs (n if none)."""
    n = noisy.shape[-1]
    wrong = noisy != clean
    d = torch.where(wrong, torch.arange(n, device=noisy.device), n)
    return d.min(-1).values


def consistency_labels(batch: JFBatch) -> torch.Tensor:
    """[B, T, n] long: 0 where the consistency term counts, IGNORE_INDEX elsewhere (the shape
    of `losses.self_distill_ce`'s labels)."""
    n = batch.clean.shape[-1]
    d = first_errors(batch.noisy, batch.clean)
    keep = (torch.arange(n).view(1, 1, n) >= d.unsqueeze(-1)) & batch.predicts
    labels = torch.full(batch.clean.shape, IGNORE_INDEX, dtype=torch.long)
    labels[keep] = 0
    return labels


def chain_labels(batch: JFBatch) -> torch.Tensor:
    """[B, 1 + T*n]: the AR targets of the clean chain (IGNORE_INDEX after EOS and at the end)."""
    bsz = batch.clean.shape[0]
    response = batch.clean.reshape(bsz, -1)
    predicts = batch.predicts.reshape(bsz, -1)
    nxt = torch.where(predicts[:, :-1], response[:, 1:], torch.full_like(response[:, 1:], IGNORE_INDEX))
    last = torch.full((bsz, 1), IGNORE_INDEX, dtype=torch.long)  # the last token's target is beyond the row
    return torch.cat([response[:, :1], nxt, last], dim=1)


@dataclass
class JFLoss:
    total: torch.Tensor
    consistency: float  # soft CE
    consistency_kl: float
    ar_ce: float
    anchor_kl: float | None
    counted: int  # consistency positions


def jf_loss(logits: JFLogits, batch: JFBatch, ar_weight: float, anchor_weight: float = 0.0,
            teacher_chain: torch.Tensor | None = None) -> JFLoss:
    device = logits.noisy.device
    c_labels = consistency_labels(batch).to(device)
    clean_blocks = logits.chain[:, 1:].view_as(logits.noisy)
    pc = self_distill_ce(logits.noisy, clean_blocks, c_labels)
    with torch.no_grad():
        valid = c_labels != IGNORE_INDEX
        if bool(valid.any()):
            target = torch.log_softmax(clean_blocks[valid].float(), -1)
            kl = float(pc.detach() + (target.exp() * target).sum(-1).mean())
        else:
            kl = 0.0
    a_labels = chain_labels(batch).to(device)
    ar, _, _ = _ce(logits.chain, a_labels)
    total = pc + ar_weight * ar
    anchor = None
    if anchor_weight > 0 and teacher_chain is not None:
        anchor_t = ar_anchor_kl(logits.chain, teacher_chain, a_labels)
        total = total + anchor_weight * anchor_t
        anchor = float(anchor_t.detach())
    return JFLoss(total, float(pc.detach()), kl, float(ar.detach()), anchor, int(valid.sum()))
