"""Segment-gated LoRA: the cuBLAS and Triton paths against gated_lora_linear_reference.

Gated-off tokens must be bit-identical to the base layer on every path (lossless RISD);
gated-on tokens are bit-identical on the cuBLAS path and within rounding on the Triton path
(which rounds once, in fp32, where the reference rounds each intermediate to x.dtype)."""

from __future__ import annotations


import torch


import pytest

from kernel_interpreter import _interpreter_env, skip_unless_kernels_run_here  # noqa: E402,F401

skip_unless_kernels_run_here()

from selfspec.kernels import gated_lora_triton as glt  # noqa: E402
from selfspec.kernels.gated_lora import gated_lora_linear_reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(gen, lead, k, n, r, dtype, bias=True):
    x = torch.randn(*lead, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    a = torch.randn(r, k, generator=gen) / k**0.5
    bb = torch.randn(n, r, generator=gen) / r**0.5
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(x), cast(w), cast(b), cast(a), cast(bb)


MASKS = {
    "mixed": lambda lead, gen: (torch.rand(*lead, generator=gen) < 0.5).long(),
    "none": lambda lead, gen: torch.zeros(lead, dtype=torch.long),
    "all": lambda lead, gen: torch.ones(lead, dtype=torch.bool),
    "segment": lambda lead, gen: (torch.arange(lead[-1]) >= lead[-1] // 2).expand(lead).float(),
}


@pytest.mark.parametrize("mask_kind", list(MASKS))
@pytest.mark.parametrize("lead,k,n,r,dtype", [
    ((1,), 64, 48, 8, torch.float32),
    ((7,), 200, 130, 16, torch.bfloat16),
    ((2, 9), 96, 64, 4, torch.float32),
    ((40,), 256, 320, 64, torch.bfloat16),
    ((3, 5), 128, 96, 128, torch.float32),
])
def test_paths_match_reference(lead, k, n, r, dtype, mask_kind, monkeypatch):
    monkeypatch.setattr(glt, "POISON_SCRATCH", True)
    gen = torch.Generator().manual_seed(k + n + r)
    x, w, b, a, bb = make(gen, lead, k, n, r, dtype, bias=(r % 8 == 0))
    mask = MASKS[mask_kind](lead, gen).to(DEVICE)
    ref = gated_lora_linear_reference(x, w, b, a, bb, 1.7, mask)
    base = torch.nn.functional.linear(x, w, b)
    off = ~mask.bool()

    cub = glt.gated_lora_linear_cublas(x, w, b, a, bb, 1.7, mask)
    assert torch.equal(cub, ref)

    tri = glt.gated_lora_linear_triton(x, w, b, a, bb, 1.7, mask)
    assert tri.shape == ref.shape and tri.dtype == ref.dtype
    assert torch.equal(tri[off], base[off])  # gated off: exactly the base layer
    if dtype == torch.float32:
        torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    else:  # compare both against an fp64 evaluation: the kernel is no worse than the reference
        exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        exact = exact + mask.double().unsqueeze(-1) * 1.7 * ((x.double() @ a.double().T).to(dtype).double() @ bb.double().T)
        err_tri = (tri.double() - exact).abs().max().item()
        err_ref = (ref.double() - exact).abs().max().item()
        assert err_tri <= 2 * err_ref + 1e-2, (err_tri, err_ref)


def test_auto_path_selection(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x, w, b, a, bb = make(gen, (4,), 32, 24, 8, torch.float32)
    mask = torch.tensor([0, 1, 1, 0], device=DEVICE)
    ref = gated_lora_linear_reference(x, w, b, a, bb, 2.0, mask)
    seen = []
    monkeypatch.setattr(glt, "gated_lora_linear_triton", lambda *args, **kw: seen.append("triton") or ref)
    original = glt.gated_lora_linear_cublas
    monkeypatch.setattr(glt, "gated_lora_linear_cublas", lambda *args, **kw: seen.append("cublas") or original(*args))

    monkeypatch.setenv(glt.PATH_ENV, "auto")
    monkeypatch.setattr(glt, "TRITON_MAX_TOKENS", 0)
    glt.gated_lora_linear_auto(x, w, b, a, bb, 2.0, mask)
    monkeypatch.setattr(glt, "TRITON_MAX_TOKENS", 8)
    glt.gated_lora_linear_auto(x, w, b, a, bb, 2.0, mask)
    monkeypatch.setenv(glt.PATH_ENV, "cublas")
    glt.gated_lora_linear_auto(x, w, b, a, bb, 2.0, mask)
    monkeypatch.setenv(glt.PATH_ENV, "triton")
    glt.gated_lora_linear_auto(x, w, b, a, bb, 2.0, mask)
    xg = x.clone().requires_grad_(True)  # training: always the differentiable cuBLAS path
    glt.gated_lora_linear_auto(xg, w, b, a, bb, 2.0, mask).sum().backward()
    assert seen == ["cublas", "triton", "cublas", "triton", "cublas"]
    assert xg.grad is not None
    monkeypatch.setenv(glt.PATH_ENV, "bogus")
    with pytest.raises(ValueError):
        glt.gated_lora_linear_auto(x, w, b, a, bb, 2.0, mask)
