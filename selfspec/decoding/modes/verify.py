"""Verify rules: the one definition of acceptance that every engine and kernel follows.

Layout shared by all rules, batched over sequences b and draft positions i:
  target_logits [B, D+1, V]  row i (< D) is the causal anchor that judges draft i;
                             row `accept_len` gives the correction or the bonus token
  draft_tokens  [B, D]       the drafts, left to right
  num_drafts    [B]          how many drafts of the row are real (the rest is padding)
Per-row randomness comes from `seeds [B, D+1]` through `selfspec.decoding.requests.rng`: the accept
uniform of position i is uniform(seed[b, i], 0); Gumbel noise for vocab entry v at that
position is gumbel(seed[b, i], v + 1) (drawn here in its exponential-race form,
`rng.race_argmax`). Identical seeds give identical results in every implementation (the Triton
kernels are tested bit-exact against these references; the two forms of the draw could part
only at an exact float tie).

The `*_reference` functions are the definitions. Modes call whatever `VerifyOps` the engine
put in the step context; kernels of the same functions live in `selfspec.kernels`, which this
package never imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfspec.decoding.requests import rng
from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.requests.sampling import logits_to_probs


@dataclass
class VerifyResult:
    accept_len: torch.Tensor  # [B] long: drafts accepted, a prefix of each row
    next_tokens: torch.Tensor  # [B] long: the resampled token at the first rejection, or the bonus


@dataclass
class CandidateVerifyResult(VerifyResult):
    best_candidate: torch.Tensor  # [B] long: index of the winning branch (first on ties)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, D] bool -> [B] length of the all-True prefix of each row."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def _valid_drafts(num_drafts: torch.Tensor, depth: int) -> torch.Tensor:
    return torch.arange(depth, device=num_drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)


def greedy_verify_reference(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor
) -> VerifyResult:
    depth = draft_tokens.shape[1]
    argmax = first_argmax(target_logits)  # [B, D+1]
    matches = (argmax[:, :depth] == draft_tokens) & _valid_drafts(num_drafts, depth)
    accept_len = _leading_true(matches)
    next_tokens = argmax.gather(1, accept_len.unsqueeze(1)).squeeze(1)
    return VerifyResult(accept_len, next_tokens)


def speculative_verify_reference(
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
) -> VerifyResult:
    """p/q speculative acceptance with relaxed threshold and residual resampling.

    Draft i is accepted with probability min(1, (1 + tau) p(x_i) / q(x_i)); at the first
    rejection a token is drawn from normalize(max(0, p - q)) and the row stops; if every real
    draft passes, a bonus token is drawn from p at the last anchor. p is the AR sampling
    distribution (`logits_to_probs`); q is `draft_probs` [B, D, V] or, when None, one-hot at
    the drafts (argmax proposals). tau = 0 reproduces AR sampling's distribution exactly.
    """
    bsz, depth = draft_tokens.shape
    probs = logits_to_probs(target_logits, temperature, top_k, top_p, min_p)  # [B, D+1, V]
    p_draft = probs[:, :depth].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, D]
    # accept draft i iff u * q(x_i) < (1 + tau) * p(x_i), u = uniform(seed[b, i], 0); the rule's
    # float32 ops, skipping only the exact no-ops: u * 1 for one-hot q, 1 * p for tau = 0
    u = rng.uniform_at(seeds[:, :depth], 0)
    if draft_probs is not None:
        u = u * draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).float()
    if isinstance(tau, torch.Tensor) or tau != 0:
        tau_b = torch.as_tensor(tau, dtype=torch.float32, device=probs.device).expand(bsz)
        p_draft = (1.0 + tau_b).unsqueeze(1) * p_draft
    accepted = (u < p_draft) & _valid_drafts(num_drafts, depth)
    accept_len = _leading_true(accepted)

    rows = torch.arange(bsz, device=probs.device)
    target = probs[rows, accept_len]  # [B, V]: p at the stop row (a copy)
    rejected = accept_len < num_drafts
    if depth and bool(rejected.any()):  # q at the stop row only matters where a draft was rejected
        stop = accept_len.clamp(max=depth - 1)
        if draft_probs is None:  # q one-hot at the stop row's draft x: p - q is p but at x
            x = draft_tokens.gather(1, stop.unsqueeze(1))
            residual = target.scatter(1, x, target.gather(1, x) - 1.0)
        else:
            residual = target - draft_probs[rows, stop].float()
        residual.clamp_min_(0.0)  # max(0, p - q)
        # A residual can vanish only through rounding when p == q; then p itself is the target.
        use_residual = rejected & (residual.sum(-1) > 0)
        target = torch.where(use_residual.unsqueeze(1), residual, target)

    next_tokens = rng.race_argmax(target, seeds.gather(1, accept_len.unsqueeze(1)))
    return VerifyResult(accept_len, next_tokens)


def greedy_verify_candidates_reference(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor
) -> CandidateVerifyResult:
    """Several candidate branches per sequence: [B, C, D+1, V], [B, C, D], [B, C].

    Each branch is verified greedily; the branch with the longest accepted prefix wins
    (the first such branch on ties).
    """
    bsz, cands, depth = draft_tokens.shape
    flat = greedy_verify_reference(
        target_logits.reshape(bsz * cands, depth + 1, -1),
        draft_tokens.reshape(bsz * cands, depth),
        num_drafts.reshape(bsz * cands),
    )
    lens = flat.accept_len.view(bsz, cands)
    best = lens.argmax(dim=1)  # torch returns the first maximal index
    rows = torch.arange(bsz, device=lens.device)
    return CandidateVerifyResult(lens[rows, best], flat.next_tokens.view(bsz, cands)[rows, best], best)


@dataclass(frozen=True)
class VerifyOps:
    """The implementations a step verifies with: these references, or kernels computing the same
    results (chosen once by the engine, `selfspec.engines.kernel_choice`)."""

    greedy: Callable[..., VerifyResult] = greedy_verify_reference
    speculative: Callable[..., VerifyResult] = speculative_verify_reference
    greedy_candidates: Callable[..., CandidateVerifyResult] = greedy_verify_candidates_reference


REFERENCE_OPS = VerifyOps()
