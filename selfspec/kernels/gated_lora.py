"""Per-token gated LoRA: y = x W^T + b + m * scaling * ((x A^T) B^T).

m is 1 at the tokens that take the adapter ([MASK] positions in RISD) and 0 elsewhere, so
the other tokens get exactly the base layer's output.
"""

from __future__ import annotations

import torch


def lora_delta(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling * (x A^T) B^T, on every row of x."""
    return torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a), lora_b) * scaling


def select_gated_lora(base: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      scaling: float, mask: torch.Tensor) -> torch.Tensor:
    """base + the delta where mask is set, base elsewhere: shape-static and free of host syncs
    (usable inside a CUDA graph). torch.where (not base + gate * delta) keeps gated-off rows
    bit-identical to the base."""
    gate = mask.to(device=x.device, dtype=x.dtype).unsqueeze(-1).bool()
    return torch.where(gate, base + lora_delta(x, lora_a, lora_b, scaling).to(base.dtype), base)


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
    if not bool(mask.to(x.dtype).any()):
        return base
    return select_gated_lora(base, x, lora_a, lora_b, scaling, mask)


def add_gated_lora(base: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                   mask: torch.Tensor) -> torch.Tensor:
    """`base` (x W^T + b, already computed by the caller's own linear method) + the gated LoRA
    delta: what SGLang's hooked linear layers need, whose base projection SGLang has already run
    (recomputing it inside `gated_lora_linear` doubled the layer's cost). Gated-off rows are
    `base` bit for bit. x [T, in], base [T, out], mask [T].

    CUDA: shape-static (`select_gated_lora`), so it can live in a CUDA graph. Elsewhere the
    forward runs eagerly, and the delta is computed on the gated rows only (RISD gates the N-1
    MASK rows of a 2N-1-token step)."""
    if x.is_cuda:
        return select_gated_lora(base, x, lora_a, lora_b, scaling, mask)
    rows = mask.to(device=x.device, dtype=torch.bool).nonzero().squeeze(1)
    if rows.numel() == 0:
        return base
    delta = lora_delta(x.index_select(0, rows), lora_a, lora_b, scaling)
    return base.index_copy(0, rows, base.index_select(0, rows) + delta.to(base.dtype))


def gated_lora_linear(x, weight, bias, lora_a, lora_b, scaling, mask) -> torch.Tensor:
    from selfspec.kernels.dispatch import resolve

    return resolve("gated_lora_linear", gated_lora_linear_reference, x)(x, weight, bias, lora_a, lora_b, scaling, mask)
