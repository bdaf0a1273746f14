#!/usr/bin/env python
"""Jacobi Forcing trade-off sweep: the AR anchor's weight against training steps, one round.

    python bench/jf_sweep.py --anchors 8,16,32,64 --steps 360 --points 3 --prompts tune,heldout,humaneval \
        [--json OUT] [--plot OUT.png]

Every arm trains tiny-base by the tiny-jf recipe's round-1 settings (n = 8, w = 8, lr, batch,
anchored to tiny-base), with its own anchor weight and weight of the AR CE on the model's own
trajectories, on one set of round-1 trajectories, for `--steps` steps with one learning-rate
schedule, and stops `--points` times along it (a checkpoint, then `--resume`) to measure the
model as the recipe does: held-out AR perplexity against tiny-base's (the stdlib
held-out split), and per prompt set the share of greedy AR outputs that end in a repetition loop
and the multi-block + recycling (MR) TPF at the recipe's serving settings, on all outputs and on
the ones that do not loop (every JACOBI output must equal the model's own greedy AR output).
Arms run one after another (one training at a time on a shared CPU). The recipe's pick (`pick`):
the end of a schedule with perplexity <= +10% and the best non-looping MR TPF on the first prompt
set (give the tune prompts first).
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

PPL_LIMIT = 0.10  # the recipe's bound on the perplexity change: at most 1.10x tiny-base's


def mr_options(block_size: int) -> dict:
    from selfspec.training.jacobi_forcing.recipe import RECIPE

    return {"block_size": block_size, "max_blocks": RECIPE.serve_max_blocks, "verify_size": RECIPE.serve_verify_size,
            "spawn_ratio": RECIPE.serve_spawn_ratio}


def measure_point(engine, prompt_sets: dict[str, list[list[int]]], options: dict) -> dict:
    """The recipe's signals of one model: perplexity, and per prompt set loop rate and MR TPF."""
    from selfspec.benchmarks.repetition import is_repetition_loop
    from selfspec.training.evaluate import heldout_ar_perplexity
    from selfspec.training.jacobi_forcing.recipe import _jacobi_row

    engine.model.eval()
    row = {"heldout_ar_perplexity": heldout_ar_perplexity(engine.model, engine.tokenizer)["heldout_perplexity"],
           "by_prompts": {}}
    for name, prompts in prompt_sets.items():
        ref = [o.token_ids for o in engine.generate(prompts, max_new_tokens=128, mode="ar", batch_size=16)]
        mr = _jacobi_row(engine, prompts, 128, options, ref)
        row["by_prompts"][name] = {"ar_loop_rate": sum(map(is_repetition_loop, ref)) / len(ref), "mr_tpf": mr["tpf"],
                                   "mr_tpf_non_loop": mr["non_loop"]["tpf"],
                                   "non_loop_outputs": mr["non_loop"]["outputs"],
                                   "equals_greedy_ar": mr["equals_greedy_ar"]}
    return row


def pick(rows: list[dict], base_ppl: float, prompts: str, steps: int) -> dict | None:
    """The best non-looping MR TPF on `prompts` (the tune set: the pick is fitted there and
    reported on the others) within the perplexity bound, among the ends of the schedules: a
    recipe reproduces the end of its schedule, not a stop along a longer one."""
    ok = [r for r in rows if r["step"] == steps and r["heldout_ar_perplexity"] / base_ppl - 1 <= PPL_LIMIT
          and r["by_prompts"][prompts]["mr_tpf_non_loop"] is not None]
    return max(ok, key=lambda r: r["by_prompts"][prompts]["mr_tpf_non_loop"], default=None)


def arm_of(row: dict) -> tuple[float, float]:
    return row["anchor_weight"], row.get("ar_weight", 1.0)


def arm_label(arm: tuple[float, float]) -> str:
    return f"anchor {arm[0]:g}" + ("" if arm[1] == 1.0 else f", AR CE {arm[1]:g}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = result["base"]
    names = list(base["by_prompts"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names) + 2.5, 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        for arm in sorted({arm_of(r) for r in result["rows"]}):
            pts = [r for r in result["rows"] if arm_of(r) == arm]
            pts = [r for r in pts if r["by_prompts"][name]["mr_tpf_non_loop"] is not None]  # every output loops
            xs = [100 * (r["heldout_ar_perplexity"] / base["heldout_ar_perplexity"] - 1) for r in pts]
            ys = [r["by_prompts"][name]["mr_tpf_non_loop"] for r in pts]
            ax.plot(xs, ys, "o-", label=arm_label(arm))
            for x, y, r in zip(xs, ys, pts):
                ax.annotate(f"{r['step']} ({100 * r['by_prompts'][name]['ar_loop_rate']:.0f}% loop)", (x, y),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        chosen = result.get("pick")
        if chosen and chosen["by_prompts"][name]["mr_tpf_non_loop"] is not None:
            ax.plot([100 * (chosen["heldout_ar_perplexity"] / base["heldout_ar_perplexity"] - 1)],
                    [chosen["by_prompts"][name]["mr_tpf_non_loop"]], "k*", ms=14, mfc="none",
                    label=f"pick: {arm_label(arm_of(chosen))}, {chosen['step']} steps")
        ax.axhline(base["by_prompts"][name]["mr_tpf_non_loop"], color="grey", ls=":",
                   label=f"tiny-base ({100 * base['by_prompts'][name]['ar_loop_rate']:.0f}% loop)")
        ax.axvline(100 * PPL_LIMIT, color="red", ls="--", lw=0.8, label="+10% perplexity")
        ax.set_xlabel("held-out AR perplexity change vs tiny-base (%)")
        ax.set_ylabel("MR tokens per forward, non-looping outputs")
        ax.set_title(f"{name} prompts (labels: step, loop rate)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", default=str(REPO / "runs" / "tiny-jf" / "round-1" / "trajectories"))
    parser.add_argument("--anchors", default="8,16,32,64",
                        help="arms as ANCHOR_WEIGHT[:AR_WEIGHT] (the AR CE on the model's own trajectories; "
                             "default 1), e.g. 8,16,16:0")
    parser.add_argument("--append", action="store_true",
                        help="add these arms to the sweep in --json (same steps, points and prompts; its base row)")
    parser.add_argument("--steps", type=int, default=360, help="steps of every arm's schedule")
    parser.add_argument("--points", type=int, default=3, help="measurements along each arm (evenly spaced)")
    parser.add_argument("--prompts", default="tune,heldout,humaneval",
                        help="prompt sets, the pick's first: tune, heldout (selfspec/data/prompts/heldout.jsonl), "
                             "eval, humaneval or a file")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="no training: re-pick and re-plot a finished sweep's JSON (rewritten in place)")
    args = parser.parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        first = next(iter(result["base"]["by_prompts"]))
        result["pick"] = pick(result["rows"], result["base"]["heldout_ar_perplexity"], first, result["steps"])
        Path(args.replot).write_text(json.dumps(result, indent=2) + "\n")
        if args.plot:
            plot(result, Path(args.plot))
        return 0

    import torch

    from selfspec.engines.hf import HFEngine
    from selfspec.training.jacobi_forcing.objective import JFObjective, parse_rounds
    from selfspec.training.jacobi_forcing.recipe import RECIPE
    from selfspec.training.loop import train
    from selfspec.training.recipes import HELDOUT_PROMPTS, measure_prompts
    from selfspec.training.jacobi_forcing.trajectories import is_complete

    if not is_complete(Path(args.trajectories)):
        parser.error(f"--trajectories {args.trajectories} is not a finished trajectory directory; collect it with "
                     "`selfspec train jf-trajectories --model tiny-base --out runs/tiny-jf/round-1/trajectories "
                     "--block-size 8 --num-prompts 2048` (about 11 minutes)")
    round_1 = parse_rounds(RECIPE.rounds)[0]  # the recipe's round the arms retrain
    block = round_1.block_size
    options = mr_options(block)
    base_engine = HFEngine.from_pretrained("tiny-base", dtype=torch.float32)
    sets = {name: measure_prompts(HELDOUT_PROMPTS if name == "heldout" else name, base_engine.tokenizer,
                                  args.num_prompts)[1] for name in args.prompts.split(",")}
    if args.append:
        result = json.loads(Path(args.json).read_text())
        if (result["steps"], result["num_prompts"], list(result["base"]["by_prompts"])) != (
                args.steps, args.num_prompts, list(sets)):
            parser.error(f"--append: {args.json} was swept with --steps {result['steps']} --num-prompts "
                         f"{result['num_prompts']} --prompts {','.join(result['base']['by_prompts'])}; give the same")
    else:
        result = {"trajectories": args.trajectories, "steps": args.steps, "num_prompts": args.num_prompts,
                  "mr_options": options, "base": measure_point(base_engine, sets, options), "rows": []}
    del base_engine
    stops = sorted({round(args.steps * (k + 1) / args.points) for k in range(args.points)})
    for arm in args.anchors.split(","):
        anchor, _, ar = arm.partition(":")
        anchor, ar_weight = float(anchor), float(ar) if ar else 1.0
        started = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = replace(RECIPE, rounds=None, round_fractions=None, trajectories=args.trajectories, block_size=block,
                          window=round_1.window, anchor_weight=anchor, anchor_model="tiny-base", ar_weight=ar_weight,
                          steps=args.steps,
                          time_budget_minutes=None, eval_every=0, save_every=0, out=str(Path(tmp) / "model"),
                          checkpoint_dir=str(Path(tmp) / "ck"), progress_bar=False)
            done = 0
            for stop in stops:
                res = train(JFObjective(replace(cfg, stop_after_steps=stop - done, resume="auto" if done else None)))
                done = stop
                engine = HFEngine(res["model"], res["tokenizer"])
                row = {"anchor_weight": anchor, "ar_weight": ar_weight, "step": stop,
                       **measure_point(engine, sets, options), "seconds": round(time.time() - started, 1)}
                result["rows"].append(row)
                print(f"anchor {anchor:<4g} AR CE {ar_weight:g} step {stop:4d} ppl {row['heldout_ar_perplexity']:.2f} "
                      f"({100 * (row['heldout_ar_perplexity'] / result['base']['heldout_ar_perplexity'] - 1):+.1f}%) "
                      + " ".join(f"{n}: MR {p['mr_tpf']:.2f} no-loop {p['mr_tpf_non_loop'] or 0:.2f} "
                                 f"loop {100 * p['ar_loop_rate']:.0f}% =AR {100 * p['equals_greedy_ar']:.0f}%"
                                 for n, p in row["by_prompts"].items()), flush=True)
    first = args.prompts.split(",")[0]
    result["pick"] = pick(result["rows"], result["base"]["heldout_ar_perplexity"], first, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
