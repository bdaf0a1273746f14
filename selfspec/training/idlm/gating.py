"""Per-token gated LoRA over a PEFT model, for training the RISD adapter.

Inference loads an exported adapter with `selfspec.engines.lora.attach_gated_adapter`, which
swaps each target nn.Linear for a `GatedLoRALinear` driven by the model's `LoRAGate`
(`selfspec.kernels.lora_gate`). Training needs PEFT's trainable modules (and PEFT's adapter
format for export), so this module routes every PEFT LoRA `Linear` through the same op,
`selfspec.kernels.gated_lora.gated_lora_linear`, driven by the same kind of gate:

    gate = gate_lora_layers(peft_model)
    with gate.active(mask_positions):      # [B, T] bool, True where the adapter is active
        logits = peft_model(...).logits

Outside `gate.active(...)` (or with an all-False mask) the adapter is off everywhere, as in the
engine. Gated-off tokens get exactly the base layer's output (the op uses `torch.where`), so the
clean half of a training row runs on the frozen base weights, as RISD's verify positions do.
"""

from __future__ import annotations

import torch

from selfspec.kernels.dispatch import resolve_once
from selfspec.kernels.gated_lora import gated_lora_linear_reference
from selfspec.kernels.lora_gate import LoRAGate, model_gate, set_model_gate


def _gated_forward(layer, gate: LoRAGate):
    impl = resolve_once("gated_lora_linear", gated_lora_linear_reference)

    def forward(x: torch.Tensor, *args, **kwargs):
        mask = gate.mask
        if mask is None or layer.disable_adapters or layer.merged or not layer.active_adapters:
            return layer.base_layer(x, *args, **kwargs)
        name = layer.active_adapters[0]
        if name not in layer.lora_A:
            return layer.base_layer(x, *args, **kwargs)
        base = layer.base_layer
        dtype = base.weight.dtype
        return impl(x.to(dtype), base.weight, base.bias, layer.lora_A[name].weight.to(dtype),
                    layer.lora_B[name].weight.to(dtype), layer.scaling[name], mask.to(x.device))

    return forward


def gate_lora_layers(model, gate: LoRAGate | None = None) -> LoRAGate:
    """Patch every PEFT LoRA Linear of `model` in place; returns the gate that drives them
    (also kept as `model.selfspec_lora_gate`)."""
    from peft.tuners.lora import Linear as LoraLinear

    gate = gate or LoRAGate()
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear):
            if any(not isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values()):
                raise ValueError("gated LoRA training needs lora_dropout = 0")
            module.forward = _gated_forward(module, gate)
            count += 1
    if count == 0:
        raise ValueError("no PEFT LoRA Linear layers found to gate")
    return set_model_gate(model, gate)


def lora_gate(model, mask: torch.Tensor):
    """Context manager: the gated LoRA layers of `model` use `mask` for the forwards inside."""
    return model_gate(model).active(mask)
