"""The files a served checkpoint carries, wherever they live: a local folder or a Hub name.

SGLang takes `--model-path ORG/NAME` and resolves it through huggingface_hub's cache (the
`--revision`, `HF_HUB_OFFLINE` and `HF_HOME` it honours). The start-up checks read the same
snapshot, so a hub model is checked exactly like a folder: `local_dir` finds it (fetching only
the small files, config and tokenizer, when the Hub is reachable and they are not cached) and
names the download command when it cannot.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from selfspec.errors import UserError

#: what the start-up checks read: configs, tokenizer files, remote-code config classes
_SMALL_FILES = ["*.json", "*.py", "*.txt", "*.model", "*.tiktoken", "*.yaml"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointNotFound(UserError):
    """A model path that is neither a folder nor a Hub model available here."""


def is_repo_id(path: str) -> bool:
    """`ORG/NAME` as the Hub spells it, and not a folder on this machine."""
    return bool(_REPO_ID.match(path)) and not Path(path).expanduser().exists()


def local_dir(model_path: str | Path, revision: str | None = None, files: str = "small") -> Path:
    """The folder holding `model_path`'s files: itself, or the Hub snapshot SGLang will serve.
    `files`: "small" fetches (when the Hub is reachable) what the checks read, "all" everything
    (an adapter, whose weights the plugin loads itself)."""
    p = Path(model_path).expanduser()
    if p.is_dir():
        return p
    name = str(model_path)
    if not is_repo_id(name):
        raise CheckpointNotFound(f"--model-path {name}: no such folder, and not a Hugging Face Hub name (ORG/NAME)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        patterns = _SMALL_FILES if files == "small" else None
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns, local_files_only=offline))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        rev = f" --revision {revision}" if revision else ""
        why = ("HF_HUB_OFFLINE is set and it is not in the cache" if offline
               else f"it could not be fetched ({type(e).__name__})")
        raise CheckpointNotFound(
            f"--model-path {name}{' at revision ' + revision if revision else ''}: {why} "
            f"({constants.HF_HUB_CACHE}). Download it first: `hf download {name}{rev}` "
            "(or `huggingface-cli download ...`), on a machine that reaches the Hub, into the same HF_HOME"
        ) from None


def read_json(directory: Path, name: str) -> dict[str, Any]:
    f = directory / name
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{f} is not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config: `text_config` when nested (multimodal releases)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def vocab_size(config: dict[str, Any]) -> int | None:
    value = config.get("vocab_size", text_config(config).get("vocab_size"))
    return int(value) if value is not None else None


def config_mask_token_id(config: dict[str, Any]) -> int | None:
    value = config.get("mask_token_id", text_config(config).get("mask_token_id"))
    return int(value) if value is not None else None


def tokenizer_mask_token_id(tokenizer_dir: Path) -> int | None:
    """The tokenizer's declared mask token's id, read from its files (no model load)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception:
        return None
    if getattr(tok, "mask_token", None) is None or tok.mask_token_id is None:
        return None
    return int(tok.mask_token_id)
