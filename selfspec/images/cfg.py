"""Classifier-free guidance and code-only vocabularies for image-token models.

A guided step runs each image twice, conditional (class token) and unconditional (null class)
rows sharing one rollout state; every rule downstream (greedy argmax, p/q acceptance,
sampling) sees only the fused logits u + s * (c - u). Scale 1 is the conditional model alone
(the unconditional rows are then not run at all).
"""

from __future__ import annotations

import torch


def guided_logits(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    if uncond is None or scale == 1.0:
        return cond
    return uncond + scale * (cond - uncond)


def restrict_to_codes(logits: torch.Tensor, num_codes: int) -> torch.Tensor:
    """Logits with every id >= num_codes (class and null tokens, padding) at -inf: an image
    sequence samples, drafts and verifies codes only."""
    out = logits.clone()
    out[..., num_codes:] = float("-inf")
    return out


def split_guided(logits: torch.Tensor, guided: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[2B, ...] logits of (conditional rows; unconditional rows) -> (cond, uncond), or the
    [B, ...] logits and None when the step ran without guidance."""
    if not guided:
        return logits, None
    half = logits.shape[0] // 2
    return logits[:half], logits[half:]
