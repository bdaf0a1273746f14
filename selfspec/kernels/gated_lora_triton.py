"""Segment-gated LoRA, y = x W^T + b + m * scaling * ((x A^T) B^T), as drop-in accelerations of
`selfspec.kernels.gated_lora.gated_lora_linear_reference` (same signature).

Two accelerated paths; both compute the base projection with `torch.nn.functional.linear`
(cuBLAS on CUDA), exactly as the reference and the base model do, so every gated-off token
(m = 0: RISD's verify positions) is bit-identical to the base layer -- the property lossless
RISD rests on. Neither synchronises with the host (the reference's `bool(gate.any())` does,
which also rules it out inside a CUDA graph).

* ``gated_lora_linear_cublas``: shrink and expand as two cuBLAS GEMMs over all tokens, then a
  masked select. Bit-identical to the reference on every token. Differentiable.
* ``gated_lora_linear_triton``: base by cuBLAS; then ``_lora_shrink`` (t = x A^T, fp32
  accumulation, rounded to x.dtype like the reference's intermediate) and ``_lora_expand``
  (t B^T accumulated in fp32, scaled, added to the base tile and rounded once, written in place
  only on rows with m = 1; token tiles with no gated token skip all work). Gated-on rows may
  differ from the reference in the last bit (fewer roundings); gated-off rows are exact.
  Inference only (no autograd).

``gated_lora_linear_auto`` (what the dispatch uses on CUDA) takes the Triton path only up to
``TRITON_MAX_TOKENS`` tokens and cuBLAS above; ``SELFSPEC_LORA_PATH=cublas|triton`` overrides.
The default below is the cuBLAS path at every token count, I-DLM's reported choice at small
token counts; the crossover is not measured on this code yet. `python bench/gpu_kernels.py`
prints both paths per token count and the value of TRITON_MAX_TOKENS that the measurement
supports.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton import knobs

from selfspec.kernels.gated_lora import select_gated_lora

INTERPRETED = bool(knobs.runtime.interpret)
POISON_SCRATCH = False  # tests: fill the intermediate with NaN before every launch
PATH_ENV = "SELFSPEC_LORA_PATH"
TRITON_MAX_TOKENS = 0  # auto: Triton for token counts <= this, cuBLAS above (0: always cuBLAS)


@triton.jit
def _lora_shrink(
    x, s_xm, w, s_wr, t, s_tm, mask, M, K, R,
    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rr = pid_r * BR + tl.arange(0, BR)
    gate = tl.load(mask + rm, mask=rm < M, other=0)
    if tl.max(gate, axis=0) != 0:
        acc = tl.zeros((BM, BR), tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(x + rm[:, None].to(tl.int64) * s_xm + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            bt = tl.load(w + rr[None, :].to(tl.int64) * s_wr + rk[:, None],
                         mask=(rr[None, :] < R) & (rk[:, None] < K), other=0.0)
            if UPCAST:  # the interpreter's tl.dot mis-reads bf16 operands
                a = a.to(tl.float32)
                bt = bt.to(tl.float32)
            acc = tl.dot(a, bt, acc, input_precision=PRECISION)
        tl.store(t + rm[:, None] * s_tm + rr[None, :], acc.to(t.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rr[None, :] < R))


@triton.jit
def _lora_expand(
    t, s_tm, w, s_wn, y, s_ym, mask, M, N, R, scaling,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    gate = tl.load(mask + rm, mask=rm < M, other=0)
    if tl.max(gate, axis=0) != 0:
        acc = tl.zeros((BM, BN), tl.float32)
        for r0 in range(0, R, BR):
            rr = r0 + tl.arange(0, BR)
            a = tl.load(t + rm[:, None] * s_tm + rr[None, :], mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)
            bt = tl.load(w + rn[None, :].to(tl.int64) * s_wn + rr[:, None],
                         mask=(rn[None, :] < N) & (rr[:, None] < R), other=0.0)
            if UPCAST:  # the interpreter's tl.dot mis-reads bf16 operands
                a = a.to(tl.float32)
                bt = bt.to(tl.float32)
            acc = tl.dot(a, bt, acc, input_precision=PRECISION)
        ptr = y + rm[:, None].to(tl.int64) * s_ym + rn[None, :]
        on = (gate[:, None] != 0) & (rm[:, None] < M) & (rn[None, :] < N)
        base = tl.load(ptr, mask=on, other=0.0).to(tl.float32)
        tl.store(ptr, (base + acc * scaling).to(y.dtype.element_ty), mask=on)


def _gate(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # exactly the reference's gate: mask.to(x.dtype) then bool
    return mask.to(x.dtype).unsqueeze(-1).bool()


def gated_lora_linear_cublas(x, weight, bias, lora_a, lora_b, scaling, mask) -> torch.Tensor:
    """Sync-free cuBLAS path; bit-identical to the reference on every token."""
    return select_gated_lora(F.linear(x, weight, bias), x, lora_a, lora_b, scaling, mask)


def _tile(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def gated_lora_linear_triton(
    x, weight, bias, lora_a, lora_b, scaling, mask, *, block_m: int | None = None, num_warps: int = 4
) -> torch.Tensor:
    """cuBLAS base + Triton shrink/expand with the gated add fused into the expand's epilogue."""
    in_features = x.shape[-1]
    out_features, rank = lora_b.shape
    base = F.linear(x, weight, bias)
    lead = x.shape[:-1]
    tokens = x.numel() // max(in_features, 1)
    if tokens == 0 or rank == 0:
        return base
    x2 = x.reshape(tokens, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = base.reshape(tokens, out_features)
    if not y.is_contiguous():
        y = y.contiguous()
    gate = _gate(x, mask).reshape(tokens).to(torch.int32)
    a = lora_a if lora_a.stride(-1) == 1 else lora_a.contiguous()
    bmat = lora_b if lora_b.stride(-1) == 1 else lora_b.contiguous()
    t = torch.empty((tokens, rank), dtype=x.dtype, device=x.device)
    if POISON_SCRATCH:
        t.fill_(float("nan"))
    bm = block_m or _tile(tokens, 16, 64)
    br = _tile(rank, 16, 64)
    bk = _tile(in_features, 16, 128 if not INTERPRETED else 256)
    bn = _tile(out_features, 16, 128 if not INTERPRETED else 256)
    # fp32 inputs: IEEE products like cuBLAS fp32 (torch's default has TF32 off)
    precision = "ieee" if (x.dtype == torch.float32 or INTERPRETED) else "tf32"
    _lora_shrink[(triton.cdiv(tokens, bm), triton.cdiv(rank, br))](
        x2, x2.stride(0), a, a.stride(0), t, t.stride(0), gate, tokens, in_features, rank,
        BM=bm, BK=bk, BR=br, PRECISION=precision, UPCAST=INTERPRETED, num_warps=num_warps,
    )
    _lora_expand[(triton.cdiv(tokens, bm), triton.cdiv(out_features, bn))](
        t, t.stride(0), bmat, bmat.stride(0), y, y.stride(0), gate, tokens, out_features, rank, float(scaling),
        BM=bm, BN=bn, BR=br, PRECISION=precision, UPCAST=INTERPRETED, num_warps=num_warps,
    )
    return y.view(*lead, out_features)


def lora_path(tokens: int) -> str:
    forced = os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"
    if forced not in ("auto", "cublas", "triton"):
        raise ValueError(f"{PATH_ENV}={forced!r}: expected auto, cublas or triton")
    if forced != "auto":
        return forced
    return "triton" if tokens <= TRITON_MAX_TOKENS else "cublas"


def gated_lora_linear_auto(x, weight, bias, lora_a, lora_b, scaling, mask) -> torch.Tensor:
    """The path the dispatch takes on CUDA: the measured-faster one (see module docstring)."""
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, weight, bias, lora_a, lora_b)
    )
    tokens = x.numel() // max(x.shape[-1], 1)
    if needs_grad or lora_path(tokens) == "cublas":
        return gated_lora_linear_cublas(x, weight, bias, lora_a, lora_b, scaling, mask)
    return gated_lora_linear_triton(x, weight, bias, lora_a, lora_b, scaling, mask)
