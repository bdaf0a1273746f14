"""Export of trained models: what the HF engine and the SGLang plugin load.

A full model (an I-DLM conversion, mode "isd", or a plain base model) is a Hugging Face
checkpoint: config.json, model.safetensors (bf16), tokenizer files, generation_config.json,
plus `selfspec.json` (when the objective gives metadata) and `provenance.json`. An adapter
(mode "risd", the registry's `checkpoint_kind == "adapter"`) is adapter-only: PEFT's
adapter_config.json and adapter_model.safetensors (bf16), the tokenizer, `selfspec.json` naming
its base (`base_model`: an embedded model name or a path) and `provenance.json`.

`selfspec.json` is `selfspec.checkpoints.metadata.SelfspecMetadata` (format 1), filled by the
objective (`Objective.metadata`); for I-DLM:
    mode            "isd" | "risd"
    stride          N (the ISD stride the model was trained for; N-1 MASKs per step)
    mask_token      "[MASK]"
    mask_token_id   id of the mask token in the exported tokenizer
    lora            null | {rank, alpha, targets, base_sha256}
    base_model      adapter-only checkpoints: the base to load the adapter onto
    converted_from  full conversions: the base they were converted from (information only)
    recipe          the training command and configuration
    metrics         held-out metrics at export time

`base_sha256` is `selfspec.checkpoints.metadata.weights_sha256(base_dir)`: sha256 over the bytes
of the base's `*.safetensors` files, in sorted file-name order.

`selfspec export --checkpoint RUN/checkpoints/step-XXXXXX --out DIR` exports a training
checkpoint of any objective (the checkpoint names its objective and config).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from selfspec.decoding import registry
from selfspec.checkpoints.metadata import SelfspecMetadata
from selfspec.training.checkpoint import find_checkpoint, read_state
from selfspec.training.objective import objective_class


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def export_trained(model, objective, state: dict, out: Path, train_seconds: float | None = None) -> Path:
    """Export a trained model with the metadata and provenance its objective gives: adapter-only
    for a mode whose checkpoints are adapters (RISD), a full checkpoint otherwise."""
    metadata = objective.metadata(state)
    provenance = objective.provenance(model, state, Path(out), train_seconds)
    if metadata is not None and registry.get(metadata.mode).checkpoint_kind == "adapter":
        return export_adapter(model, objective.tokenizer, out, metadata, metadata.base_model, provenance)
    return export_full(model, objective.tokenizer, out, metadata, provenance)


def export_from_checkpoint(checkpoint: Path, out: Path) -> Path:
    """`selfspec export`: rebuild the model of a training checkpoint (of the objective it names)
    and export it."""
    from safetensors.torch import load_file

    checkpoint = find_checkpoint(checkpoint)
    saved = read_state(checkpoint)
    cls = objective_class(saved.pop("objective", None))
    objective = cls(cls.config_class(**saved.pop("config")))
    model = objective.build_model(torch.device("cpu"))
    weights = checkpoint / "accelerate" / "model.safetensors"
    if weights.exists():
        sd = load_file(weights)
    else:
        sd = torch.load(checkpoint / "accelerate" / "pytorch_model.bin", map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed_tokens" in k}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
    return export_trained(model, objective, saved, Path(out))


def export_full(model, tokenizer, out_dir: str | Path, metadata: SelfspecMetadata | None,
                provenance: dict | None = None) -> Path:
    """Save a full (non-adapter) model as bf16 safetensors + tokenizer + metadata."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("adapter_config.json", "adapter_model.safetensors"):
        (out / stale).unlink(missing_ok=True)
    model = _unwrap(model)
    dtype = next(model.parameters()).dtype
    model.to(torch.bfloat16)
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        model.to(dtype)
    _write_side_files(out, tokenizer, metadata, provenance)
    return out


def export_adapter(peft_model, tokenizer, out_dir: str | Path, metadata: SelfspecMetadata, base_model_ref: str,
                   provenance: dict | None = None) -> Path:
    """Save only the LoRA adapter (PEFT format, bf16) + tokenizer + metadata naming the base."""
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("config.json", "model.safetensors", "generation_config.json"):
        (out / stale).unlink(missing_ok=True)
    peft_model = _unwrap(peft_model)
    peft_model.save_pretrained(out, safe_serialization=True)
    weights = out / "adapter_model.safetensors"
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    cfg_path = out / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base_model_ref
    write_json(cfg_path, cfg)
    # PEFT writes a README model card; an embedded adapter does not need it.
    (out / "README.md").unlink(missing_ok=True)
    _write_side_files(out, tokenizer, metadata, provenance)
    return out


def _write_side_files(out: Path, tokenizer, metadata: SelfspecMetadata | None, provenance: dict | None) -> None:
    """What every export carries beside its weights: tokenizer, selfspec.json, provenance."""
    if tokenizer is not None:  # image-token models have none (their "tokenizer" is the codebook)
        tokenizer.save_pretrained(out)
    if metadata is not None:
        metadata.write(out)
    if provenance is not None:
        write_json(out / "provenance.json", provenance)
    _readable(out)


def _readable(out: Path) -> None:
    """safetensors writes 0600 files; exported checkpoints are meant to be shared (and committed)."""
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)


def _unwrap(model):
    return getattr(model, "module", model)


# ------------------------------------------------------------------------------ CLI: export
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a training checkpoint directory (RUN/checkpoints/step-N) or a training run directory "
                             "(its latest checkpoint is used)")
    parser.add_argument("--out", required=True, help="export directory")


def run(args: argparse.Namespace) -> int:
    out = export_from_checkpoint(Path(args.checkpoint), Path(args.out))
    print(f"exported {out}")
    return 0
