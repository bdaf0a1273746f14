"""The one gate mechanism of the per-token gated LoRA (RISD), shared by every place that runs it:
the HF engine's wrapped layers (`engines/lora.py`), PEFT layers in training
(`training/idlm/gating.py`) and SGLang's hooked linear methods (`sglang_ext/lora.py`).

A model with a gated adapter carries one `LoRAGate` as `model.selfspec_lora_gate`; its layers
read `gate.mask` on every forward: None means the adapter is off everywhere (prefill, verify-only
forwards), otherwise a bool tensor over the forward's tokens ([B, T], or flat [T] inside SGLang)
that is True where the adapter applies ([MASK] positions).

    with gate.active(mask):   # adapter on at mask
        model(...)
    with gate.off():          # base model only
        model(...)

CUDA graphs: a gate given a persistent `buffer` copies each mask into it, so a captured graph
that reads the buffer sees the mask written before each replay (`capture(n)` points the gate at
the buffer while a graph of n tokens is recorded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

MODEL_ATTR = "selfspec_lora_gate"


class LoRAGate:
    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None  # persistent flat bool buffer (CUDA graphs)

    @contextmanager
    def active(self, mask: torch.Tensor | None) -> Iterator[None]:
        prev = self.mask
        if mask is not None and self.buffer is not None:
            flat = mask.reshape(-1).to(torch.bool)
            if flat.numel() > self.buffer.numel():
                raise RuntimeError(f"LoRA gate buffer holds {self.buffer.numel()} tokens, the forward has {flat.numel()}")
            self.buffer.zero_()
            self.buffer[: flat.numel()].copy_(flat, non_blocking=True)
            mask = self.buffer[: flat.numel()]
        self.mask = mask
        try:
            yield
        finally:
            self.mask = prev

    @contextmanager
    def off(self) -> Iterator[None]:
        prev, self.mask = self.mask, None
        try:
            yield
        finally:
            self.mask = prev

    @contextmanager
    def capture(self, num_tokens: int) -> Iterator[None]:
        """While a CUDA graph of `num_tokens` tokens is captured, layers read the buffer."""
        if self.buffer is None:
            yield
            return
        if num_tokens > self.buffer.numel():
            raise RuntimeError(f"LoRA gate buffer holds {self.buffer.numel()} tokens, the graph captures {num_tokens}")
        prev, self.mask = self.mask, self.buffer[:num_tokens]
        try:
            yield
        finally:
            self.mask = prev


def gated(gate: LoRAGate | None, mask: torch.Tensor | None):
    """`gate.active(mask)`, or a no-op for a model without a gated adapter."""
    return gate.active(mask) if gate is not None else nullcontext()


def set_model_gate(model: torch.nn.Module, gate: LoRAGate) -> LoRAGate:
    setattr(model, MODEL_ATTR, gate)
    return gate


def model_gate(model: torch.nn.Module) -> LoRAGate | None:
    """The gate of `model` (through DDP / FSDP `.module` wrappers), or None."""
    while not hasattr(model, MODEL_ATTR) and hasattr(model, "module"):
        model = model.module
    return getattr(model, MODEL_ATTR, None)
