"""selfspec.kernels.dispatch: SELFSPEC_KERNELS=auto|triton|reference, and the decoding core's
public verify functions reaching the kernels through it."""

from __future__ import annotations

import sys

import torch


import pytest

from kernel_interpreter import _interpreter_env, skip_unless_kernels_run_here  # noqa: E402,F401

skip_unless_kernels_run_here()

from selfspec.decoding.requests import rng  # noqa: E402
from selfspec.decoding.modes import verify  # noqa: E402
from selfspec.kernels import dispatch, gated_lora  # noqa: E402
from selfspec.kernels import gated_lora_triton as glt  # noqa: E402
from selfspec.kernels import verify_triton as vt  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
CUDA = torch.cuda.is_available()


def test_unknown_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("SELFSPEC_KERNELS", "fast")
    with pytest.raises(ValueError):
        dispatch.resolve("greedy_verify", verify.greedy_verify_reference, torch.zeros(1))


@pytest.mark.parametrize("mode", [None, "auto", "reference"])
def test_cpu_tensors_get_the_reference(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv("SELFSPEC_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SELFSPEC_KERNELS", mode)
    for name, ref in [("greedy_verify", verify.greedy_verify_reference),
                      ("speculative_verify", verify.speculative_verify_reference),
                      ("greedy_verify_candidates", verify.greedy_verify_candidates_reference),
                      ("gated_lora_linear", gated_lora.gated_lora_linear_reference)]:
        assert dispatch.resolve(name, ref, torch.zeros(1)) is ref


def test_forced_triton_and_unregistered_names(monkeypatch):
    monkeypatch.setenv("SELFSPEC_KERNELS", "triton")
    sample = torch.zeros(1, device="cuda" if CUDA else "cpu")
    assert dispatch.resolve("greedy_verify", verify.greedy_verify_reference, sample) is vt.greedy_verify_triton
    assert dispatch.resolve("speculative_verify", None, sample) is vt.speculative_verify_triton
    assert dispatch.resolve("greedy_verify_candidates", None, sample) is vt.greedy_verify_candidates_triton
    assert dispatch.resolve("gated_lora_linear", None, sample) is glt.gated_lora_linear_triton

    def ref():
        return None

    assert dispatch.resolve("not_a_kernel", ref, sample) is ref


@pytest.mark.skipif(CUDA, reason="CPU-only behaviour")
def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("SELFSPEC_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(vt, "INTERPRETED", False)  # as if imported without the interpreter
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.resolve("greedy_verify", verify.greedy_verify_reference, torch.zeros(1))
    monkeypatch.delitem(sys.modules, "selfspec.kernels.verify_triton")  # not imported yet, variable unset
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.resolve("greedy_verify", verify.greedy_verify_reference, torch.zeros(1))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_auto_on_cuda_is_accelerated(monkeypatch):
    monkeypatch.setenv("SELFSPEC_KERNELS", "auto")
    sample = torch.zeros(1, device="cuda")
    assert dispatch.resolve("speculative_verify", None, sample) is vt.speculative_verify_triton
    assert dispatch.resolve("gated_lora_linear", None, sample) is glt.gated_lora_linear_auto


def test_engine_verify_ops_reach_the_kernels(monkeypatch):
    """The engines' verify ops (chosen once, `engines.kernel_choice.verify_ops`) go through the
    dispatch: forced to Triton they run the kernels (same results), forced to the reference they don't."""
    from selfspec.engines.kernel_choice import verify_ops

    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(5)
    bsz, depth, vocab = 4, 3, 97
    logits = torch.randn(bsz, depth + 1, vocab, generator=gen).to(device)
    drafts = logits[:, :depth].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % vocab
    nd = torch.tensor([3, 3, 2, 0], device=device)
    seeds = rng.draw_seeds((bsz, depth + 1), gen).to(device)

    calls = []
    for name in ("greedy_verify_triton", "speculative_verify_triton", "greedy_verify_candidates_triton"):
        original = getattr(vt, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(vt, name, spy)

    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("SELFSPEC_KERNELS", mode)
        ops = verify_ops(device)
        g = ops.greedy(logits, drafts, nd)
        s = ops.speculative(logits, drafts, nd, seeds, 0.9, 10, 0.9, 0.1)
        c = ops.greedy_candidates(logits.view(2, 2, depth + 1, vocab), drafts.view(2, 2, depth), nd.view(2, 2))
        results[mode] = [t.tolist() for t in (g.accept_len, g.next_tokens, s.accept_len, s.next_tokens,
                                              c.accept_len, c.next_tokens, c.best_candidate)]
        assert len(calls) == (0 if mode == "reference" else 3)
    assert results["triton"] == results["reference"]


def test_gated_lora_reaches_the_kernel(monkeypatch):
    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=gen).to(device)
    w, a, b = (torch.randn(*s, generator=gen).to(device) for s in [(24, 32), (8, 32), (24, 8)])
    mask = torch.tensor([1, 0, 0, 1, 1], device=device)
    called = []
    original = glt.gated_lora_linear_triton
    monkeypatch.setattr(glt, "gated_lora_linear_triton", lambda *a_, **k: called.append(1) or original(*a_, **k))
    monkeypatch.setenv("SELFSPEC_KERNELS", "triton")
    y = gated_lora.gated_lora_linear(x, w, None, a, b, 0.5, mask)
    assert called
    ref = gated_lora.gated_lora_linear_reference(x, w, None, a, b, 0.5, mask)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
