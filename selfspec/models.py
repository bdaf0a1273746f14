"""Embedded models and how a `--model` argument resolves to a directory on disk."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import UserError

ASSETS_DIR = Path(__file__).resolve().parent / "assets"

EMBEDDED_MODELS: dict[str, str] = {
    "tiny-base": "Qwen3-architecture causal LM (~5M parameters) trained on the Python standard library",
    "tiny-idlm": "I-DLM conversion of tiny-base (stride N=4, [MASK] proposals): serves ISD",
    "tiny-idlm-lora": "gated LoRA adapter over a frozen tiny-base (stride N=4): serves RISD, output equal to tiny-base",
    "tiny-jf": "Jacobi Forcing of tiny-base (trained on its own Jacobi trajectories, n = 8 then 16): serves JACOBI",
    "tiny-c2i-teacher": "class-conditional image-token GPT (~4.9M parameters) on real MNIST digits: HB-SJD rollouts",
    "tiny-c2i-student": "a 5-6x smaller class-conditional image-token GPT on the same digits (OPD student)",
}


class ModelNotFoundError(UserError):
    pass


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    description: str

    @property
    def present(self) -> bool:
        return (self.path / "config.json").exists() or (self.path / "adapter_config.json").exists()

    def provenance(self) -> dict | None:
        p = self.path / "provenance.json"
        return json.loads(p.read_text()) if p.exists() else None


def embedded_models() -> list[ModelInfo]:
    return [ModelInfo(n, ASSETS_DIR / n, d) for n, d in EMBEDDED_MODELS.items()]


def resolve_model(name_or_path: str | Path) -> Path:
    """An embedded model's name, or a directory with a Hugging Face checkpoint or adapter."""
    text = str(name_or_path)
    if text in EMBEDDED_MODELS:
        info = ModelInfo(text, ASSETS_DIR / text, EMBEDDED_MODELS[text])
        if not info.present:
            raise ModelNotFoundError(
                f"embedded model '{text}' is not on disk at {info.path}; rebuild it with `selfspec train {text}`"
            )
        return info.path
    path = Path(text).expanduser()
    if path.is_dir() and ((path / "config.json").exists() or (path / "adapter_config.json").exists()):
        return path.resolve()
    known = ", ".join(EMBEDDED_MODELS)
    if path.exists():
        raise ModelNotFoundError(f"'{text}' has no config.json or adapter_config.json: not a checkpoint directory")
    raise ModelNotFoundError(
        f"unknown model '{text}': neither an embedded model ({known}) nor an existing directory. "
        "Run `selfspec models` to list the embedded models."
    )


def is_adapter_only(path: Path) -> bool:
    return (path / "adapter_config.json").exists() and not (path / "config.json").exists()


def adapter_base(adapter_dir: Path) -> Path:
    """The base checkpoint an adapter-only directory was trained on: its selfspec.json
    `base_model` (an embedded name or a path relative to the adapter), else PEFT's
    `base_model_name_or_path`."""
    base = None
    meta_file = adapter_dir / "selfspec.json"
    if meta_file.exists():
        base = json.loads(meta_file.read_text()).get("base_model")
        if base and (adapter_dir / base).exists():
            base = str((adapter_dir / base).resolve())
    if not base:
        base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ModelNotFoundError(f"adapter {adapter_dir} names no base model: add \"base_model\" to its selfspec.json")
    try:
        return resolve_model(base)
    except ModelNotFoundError as err:
        raise ModelNotFoundError(f"the base of adapter {adapter_dir} cannot be found: {err}") from None


def resolve_with_adapter(name_or_path: str | Path) -> tuple[Path, Path | None]:
    """(checkpoint to load, adapter to attach or None): an adapter-only directory resolves to
    its base plus itself, so `--model tiny-idlm-lora` works wherever a model is named."""
    path = resolve_model(name_or_path)
    if is_adapter_only(path):
        return adapter_base(path), path
    return path, None
