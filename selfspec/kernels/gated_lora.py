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


def add_gated_lora(base: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                   mask: torch.Tensor) -> torch.Tensor:
    """`base` (x W^T + b, already computed by the caller's own linear method) + the gated LoRA
    delta: what SGLang's hooked linear layers need, whose base projection SGLang has already run
    (recomputing it inside `gated_lora_linear` doubled the layer's cost). Gated-off rows are
    `base` bit for bit. x [T, in], base [T, out], mask [T].

    CUDA: shape-static (delta over all rows, then a select), so it can live in a CUDA graph.
    Elsewhere the forward runs eagerly, and the delta is computed on the gated rows only (RISD
    gates the N-1 MASK rows of a 2N-1-token step)."""
    gate = mask.to(device=x.device, dtype=torch.bool)
    if x.is_cuda:
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a), lora_b) * scaling
        return torch.where(gate.unsqueeze(-1), base + delta.to(base.dtype), base)
    rows = gate.nonzero().squeeze(1)
    if rows.numel() == 0:
        return base
    xs = x.index_select(0, rows)
    delta = torch.nn.functional.linear(torch.nn.functional.linear(xs, lora_a), lora_b) * scaling
    return base.index_copy(0, rows, base.index_select(0, rows) + delta.to(base.dtype))


def gated_lora_linear(x, weight, bias, lora_a, lora_b, scaling, mask) -> torch.Tensor:
    from selfspec.kernels.dispatch import resolve

    return resolve("gated_lora_linear", gated_lora_linear_reference, x)(x, weight, bias, lora_a, lora_b, scaling, mask)
