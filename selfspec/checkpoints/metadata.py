"""`selfspec.json`: the metadata a selfspec checkpoint carries beside its config.json.

One class, `SelfspecMetadata`, is what export writes and what the HF engine and the SGLang
plugin read, so that a mode needs no further flags. Format 1:

```json
{
  "format_version": 1,
  "mode": "isd",                      // a registry mode name (lower case): isd | risd | jacobi | sjd
                                      // (image-token models: sjd, their guidance-free text-side mode)
  "stride": 4,                        // isd / risd: the stride N it was trained for
  "mask_token": "[MASK]",             // isd / risd: the token appended at proposal positions
  "mask_token_id": 5,
  "base_model": "tiny-base",          // adapter-only checkpoints: the base (embedded name or path)
  "adapter": "risd-adapter",          // a base / model dir: its RISD adapter dir (PEFT format)
  "converted_from": "tiny-base",      // full conversions: what they were trained from (information)
  "lora": {"rank": 16, "alpha": 32, "targets": ["q_proj"], "base_sha256": "..."},
  "jacobi": {"block_size": 16, "max_blocks": 2, "spawn_ratio": 0.85,   // Jacobi-Forcing models: the
             "verify_size": 4},                                      // recommended JACOBI options
  "image": {...},                     // image-token models: id layout (codes, classes, null id), grid,
                                      // codebook file (free form; `images.gpt.ImageTokenLayout`)
  "recipe": {...},                    // how it was trained (free form)
  "metrics": {...}                    // what was measured (free form)
}
```
Every key is optional; keys this version does not know are kept (`extra`) and written back.
Relative paths (`base_model`, `adapter`) resolve against the directory holding the file.
Mode names are stored lower case; older files with upper-case names read the same.
`weights_sha256` is the base fingerprint an adapter records as `lora.base_sha256`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.errors import UserError

METADATA_FILE = "selfspec.json"
FORMAT_VERSION = 1


class MetadataError(UserError):
    """A selfspec.json that cannot be read; the message names the file and what is wrong."""


@dataclass
class LoraMetadata:
    rank: int | None = None
    alpha: float | None = None
    targets: list[str] | None = None
    base_sha256: str | None = None


@dataclass
class JacobiMetadata:
    """The JACOBI options a Jacobi Forcing model recommends (named as `JacobiConfig`'s fields)."""

    block_size: int | None = None
    max_blocks: int | None = None
    spawn_ratio: float | None = None
    verify_size: int | None = None


# Scalar fields in the order they are written; the nested ones follow.
_SCALARS = ("format_version", "mode", "stride", "mask_token", "mask_token_id", "base_model", "adapter",
            "converted_from")
_NESTED = {"lora": LoraMetadata, "jacobi": JacobiMetadata}
_FREE_FORM = ("image", "recipe", "metrics")


@dataclass
class SelfspecMetadata:
    format_version: int = FORMAT_VERSION
    mode: str | None = None
    stride: int | None = None
    mask_token: str | None = None
    mask_token_id: int | None = None
    base_model: str | None = None
    adapter: str | None = None
    converted_from: str | None = None
    lora: LoraMetadata | None = None
    jacobi: JacobiMetadata | None = None
    image: dict[str, Any] | None = None
    recipe: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None  # the directory holding selfspec.json (not written)

    def __post_init__(self) -> None:
        if self.mode is not None:
            self.mode = str(self.mode).strip().lower()

    def option(self, name: str):
        """The value this file gives a mode option (`ModeSpec.metadata_fields`): a top-level key
        (stride, mask_token_id) or a field of the nested `jacobi` settings; None if absent."""
        if self.jacobi is not None and name in {f.name for f in dataclasses.fields(JacobiMetadata)}:
            return getattr(self.jacobi, name)
        return getattr(self, name, None)

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
        out: dict[str, Any] = {k: getattr(self, k) for k in _SCALARS if getattr(self, k) is not None}
        for key in _NESTED:
            value = getattr(self, key)
            if value is not None:
                out[key] = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        for key in _FREE_FORM:
            if getattr(self, key):
                out[key] = getattr(self, key)
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path | None = None) -> SelfspecMetadata:
        """Raises MetadataError (naming `path`'s file) for a field of the wrong type."""
        where = f"{path / METADATA_FILE}" if path is not None else METADATA_FILE
        if not isinstance(data, dict):
            raise MetadataError(f"{where}: expected a JSON object, got {type(data).__name__}")
        kwargs: dict[str, Any] = {"path": path}
        try:
            for key in ("format_version", "stride", "mask_token_id"):
                if data.get(key) is not None:
                    kwargs[key] = int(data[key])
            for key in ("mode", "mask_token", "base_model", "adapter", "converted_from"):
                if data.get(key) is not None:
                    kwargs[key] = str(data[key])
            for key, nested in _NESTED.items():
                value = data.get(key)
                if value is not None:
                    known = {f.name for f in dataclasses.fields(nested)}
                    kwargs[key] = nested(**{k: v for k, v in dict(value).items() if k in known})
            for key in _FREE_FORM:
                if data.get(key) is not None:
                    kwargs[key] = dict(data[key])
        except (TypeError, ValueError) as e:
            raise MetadataError(f"{where}: malformed field ({e}); fix or remove it") from None
        known = set(_SCALARS) | set(_NESTED) | set(_FREE_FORM)
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs)

    def write(self, directory: str | Path) -> Path:
        file = Path(directory) / METADATA_FILE
        file.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str) + "\n")
        return file


def load_metadata(directory: str | Path) -> SelfspecMetadata | None:
    """The directory's selfspec.json, or None when it has none; MetadataError when it is malformed."""
    directory = Path(directory)
    file = directory / METADATA_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MetadataError(f"{file} is not valid JSON ({e}); fix or remove it") from None
    return SelfspecMetadata.from_dict(data, directory.resolve())


def write_metadata(directory: str | Path, metadata: SelfspecMetadata | dict[str, Any]) -> Path:
    if not isinstance(metadata, SelfspecMetadata):
        metadata = SelfspecMetadata.from_dict(dict(metadata))
    return metadata.write(directory)


def weights_sha256(model_dir: str | Path) -> str:
    """Fingerprint of a checkpoint's weights: sha256 over its *.safetensors files (sorted by
    name, bytes in order); what an adapter records as `lora.base_sha256`."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def model_fingerprint(model_dir: str | Path) -> str:
    """A cheap fingerprint of a checkpoint's weights, for what is measured on one model (a width
    plan): sha256 over each *.safetensors file's name, size and first MiB (weights of another
    training run differ there; reading every byte of a large model at each start-up would not pay)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()


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
