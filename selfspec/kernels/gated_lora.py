"""Per-token gated LoRA: y = x W^T + b + m * scaling * ((x A^T) B^T).

m is 1 at the tokens that take the adapter ([MASK] positions in RISD) and 0 elsewhere, so
the other tokens get exactly the base layer's output.
"""

from __future__ import annotations

import torch


def gated_lora_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    mask: torch.Tensor,
) -> torch.Tensor:
    """x [..., in], weight [out, in], lora_a [r, in], lora_b [out, r], mask [...] (0/1)."""
    base = torch.nn.functional.linear(x, weight, bias)
    gate = mask.to(x.dtype).unsqueeze(-1)
    if not bool(gate.any()):
        return base
    delta = torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a), lora_b) * scaling
    # torch.where (not base + gate * delta) keeps gated-off rows bit-identical to the base.
    return torch.where(gate.bool(), base + delta, base)


def gated_lora_linear(x, weight, bias, lora_a, lora_b, scaling, mask) -> torch.Tensor:
    from selfspec.kernels.dispatch import resolve

    return resolve("gated_lora_linear", gated_lora_linear_reference, x)(x, weight, bias, lora_a, lora_b, scaling, mask)
