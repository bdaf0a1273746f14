"""Held-out prompts for tests and benchmarks, cut from the held-out split of the corpus.

`python -m selfspec.training.prompts --out bench/prompts/heldout.jsonl` writes the committed
file; prompts start at a line that begins a `def` or `class`, or at a blank-line boundary,
and end at a line end, so they look like what a code model is asked to continue.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--count", type=int, default=64)
    args = parser.parse_args()
    prompts = heldout_prompts(args.count)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"wrote {len(prompts)} prompts to {out}")


if __name__ == "__main__":
    main()
