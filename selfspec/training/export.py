"""Export of I-DLM / RISD checkpoints that the HF engine and the SGLang plugin load.

A full conversion (mode "isd") is a Hugging Face checkpoint: config.json, model.safetensors
(bf16), tokenizer files, generation_config.json, plus `selfspec.json` and `provenance.json`.
A gated-LoRA adapter (mode "risd") is adapter-only: PEFT's adapter_config.json and
adapter_model.safetensors (bf16), the tokenizer, `selfspec.json` naming its base
(`base_model`: an embedded model name or a path) and `provenance.json`.

`selfspec.json` (format 1; read with `selfspec.decoding.metadata.load_metadata`):
    mode            "isd" | "risd"
    stride          N (the ISD stride the model was trained for; N-1 MASKs per step)
    mask_token      "[MASK]"
    mask_token_id   id of the mask token in the exported tokenizer
    lora            null | {rank, alpha, targets, base_sha256}
    base_model      adapter-only checkpoints: the base to load the adapter onto
    converted_from  full conversions: the base they were converted from (information only)
    recipe          the training command and configuration
    metrics         held-out metrics at export time

`base_sha256` is `weights_sha256(base_dir)`: sha256 over the bytes of the base's
`*.safetensors` files, in sorted file-name order.

`selfspec export --checkpoint RUN/checkpoints/step-XXXXXX --out DIR` exports a training
checkpoint (see `selfspec.training.idlm`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from selfspec.errors import UsageError
from selfspec.decoding.metadata import METADATA_FILE, load_metadata, write_metadata  # noqa: F401 (the one reader/writer)

FORMAT_VERSION = 1


def weights_sha256(model_dir: str | Path) -> str:
    h = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UsageError(f"no *.safetensors in {model_dir}")
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def build_metadata(*, mode: str, stride: int, mask_token: str, mask_token_id: int, lora: dict | None,
                   base_model: str | None, converted_from: str | None, recipe: dict, metrics: dict) -> dict:
    if mode not in ("isd", "risd"):
        raise UsageError(f"mode must be isd or risd, got {mode}")
    meta = {
        "format_version": FORMAT_VERSION,
        "mode": mode,
        "stride": int(stride),
        "mask_token": mask_token,
        "mask_token_id": int(mask_token_id),
        "lora": lora,
    }
    if base_model is not None:
        meta["base_model"] = base_model
    if converted_from is not None:
        meta["converted_from"] = converted_from
    meta["recipe"] = recipe
    meta["metrics"] = metrics
    return meta


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def export_full(model, tokenizer, out_dir: str | Path, metadata: dict, provenance: dict | None = None) -> Path:
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


def export_adapter(peft_model, tokenizer, out_dir: str | Path, metadata: dict, base_model_ref: str,
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


def _write_side_files(out: Path, tokenizer, metadata: dict, provenance: dict | None) -> None:
    """What every export carries beside its weights: tokenizer, selfspec.json, provenance."""
    tokenizer.save_pretrained(out)
    write_metadata(out, metadata)
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
    from selfspec.training.idlm import export_from_checkpoint

    out = export_from_checkpoint(Path(args.checkpoint), Path(args.out))
    print(f"exported {out}")
    return 0
