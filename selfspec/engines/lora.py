"""Per-token gated LoRA for RISD on any Hugging Face Qwen3 / Qwen2 / Llama model.

`attach_gated_adapter(model, adapter_dir)` reads a PEFT LoRA adapter (adapter_config.json +
adapter_model.safetensors) and swaps each targeted nn.Linear for a `GatedLoRALinear`:

    h = W x + b + m · scaling · B A x        (selfspec.kernels.gated_lora.gated_lora_linear)

with m the per-token gate the engine sets before each forward (`selfspec.kernels.lora_gate`:
the model's one `LoRAGate`, mask [B, T] bool, True at [MASK] positions). Tokens with m = 0 get exactly the base layer's output (bit for bit),
so verify positions and their KV are the base model's. PEFT `modules_to_save` (a full copy of
a module, e.g. lm_head or embed_tokens) and `trainable_token_indices` (replaced embedding rows)
are gated the same way: used at gated tokens only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from selfspec.kernels.dispatch import resolve_once
from selfspec.kernels.gated_lora import gated_lora_linear_reference
from selfspec.kernels.lora_gate import LoRAGate, set_model_gate


class GatedLoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, gate: LoRAGate):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(lora_a.to(base.weight.dtype), requires_grad=False)
        self.lora_b = nn.Parameter(lora_b.to(base.weight.dtype), requires_grad=False)
        self.scaling = float(scaling)
        self.gate = gate
        self.impl = resolve_once("gated_lora_linear", gated_lora_linear_reference)

    @property
    def weight(self) -> torch.Tensor:  # some HF code reads .weight of projections
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.gate.mask
        if mask is None:
            return self.base(x)
        return self.impl(x, self.base.weight, self.base.bias, self.lora_a, self.lora_b, self.scaling, mask)


class GatedReplacement(nn.Module):
    """A PEFT `modules_to_save` copy, used at gated tokens only."""

    def __init__(self, base: nn.Module, replacement: nn.Module, gate: LoRAGate):
        super().__init__()
        self.base = base
        self.replacement = replacement
        self.gate = gate

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        mask = self.gate.mask
        if mask is None:
            return out
        return torch.where(mask.unsqueeze(-1), self.replacement(x), out)


class GatedTokenRows(nn.Module):
    """PEFT `trainable_token_indices`: replaced embedding rows, used at gated tokens only."""

    def __init__(self, base: nn.Embedding, indices: list[int], rows: torch.Tensor, gate: LoRAGate):
        super().__init__()
        self.base = base
        weight = base.weight.detach().clone()
        weight[torch.tensor(indices)] = rows.to(weight.dtype)
        self.adapted = nn.Parameter(weight, requires_grad=False)
        self.gate = gate

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.base(ids)
        mask = self.gate.mask
        if mask is None:
            return out
        return torch.where(mask.unsqueeze(-1), nn.functional.embedding(ids, self.adapted), out)


_UNSUPPORTED = ("lora_magnitude_vector", "lora_embedding_A", "lora_embedding_B")


def _pattern_value(name: str, pattern: dict, default):
    for key, value in pattern.items():
        if name == key or re.fullmatch(rf"(.*\.)?{key}", name):
            return value
    return default


def load_adapter_state(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no adapter_config.json: not a PEFT adapter directory")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config.get('peft_type')} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: DoRA adapters are not supported by the gated LoRA wrapper")
    weights = adapter_dir / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    elif (adapter_dir / "adapter_model.bin").is_file():
        state = torch.load(adapter_dir / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{adapter_dir} has no adapter_model.safetensors")
    return config, state


def _strip(key: str) -> str:
    for prefix in ("base_model.model.",):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key


@dataclass
class ParsedAdapter:
    """A PEFT LoRA adapter sorted by what it changes (keys without the `base_model.model.` prefix)."""

    config: dict
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # linear module -> (A, B, scaling)
    token_rows: dict[str, torch.Tensor]  # embedding module -> trainable_tokens delta rows
    saved: dict[str, dict[str, torch.Tensor]]  # modules_to_save module -> {"weight": ..., "bias": ...}


def parse_adapter(adapter_dir: str | Path) -> ParsedAdapter:
    """Read a PEFT LoRA adapter directory; the one parser the HF engine and the SGLang plugin share.
    Raises ValueError naming the tensor it cannot place."""
    config, state = load_adapter_state(adapter_dir)
    bad = [k for k in state if any(u in k for u in _UNSUPPORTED)]
    if bad:
        raise ValueError(f"{adapter_dir}: unsupported adapter tensors (e.g. {bad[0]})")
    ab_parts: dict[str, dict[str, torch.Tensor]] = {}
    token_rows: dict[str, torch.Tensor] = {}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        key = _strip(key)
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if m:
            ab_parts.setdefault(m.group(1), {})[m.group(2)] = tensor
            continue
        m = re.fullmatch(r"(.+)\.token_adapter\.trainable_tokens_delta(?:\.[^.]+)?", key)
        if m:
            token_rows[m.group(1)] = tensor
            continue
        m = re.fullmatch(r"(.+?)(?:\.modules_to_save(?:\.[^.]+)?)?\.(weight|bias)", key)
        if m:
            saved.setdefault(m.group(1), {})[m.group(2)] = tensor
            continue
        raise ValueError(f"{adapter_dir}: unrecognised adapter tensor {key}")
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    lora = {}
    for name, ab in ab_parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{adapter_dir}: {name} lacks lora_A or lora_B")
        r = _pattern_value(name, rank_pattern, r_default)
        alpha = _pattern_value(name, alpha_pattern, alpha_default)
        lora[name] = (ab["A"], ab["B"], float(alpha / (r**0.5) if rslora else alpha / r))
    return ParsedAdapter(config, lora, token_rows, saved)


def attach_gated_adapter(model: nn.Module, adapter_dir: str | Path, gate: LoRAGate | None = None) -> LoRAGate:
    """Wrap the adapter's target modules of `model` (in place); returns the gate that drives them
    (also `model.selfspec_lora_gate`)."""
    adapter = parse_adapter(adapter_dir)
    config, token_rows, saved = adapter.config, adapter.token_rows, adapter.saved
    gate = set_model_gate(model, gate or LoRAGate())
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    for name, (lora_a, lora_b, scaling) in adapter.lora.items():
        base = modules.get(name)
        if not isinstance(base, nn.Linear):
            raise ValueError(f"{adapter_dir}: LoRA target {name} is not an nn.Linear of this model")
        _replace(model, name, GatedLoRALinear(base, lora_a.to(device), lora_b.to(device), scaling, gate))
    for name, params in saved.items():
        base = modules.get(name)
        if base is None:
            raise ValueError(f"{adapter_dir}: modules_to_save entry {name} is not a module of this model")
        replacement = _clone_with(base, params)
        _replace(model, name, GatedReplacement(base, replacement.to(device), gate))
    indices = config.get("trainable_token_indices")
    for name, rows in token_rows.items():
        base = modules.get(name)
        idx = indices if isinstance(indices, list) else (indices or {}).get(name.split(".")[-1])
        if not isinstance(base, nn.Embedding) or idx is None:
            raise ValueError(f"{adapter_dir}: trainable tokens for {name} cannot be applied")
        _replace(model, name, GatedTokenRows(base, list(idx), rows.to(device), gate))
    return gate


def _clone_with(base: nn.Module, params: dict[str, torch.Tensor]) -> nn.Module:
    import copy

    clone = copy.deepcopy(base)
    for pname, value in params.items():
        target = getattr(clone, pname)
        if target is None or target.shape != value.shape:
            raise ValueError(f"modules_to_save tensor {pname} has shape {tuple(value.shape)}, expected "
                             f"{None if target is None else tuple(target.shape)}")
        setattr(clone, pname, nn.Parameter(value.to(target.dtype), requires_grad=False))
    return clone


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
