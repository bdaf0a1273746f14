#!/usr/bin/env python
"""What grammar-masked ISD proposals buy under structured output, on the reference engine:

    python bench/grammar_proposals.py [--model tiny-idlm] [--max-new 48] [--json OUT]

For a JSON schema and a regex, greedy and T=0.7, ISD (stride 4) decodes the same prompts with
proposals drawn from the grammar-masked MASK rows (`grammar_proposals=true`, the default) and
from the raw MASK rows (`false`), and prints tokens per forward (TPF) and CPU seconds of each.
Both are exact (greedy: AR's output; sampling: AR's law); only the acceptance differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = {"type": "object", "required": ["name", "size", "tags"],
          "properties": {"name": {"type": "string"}, "size": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
GRAMMARS = {"json_schema": dict(json_schema=json.dumps(SCHEMA)),
            "regex": dict(regex=r"(def [a-z_]+\(x\):\n    return x \* [0-9]+\n\n){1,4}")}
PROMPTS = ["config = ", "# settings\n", "def main():\n    ", "import os\n", "result = ", "data = load()\n",
           "x = 1\n", "class A:\n    "]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-idlm")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()

    import torch
    from tqdm import tqdm

    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.grammar import XGrammar
    from selfspec.engines.hf import HFEngine
    from selfspec.models import resolve_model

    eng = HFEngine.from_pretrained(str(resolve_model(args.model)), dtype=torch.float32)
    vocab = eng.model.get_output_embeddings().weight.shape[0]
    prompts = [eng.encode(t) for t in PROMPTS]
    rows = []
    runs = [(g, t, masked) for g in GRAMMARS for t in (0.0, 0.7) for masked in (True, False)]
    for gname, temperature, masked in tqdm(runs, desc="grammar proposals"):
        grammars = [XGrammar.compile(eng.tokenizer, vocab, **GRAMMARS[gname]) for _ in prompts]
        t0 = time.process_time()
        outs = eng.generate(prompts, args.max_new, SamplingParams(temperature=temperature),
                            seed=list(range(len(prompts))), mode="isd",
                            mode_config={"stride": 4, "grammar_proposals": masked}, grammars=grammars)
        cpu = time.process_time() - t0
        tokens, forwards = sum(len(o.token_ids) for o in outs), sum(o.metrics.forwards for o in outs)
        rows.append(dict(grammar=gname, temperature=temperature, grammar_proposals=masked, tokens=tokens,
                         forwards=forwards, tpf=tokens / forwards, cpu_s=cpu))
    print(f"{'grammar':12s} {'T':>4s} {'proposals':>10s} {'TPF':>6s} {'CPU s':>7s}")
    for r in rows:
        print(f"{r['grammar']:12s} {r['temperature']:4.1f} {'masked' if r['grammar_proposals'] else 'raw':>10s} "
              f"{r['tpf']:6.2f} {r['cpu_s']:7.1f}")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "max_new": args.max_new, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
