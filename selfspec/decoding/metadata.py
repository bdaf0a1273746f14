"""`selfspec.json`: the metadata a selfspec checkpoint carries beside its config.json.

Read by the HF engine and by the SGLang plugin, so that a mode needs no further flags.

```json
{
  "mode": "ISD",                      // ISD | RISD | JACOBI | SJD: what the checkpoint is for
  "stride": 4,                        // ISD / RISD stride N
  "mask_token_id": 5,                 // the [MASK] token ISD / RISD append
  "base_model": "tiny-base",          // RISD adapter dirs: the base checkpoint (name or path)
  "adapter": "risd-adapter",          // a base / model dir: its RISD adapter dir (PEFT format)
  "lora": {"rank": 16, "targets": ["q_proj", "v_proj"], "base_sha256": "..."},
  "recipe": {...},                    // how it was trained (free form)
  "metrics": {...}                    // what was measured (free form)
}
```
Every key is optional. Relative paths (`base_model`, `adapter`) resolve against the directory
holding the file; `base_model` may also be an embedded model's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METADATA_FILE = "selfspec.json"


@dataclass
class LoraMetadata:
    rank: int | None = None
    targets: list[str] | None = None
    base_sha256: str | None = None


@dataclass
class SelfspecMetadata:
    path: Path | None = None  # the directory holding selfspec.json
    mode: str | None = None
    stride: int | None = None
    mask_token_id: int | None = None
    base_model: str | None = None
    adapter: str | None = None
    lora: LoraMetadata | None = None
    recipe: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def resolve(self, value: str | None) -> str | None:
        """A relative path in the file, made absolute against its directory when it exists there."""
        if value is None or self.path is None:
            return value
        candidate = (self.path / value).expanduser()
        return str(candidate.resolve()) if candidate.exists() else value

    @property
    def base_model_path(self) -> str | None:
        return self.resolve(self.base_model)

    @property
    def adapter_path(self) -> str | None:
        return self.resolve(self.adapter)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("mode", "stride", "mask_token_id", "base_model", "adapter"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.lora is not None:
            out["lora"] = {k: v for k, v in vars(self.lora).items() if v is not None}
        if self.recipe:
            out["recipe"] = self.recipe
        if self.metrics:
            out["metrics"] = self.metrics
        out.update(self.extra)
        return out


_KNOWN = {"mode", "stride", "mask_token_id", "base_model", "adapter", "lora", "recipe", "metrics"}


def parse_metadata(data: dict[str, Any], path: Path | None = None) -> SelfspecMetadata:
    lora = data.get("lora")
    return SelfspecMetadata(
        path=path,
        mode=str(data["mode"]).upper() if data.get("mode") is not None else None,
        stride=int(data["stride"]) if data.get("stride") is not None else None,
        mask_token_id=int(data["mask_token_id"]) if data.get("mask_token_id") is not None else None,
        base_model=data.get("base_model"),
        adapter=data.get("adapter"),
        lora=LoraMetadata(lora.get("rank"), lora.get("targets"), lora.get("base_sha256")) if lora else None,
        recipe=dict(data.get("recipe") or {}),
        metrics=dict(data.get("metrics") or {}),
        extra={k: v for k, v in data.items() if k not in _KNOWN},
    )


def load_metadata(directory: str | Path) -> SelfspecMetadata | None:
    """The directory's selfspec.json, or None when it has none."""
    directory = Path(directory)
    file = directory / METADATA_FILE
    if not file.is_file():
        return None
    return parse_metadata(json.loads(file.read_text()), directory.resolve())


def write_metadata(directory: str | Path, metadata: SelfspecMetadata | dict[str, Any]) -> Path:
    data = metadata.to_dict() if isinstance(metadata, SelfspecMetadata) else dict(metadata)
    file = Path(directory) / METADATA_FILE
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return file


def resolve_mask_token_id(
    explicit: int | None = None, metadata: SelfspecMetadata | None = None, tokenizer: Any = None
) -> int | None:
    """The [MASK] token id: explicit setting, else selfspec.json, else the tokenizer's mask_token."""
    if explicit is not None:
        return int(explicit)
    if metadata is not None and metadata.mask_token_id is not None:
        return metadata.mask_token_id
    if tokenizer is not None and getattr(tokenizer, "mask_token", None) is not None:
        tid = getattr(tokenizer, "mask_token_id", None)
        if tid is not None:
            return int(tid)
    return None
