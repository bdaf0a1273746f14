"""The forward pass of packed Jacobi Forcing rows (`selfspec.training.jacobi_forcing.masks`), with the LM head
applied only where something is read: the noisy blocks and the clean chain (the last prompt
token and the clean blocks). On tiny models the head (vocabulary x width) is a large share of a
forward, and prompt positions other than the last are read by nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.training.jacobi_forcing import masks
from selfspec.training.jacobi_forcing.data import JFBatch

_MASKS: dict = {}


def _mask(batch: JFBatch, device, impl: str):
    key = (batch.layout, tuple(batch.prompt_lens.tolist()), str(device), impl)
    if key not in _MASKS:
        if len(_MASKS) > 8:
            _MASKS.clear()
        _MASKS[key] = masks.attention_mask_for(batch.layout, batch.prompt_lens, device, impl)
    return _MASKS[key]


@dataclass
class JFLogits:
    noisy: torch.Tensor  # [B, T, n, V]: offset t of noisy block j predicts offset t+1
    chain: torch.Tensor | None  # [B, 1 + T*n, V]: the last prompt token, then the clean blocks


def forward(model, batch: JFBatch, attn_implementation: str, chain: bool = True) -> JFLogits:
    # One call of the model itself (the head at the read positions through `logits_to_keep`): a
    # DDP / FSDP wrapper only synchronises gradients of forwards that go through it.
    device = next(model.parameters()).device
    layout = batch.layout
    bsz, T, n = batch.noisy.shape
    keep = layout.noisy_indices(device).flatten()
    if chain:
        keep = torch.cat([keep, torch.tensor([layout.prompt_len - 1], device=device),
                          layout.clean_indices(device).flatten()])
    logits = model(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                   attention_mask=_mask(batch, device, attn_implementation), use_cache=False,
                   logits_to_keep=keep).logits
    noisy = logits[:, : T * n].view(bsz, T, n, -1)
    return JFLogits(noisy, logits[:, T * n:] if chain else None)


def jacobi_update(noisy_logits: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """One greedy Jacobi iteration of every block: offset 0 (a correct token) stays, offset t+1
    takes the argmax at offset t. [B, T, n] -> [B, T, n]."""
    out = noisy.clone()
    out[..., 1:] = noisy_logits[..., :-1, :].argmax(-1).to(out.device)
    return out
