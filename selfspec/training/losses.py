"""The I-DLM objective: CE on the MASK half + scale * CE on the clean half.

Both halves use the same shifted labels: the output at position p predicts token p+1
(`labels[:, p] = x[p+1]`, -100 where there is nothing to learn: the last position, padding,
prompt tokens of chat data).

The clean-loss scale:
- `fixed`: scale = `ce_scale` (0.2 in the seed) — used in the first stride expansions
  (N = 1 -> 2 and 2 -> 3), where a low clean weight speeds up learning the MASK positions;
- `auto` (from the N = 3 -> 4 expansion on): the clean term is rescaled to the magnitude of
  the MASK term, computed per micro-batch with gradients stopped through the ratio:

      scale = sg(CE_mask*) / (sg(CE_clean) + 1e-8)
      L     = CE_mask + scale * CE_clean

  where CE_mask* is the MASK half's CE over the targets the clean half also learns (for
  corpus data: all of them, so CE_mask* = CE_mask and L = 2 * CE_mask in value; rows that
  train the MASK half only, such as on-policy data, do not enter the ratio). The clean term
  contributes gradient in proportion CE_mask* / CE_clean: when the clean (AR) path is well
  fitted relative to the MASK path on the same tokens, its weight grows, which holds the
  verify distribution in place while the harder MASK predictions (longer strides) would
  otherwise dominate. This is the rule of the public I-DLM code (`loss_auto_balance`), whose
  Eq. 2 the seed does not print.

Optional extra terms, off by default (weight 0 is the seed's loss exactly):
- `self_distill_ce` (`mask_distill_weight`): the MASK distribution towards the detached
  clean-half distribution at the same position, both tempered (`mask_distill_temperatures`,
  one per batch in turn) so that the proposals match what a sampling server accepts.
- `ar_anchor_kl` (`ar_anchor_weight`): KL(base || clean half) on the clean positions, the frozen
  pre-conversion model as teacher. It holds the AR (verify) path to the base's distribution with
  soft targets, which carry far more per token than the corpus' one-hot labels; a small model
  whose MASK half learns on-policy data otherwise pays for it in AR perplexity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from selfspec.training.distributed import (
    all_reduce_sum, data_parallel, global_mean_and_value, global_value, mean_over_positions,
)

IGNORE_INDEX = -100
AUTO_BALANCE_EPS = 1e-8


def shifted_labels(clean: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, L+1] clean ids -> [B, L] labels (token p+1 at position p).

    `loss_mask` [B, L+1] (optional) marks the tokens worth predicting (True); a label is kept
    where its target token is marked."""
    labels = clean[:, 1:].clone()
    if loss_mask is not None:
        labels[~loss_mask[:, 1:].bool()] = IGNORE_INDEX
    return labels


def next_token_ce(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Pre-training's loss: logits [B, L, V] of tokens[:, :-1] against tokens[:, 1:], with the
    loop's statistics."""
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return loss, {"loss": loss.item()}


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mean CE over the labelled positions of every process's rows, for backward; its value,
    detached; this process's count). See `selfspec.training.distributed`."""
    count = int((labels != IGNORE_INDEX).sum())
    if count == 0 and not data_parallel():
        zero = logits.sum() * 0.0
        return zero, zero.detach(), 0
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    loss, value = global_mean_and_value(total, count)
    return loss, value, count


@dataclass
class IDLMLoss:
    total: torch.Tensor
    mask_ce: torch.Tensor  # detached
    clean_ce: torch.Tensor  # detached
    scale: float
    mask_tokens: int
    clean_tokens: int
    distill: torch.Tensor | None = None  # detached; only with distill_weight > 0
    anchor: torch.Tensor | None = None  # detached; only with anchor_weight > 0


def self_distill_ce(mask_logits: torch.Tensor, clean_logits: torch.Tensor, labels: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """Optional extra term: cross-entropy of the MASK distribution q at position p towards the
    detached clean-half distribution p at the same position (the model's own AR prediction of the
    same token p+1, given the true tokens <= p), averaged over labelled positions. It pulls the
    proposals towards what the verify positions will accept rather than only towards the data.

    `temperature` T tempers both sides, softmax(logits / T): sampled acceptance at T is
    sum(min(p_T, q_T)), so T < 1 weighs the head of the distribution a sampling server draws from
    (and T -> 0 the greedy match)."""
    valid = labels != IGNORE_INDEX
    if not bool(valid.any()) and not data_parallel():
        return mask_logits.sum() * 0.0
    target = torch.softmax(clean_logits[valid].detach().float() / temperature, dim=-1)
    logq = torch.log_softmax(mask_logits[valid].float() / temperature, dim=-1)
    return mean_over_positions(-(target * logq).sum(-1))


def ar_anchor_kl(clean_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions at the clean positions that carry
    a label, averaged over them; the teacher's logits are treated as constants."""
    valid = labels != IGNORE_INDEX
    if not bool(valid.any()) and not data_parallel():
        return clean_logits.sum() * 0.0
    log_t = torch.log_softmax(teacher_logits[valid].detach().float(), dim=-1)
    log_s = torch.log_softmax(clean_logits[valid].float(), dim=-1)
    return mean_over_positions((log_t.exp() * (log_t - log_s)).sum(-1))


def clean_loss_scale(mask_ce: torch.Tensor, clean_ce: torch.Tensor, balance: str, ce_scale: float) -> float:
    if balance == "fixed":
        return float(ce_scale)
    if balance == "auto":
        return float(mask_ce.detach() / (clean_ce.detach() + AUTO_BALANCE_EPS))
    raise ValueError(f"unknown loss balance '{balance}' (fixed | auto)")


def idlm_loss(logits: torch.Tensor, labels: torch.Tensor, balance: str, ce_scale: float = 0.2,
              train_clean: bool = True, distill_weight: float = 0.0,
              clean_labels: torch.Tensor | None = None, teacher_logits: torch.Tensor | None = None,
              anchor_weight: float = 0.0, distill_temperature: float = 1.0) -> IDLMLoss:
    """logits [B, 2L, V] of a packed [x_t | x_0] forward, labels [B, L] (MASK half) and
    `clean_labels` [B, L] (clean half; default: the same labels).

    `train_clean=False` (the gated-LoRA variant, whose clean half runs on frozen base weights)
    keeps the clean CE as a metric only. `teacher_logits` [B, L, V]: the frozen base's logits on
    the clean sequence, for the optional AR anchor (`anchor_weight` > 0)."""
    seq_len = labels.shape[1]
    clean_labels = labels if clean_labels is None else clean_labels
    # every process runs the same collectives in the same order (no data-dependent branch may
    # skip one under data parallelism): the ratio term is computed whenever balance is auto there
    mask_ce, mask_value, n_mask = _ce(logits[:, :seq_len], labels)
    if train_clean:
        clean_ce, clean_value, n_clean = _ce(logits[:, seq_len:], clean_labels)
    else:
        with torch.no_grad():
            clean_ce, clean_value, n_clean = _ce(logits[:, seq_len:].detach(), clean_labels)
    shared = (labels != IGNORE_INDEX) & (clean_labels != IGNORE_INDEX)
    if balance == "auto" and (data_parallel() or not bool(shared.eq(labels != IGNORE_INDEX).all())):
        with torch.no_grad():  # CE_mask*: the MASK CE over the targets both halves learn
            _, ratio_value, _ = _ce(logits[:, :seq_len].detach(), labels.masked_fill(~shared, IGNORE_INDEX))
        any_clean = float(all_reduce_sum(n_clean)) > 0 if data_parallel() else n_clean > 0
        scale = clean_loss_scale(ratio_value, clean_value, balance, ce_scale) if any_clean else 0.0
    else:
        scale = clean_loss_scale(mask_value, clean_value, balance, ce_scale)
    total = mask_ce + scale * clean_ce if train_clean else mask_ce
    distill = None
    if distill_weight > 0:
        distill = self_distill_ce(logits[:, :seq_len], logits[:, seq_len:], labels, distill_temperature)
        total = total + distill_weight * distill
        distill = distill.detach()
    anchor = None
    if anchor_weight > 0 and train_clean:
        if teacher_logits is None:
            raise ValueError("anchor_weight > 0 needs the teacher's logits")
        anchor = ar_anchor_kl(logits[:, seq_len:], teacher_logits, clean_labels)
        total = total + anchor_weight * anchor
        anchor = anchor.detach()
    return IDLMLoss(total, mask_value, clean_value, scale, n_mask, n_clean, distill, anchor)


# ------------------------------------------------------------------------------ distillation
def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """GKD's generalised Jensen-Shannon divergence (Agarwal et al. 2023), token-level mean over
    `mask`: with m = beta * p_T + (1 - beta) * p_S,
        JSD_beta = beta * KL(p_T || m) + (1 - beta) * KL(p_S || m),
    except at the limits, where it is the plain KL: beta = 0 -> KL(p_T || p_S) (forward),
    beta = 1 -> KL(p_S || p_T) (reverse). (At beta = 0 and 1 the mixture form vanishes; GKD, and
    TRL's trainer, read the endpoints as these two KLs.) Logits [..., V]; mask [...] bool, or
    float weights per position (a weighted mean)."""
    # Code-restricted logits are -inf outside the codes: clamped log-probabilities keep those
    # entries at exactly zero probability while every product (and its gradient) stays finite.
    log_s = torch.log_softmax(student_logits.float(), -1).clamp_min(-1e4)
    log_t = torch.log_softmax(teacher_logits.float(), -1).clamp_min(-1e4)

    def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:  # KL(p || q) per position
        return (log_p.exp() * (log_p - log_q)).sum(-1)

    if beta <= 0.0:
        per = kl(log_t, log_s)
    elif beta >= 1.0:
        per = kl(log_s, log_t)
    else:
        log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1 - beta)]), 0)
        per = beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)
    return mean_over_positions(per, mask)


def varkd_lite(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tokens: torch.Tensor,
               mask: torch.Tensor, confidence: float = 0.3, top_k: int = 16) -> tuple[torch.Tensor, float]:
    """A VarKD-style objective, as far as its public description goes ("Knowledge Distillation
    for Visual Autoregressive Models", 2026: no code or equations are public). On the student's
    own samples (`tokens`, the positions predicted at `mask`), teacher supervision is applied
    selectively and token ambiguity is reduced:
      1. selective: a position counts only where the teacher is confident about the student's
         token's context - its top-1 probability >= `confidence`, or the student's sampled token
         is in the teacher's top-k;
      2. reduced ambiguity: the teacher's distribution is truncated to its top-k codes and
         renormalised, so the student is not pulled toward the teacher's long tail;
      3. the loss is the forward KL(truncated p_T || p_S) at the selected positions.
    `tokens[..., i]` is the token that followed position i (the shifted labels). Returns the
    loss and the share of masked positions that were selected. `mask` may be float weights."""
    t_probs = torch.softmax(teacher_logits.float(), -1)
    top_vals, top_idx = t_probs.topk(top_k, dim=-1)
    in_top = (top_idx == tokens.unsqueeze(-1)).any(-1)
    supervised = mask.float() > 0
    selected = supervised & ((top_vals[..., 0] >= confidence) | in_top)
    weight = mask.float() * selected
    target = top_vals / top_vals.sum(-1, keepdim=True)  # over the teacher's top-k codes only
    log_s = torch.log_softmax(student_logits.float(), -1).gather(-1, top_idx)
    per = (target * (target.clamp_min(1e-12).log() - log_s)).sum(-1)
    share = global_value(selected.sum(), supervised.sum()) if data_parallel() else \
        float(selected.sum()) / max(1, int(supervised.sum()))
    return mean_over_positions(per, weight), share
