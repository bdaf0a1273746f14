"""Held-out prompts for tests and benchmarks, cut from the held-out split of the corpus.

`python -m selfspec.training.prompts --out bench/prompts/heldout.jsonl --count 128` writes the
committed file; prompts start at a line that begins a `def` or `class`, or at a blank-line
boundary, and end at a line end, so they look like what a code model is asked to continue. It
starts with the original cut (three per file, 64 minus the 5 texts that two files share; the
recipes' measurements use the first 64), then more cuts of the same files, so a benchmark whose
concurrency levels need more than 64 requests still never repeats a prompt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfspec.training.corpus import load_stdlib_split


def heldout_prompts(count: int = 64, max_chars: int = 320, per_file: int = 3) -> list[str]:
    split = load_stdlib_split()
    prompts: list[str] = []
    for f in sorted(split.heldout, key=lambda f: f.relpath):
        lines = f.text.splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        taken = 0
        for i in starts[:: max(1, len(starts) // per_file) or 1]:
            text = ""
            for line in lines[i:]:
                if len(text) + len(line) > max_chars:
                    break
                text += line
            if len(text) >= 40:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=128, help="prompts to write")
    args = parser.parse_args()
    prompts = benchmark_prompts(args.count)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {out}")


if __name__ == "__main__":
    main()
