#!/usr/bin/env python
"""What the MASK self-distillation does to sampled acceptance, at a small fixed budget.

    python bench/idlm_distill_probe.py --arms 0,1:1.0,1:1.0+0.7 --steps 150 [--prompts eval,humaneval] [--json OUT]

Every arm continues training the embedded tiny-idlm by its recipe's settings at stride 4 (the
stdlib corpus only, the recipe's AR anchor, a lower learning rate) for the same steps; only the
distillation changes: `W` is `--mask-distill-weight W` (0: none, the control for the extra
training itself) and `W:T1+T2` adds `--mask-distill-temperatures T1,T2` (one per batch in turn).
Then each model's introspective acceptance alpha of its MASK proposals (`evaluate.
introspective_acceptance`) at N = 2, 3, 4 and T = 0, 0.7, 1.0 per prompt set, and its held-out
AR perplexity; the first row is tiny-idlm as committed. Arms run one after another.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STRIDES = (2, 3, 4)
TEMPERATURES = (0.0, 0.7, 1.0)


def parse_arm(text: str) -> tuple[float, list[float]]:
    weight, _, temps = text.partition(":")
    return float(weight), [float(t) for t in temps.split("+")] if temps else [1.0]


def measure(model, tokenizer, mask_id: int, sets: dict[str, list[list[int]]], new_tokens: int) -> dict:
    from selfspec.training.evaluate import heldout_ar_perplexity, introspective_acceptance

    row = {"heldout_ar_perplexity": heldout_ar_perplexity(model, tokenizer)["heldout_perplexity"], "alpha": {}}
    for name, prompts in sets.items():
        row["alpha"][name] = {f"N={n},T={t:g}": introspective_acceptance(model, prompts, n, mask_id, new_tokens,
                                                                         temperature=t, seed=0)["alpha"]
                              for n in STRIDES for t in TEMPERATURES}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="0,1:1.0,1:1.0+0.7", help="WEIGHT[:T1+T2...],... (see above)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--prompts", default="eval,humaneval", help="prompt sets (tune, eval, humaneval) or files")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from selfspec.engines.hf import HFEngine
    from selfspec.models import resolve_model
    from selfspec.training.idlm import IDLMObjective
    from selfspec.training.loop import train
    from selfspec.training.recipes import RECIPES, measure_prompts

    start = HFEngine.from_pretrained("tiny-idlm", dtype=torch.float32)
    mask_id = start.resolve_mask_token()
    sets = {name: measure_prompts(name, start.tokenizer, args.num_prompts)[1] for name in args.prompts.split(",")}
    result = {"steps": args.steps, "lr": args.lr, "num_prompts": args.num_prompts, "new_tokens": args.new_tokens,
              "rows": [{"arm": "tiny-idlm as committed", **measure(start.model, start.tokenizer, mask_id, sets,
                                                                   args.new_tokens)}]}
    for arm in args.arms.split(","):
        weight, temps = parse_arm(arm)
        started = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = replace(RECIPES["tiny-idlm"], base=str(resolve_model("tiny-idlm")), curriculum=[4],
                          stage_fractions=[1.0], data=["stdlib"], data_weights=None, steps=args.steps,
                          time_budget_minutes=None, lr=args.lr, eval_every=0, save_every=0,
                          mask_distill_weight=weight, mask_distill_temperatures=temps,
                          out=str(Path(tmp) / "model"), checkpoint_dir=str(Path(tmp) / "ck"), progress_bar=False)
            res = train(IDLMObjective(cfg))
            row = {"arm": arm, "mask_distill_weight": weight, "mask_distill_temperatures": temps,
                   **measure(res["model"].float().eval(), res["tokenizer"], mask_id, sets, args.new_tokens),
                   "seconds": round(time.time() - started, 1)}
        result["rows"].append(row)
    base_ppl = result["rows"][0]["heldout_ar_perplexity"]
    for row in result["rows"]:
        change = 100 * (row["heldout_ar_perplexity"] / base_ppl - 1)
        print(f"{row['arm']:24s} ppl {row['heldout_ar_perplexity']:.2f} ({change:+.1f}%) "
              + " ".join(f"{name} " + " ".join(f"{k}:{v:.3f}" for k, v in a.items())
                         for name, a in row["alpha"].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
