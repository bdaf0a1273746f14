#!/usr/bin/env python
"""Jacobi Forcing ablation at a small fixed budget, on one set of round-1 trajectories:

    python bench/jf_ablation.py --trajectories runs/tiny-jf/round-1/trajectories [--steps 150] \
        [--arms progressive:nc,progressive:nc_ic,progressive:cllm,random:nc,reverse:nc] [--json OUT]

Every arm trains tiny-base for the same number of steps with the recipe's settings (block 8,
window 8, lr, batch of `selfspec.training.jacobi_forcing.recipe.RECIPE`) and the loss weights the ablation
was run with (AR CE 1, anchor 4 to the starting model, `LOSS`), only the noise
schedule and the mask changing, then reports its held-out signals (one-step Jacobi gain,
accuracy after the first error, consistency KL, AR perplexity) and its plain-Jacobi TPF (n = 8,
one block, context-initialised drafts) on held-out prompts, which must still equal its own greedy
AR output. The seed's signs to compare: progressive > random > reverse, NC > NC-IC.
Arms run one after another (one training at a time on a shared CPU).
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

DEFAULT_ARMS = "progressive:nc,progressive:nc_ic,progressive:cllm,random:nc,reverse:nc"
LOSS = {"ar_weight": 1.0, "anchor_weight": 4.0, "anchor_model": None}  # the loss of the recipe this ablation informed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", default=str(REPO / "runs" / "tiny-jf" / "round-1" / "trajectories"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--arms", default=DEFAULT_ARMS, help="SCHEDULE:MASK[:ANCHOR_WEIGHT],... (schedules progressive "
                                                             "/ random / reverse; masks nc / nc_ic / cllm; anchor "
                                                             "weight default 4)")
    parser.add_argument("--num-prompts", type=int, default=24, help="held-out prompts for the TPF")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from selfspec.engines.hf import HFEngine
    from selfspec.prompts import load_prompt_set
    from selfspec.training.jacobi_forcing.objective import JFObjective
    from selfspec.training.jacobi_forcing.recipe import PLAIN, RECIPE, _jacobi_row
    from selfspec.training.loop import train
    from selfspec.training.recipes import HELDOUT_PROMPTS

    rows = []
    for arm in args.arms.split(","):
        schedule, context, *rest = arm.split(":")
        anchor = float(rest[0]) if rest else LOSS["anchor_weight"]
        started = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = replace(RECIPE, rounds=None, round_fractions=None, trajectories=args.trajectories, block_size=8,
                          window=8, schedule=schedule, context=context, **{**LOSS, "anchor_weight": anchor},
                          steps=args.steps, time_budget_minutes=None,
                          eval_every=0, save_every=0, out=str(Path(tmp) / "model"), checkpoint_dir=str(Path(tmp) / "ck"),
                          progress_bar=False)
            result = train(JFObjective(cfg, args.trajectories))
            engine = HFEngine.from_pretrained(cfg.out, dtype=torch.float32)
            prompts = [engine.tokenizer(p, add_special_tokens=False)["input_ids"]
                       for p in load_prompt_set(str(HELDOUT_PROMPTS))[: args.num_prompts]]
            ref = [o.token_ids for o in engine.generate(prompts, max_new_tokens=128, mode="ar", batch_size=16)]
            tpf = _jacobi_row(engine, prompts, 128, {**PLAIN, "block_size": 8}, ref)
        ev = result["state"]["history"][-1]["heldout"]
        rows.append({"schedule": schedule, "mask": context, "anchor_weight": anchor, "steps": args.steps, "heldout": ev,
                     "plain_tpf_n8": tpf["tpf"], "plain_tpf_n8_non_loop": tpf["non_loop"]["tpf"],
                     "equals_greedy_ar": tpf["equals_greedy_ar"], "seconds": round(time.time() - started, 1)})
        r = rows[-1]
        acc = ev["accuracy_by_offset"]
        print(f"{schedule:11s} {context:6s} anchor {anchor:<4g} TPF {r['plain_tpf_n8']:.3f} (no-loop {r['plain_tpf_n8_non_loop'] or 0:.3f}) "
              f"gain {ev['gain']:.3f} acc m=1 {acc[1]:.3f} m=2 {acc[2]:.3f} KL {ev['consistency_kl']:.3f} "
              f"ppl {ev['ar_perplexity']:.2f} =AR {100 * r['equals_greedy_ar']:.0f}%", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"trajectories": args.trajectories, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
