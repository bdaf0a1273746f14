"""The embedded `tiny-jf`: Jacobi Forcing of tiny-base, and its measurement.

    selfspec train tiny-jf                # the committed recipe (one round, n = 8, anchored to tiny-base)
    python -m selfspec.training.jacobi_forcing.recipe measure tiny-jf

Work files (trajectories, round-1 model, checkpoints) go to runs/tiny-jf/ under the working
directory; the export to selfspec/assets/tiny-jf/. After export the recipe measures on the
held-out prompts (selfspec/data/prompts/heldout.jsonl, 64 prompts x 128 new tokens, greedy, HF
engine fp32) for tiny-jf and tiny-base at the same settings:
- plain-Jacobi tokens per forward (TPF) at n = 8, 16, 32 (one block, no candidates, drafts
  initialised from the context) and multi-block + rejection recycling (MR) at the recommended
  settings, on all outputs and on the outputs that do not end in a repetition loop;
- whether every JACOBI output equals the model's own greedy AR output (it must: 100%);
- held-out AR perplexity (the stdlib held-out split) of both.
The numbers go into selfspec.json (`metrics.measured`) and provenance.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from selfspec.models import ASSETS_DIR
from selfspec.paths import check_package_write, runs_dir
from selfspec.training import config as C
from selfspec.training.jacobi_forcing.objective import JFConfig, train_jf
from selfspec.training.recipes import (
    HELDOUT_PROMPTS, add_measure_parser, finalize_provenance, measure_prompts, record_measurement, run_measure,
)

NAME = "tiny-jf"
RECIPE = JFConfig(
    base="tiny-base", out=str(ASSETS_DIR / NAME), name=NAME, base_ref="tiny-base",
    rounds=["8:8:2048"], round_fractions=[1.0], num_prompts=2048, heldout_prompts=64,
    prompt_tokens=64, new_tokens=128, schedule="progressive", context="nc", ar_weight=0.0, anchor_weight=16.0,
    anchor_model="tiny-base", batch_size=8, steps=360, time_budget_minutes=None, lr=3e-4, min_lr_ratio=0.05,
    warmup_ratio=0.03, grad_clip=1.0, eval_every=200, eval_tokens=16384, save_every=200, serve_max_blocks=2,
    serve_verify_size=4, serve_spawn_ratio=0.85, checkpoint_dir=str(runs_dir(NAME)), seed=0, threads=2,
)
RECIPE_OPTIONS = ("out", "time_budget_minutes", "steps", "resume", "seed")

PLAIN = {"max_blocks": 1, "verify_size": 0, "init": "context"}


def _jacobi_row(engine, prompts, max_new_tokens: int, options: dict, reference: list[list[int]]) -> dict:
    from selfspec.benchmarks.repetition import OutputStat, non_loop_summary
    from selfspec.decoding.metrics import aggregate

    outs = engine.generate(prompts, max_new_tokens=max_new_tokens, mode="jacobi", mode_config=options, batch_size=16)
    agg = aggregate(o.metrics for o in outs)
    stats = [OutputStat(o.token_ids, o.metrics.forwards) for o in outs]
    return {"options": options, "tpf": agg["tokens_per_forward"],
            "equals_greedy_ar": sum(o.token_ids == r for o, r in zip(outs, reference)) / len(prompts),
            "non_loop": {k: v for k, v in non_loop_summary(stats).items() if k in ("outputs", "tpf")}}


def measure(name_or_path: str, base: str = "tiny-base", prompts_file: str | Path = HELDOUT_PROMPTS,
            max_new_tokens: int = 128, num_prompts: int = 64) -> dict:
    from selfspec.benchmarks.repetition import is_repetition_loop
    from selfspec.engines.hf import HFEngine
    from selfspec.training.evaluate import heldout_ar_perplexity

    started = time.time()
    out: dict = {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "engine": "hf (fp32, CPU)",
                 "models": {}}
    for label, ref in (("trained", name_or_path), ("base", base)):
        engine = HFEngine.from_pretrained(ref, dtype=torch.float32)
        out["prompts"], prompts = measure_prompts(prompts_file, engine.tokenizer, num_prompts)
        ar = engine.generate(prompts, max_new_tokens=max_new_tokens, mode="ar", batch_size=16)
        reference = [o.token_ids for o in ar]
        row = {"model": str(ref), "heldout_ar_perplexity": heldout_ar_perplexity(engine.model, engine.tokenizer)[
            "heldout_perplexity"], "ar_loop_rate": sum(map(is_repetition_loop, reference)) / len(reference),
               "plain": {}}
        for n in (8, 16, 32):
            row["plain"][str(n)] = _jacobi_row(engine, prompts, max_new_tokens, {**PLAIN, "block_size": n}, reference)
        meta = engine.metadata
        recommended = {k: v for k, v in (meta.jacobi.__dict__ if meta and meta.jacobi else {}).items() if v is not None}
        mr = recommended or {"block_size": 16, "max_blocks": 2, "verify_size": 4, "spawn_ratio": 0.85}
        row["multi_block_recycling"] = _jacobi_row(engine, prompts, max_new_tokens, mr, reference)
        row["cpu_default"] = _jacobi_row(engine, prompts, max_new_tokens, {}, reference)
        out["models"][label] = row
        if label == "trained":  # tiny-base at tiny-jf's recommended settings
            base_mr = mr
        else:
            row["multi_block_recycling"] = _jacobi_row(engine, prompts, max_new_tokens, base_mr, reference)
    t, b = out["models"]["trained"], out["models"]["base"]
    out["heldout_ar_perplexity_change"] = t["heldout_ar_perplexity"] / b["heldout_ar_perplexity"] - 1
    out["seconds"] = round(time.time() - started, 1)
    return out


def format_measurement(m: dict) -> str:
    lines = [f"held-out AR perplexity {m['models']['trained']['heldout_ar_perplexity']:.3f} vs base "
             f"{m['models']['base']['heldout_ar_perplexity']:.3f} ({100 * m['heldout_ar_perplexity_change']:+.2f}%)",
             f"{'model':8s} {'setting':34s} {'TPF':>6s} {'TPF no-loop':>12s} {'=greedy AR':>10s}"]
    for label, row in m["models"].items():
        items = [(f"plain n={n}", r) for n, r in row["plain"].items()]
        items += [("MR " + ",".join(f"{k}={v}" for k, v in row["multi_block_recycling"]["options"].items()),
                   row["multi_block_recycling"]), ("CPU default (JacobiConfig())", row["cpu_default"])]
        for name, r in items:
            nl = r["non_loop"]
            nl_text = "-" if nl["tpf"] is None else f"{nl['tpf']:.3f} ({nl['outputs']})"
            lines.append(f"{label:8s} {name[:34]:34s} {r['tpf']:6.3f} {nl_text:>12s} {100 * r['equals_greedy_ar']:9.1f}%")
        lines.append(f"{label:8s} greedy AR outputs that loop: {100 * row['ar_loop_rate']:.1f}%")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, JFConfig, only=RECIPE_OPTIONS, overrides=True)
    parser.add_argument("--no-measure", action="store_true", help="skip the measurement after export")


def run_recipe(args: argparse.Namespace | None = None) -> dict:
    cfg = RECIPE
    if args is not None:
        cfg = replace(cfg, **{k: v for k, v in C.given_options(JFConfig, args).items() if k in RECIPE_OPTIONS})
    check_package_write(cfg.out, f"selfspec train {NAME}")
    result = train_jf(cfg)
    if result.get("interrupted"):
        return result
    command = " ".join(["selfspec", "train", NAME] + (sys.argv[2:] if sys.argv[1:2] == [NAME] else sys.argv[3:]))
    out = Path(cfg.out)
    record_rounds(out, cfg, command, result["rounds"])
    if args is None or not getattr(args, "no_measure", False):
        measured = measure(cfg.out)
        record_measurement(out, measured)
        print(format_measurement(measured))
        result["measured"] = measured
    return result


def record_rounds(out: Path, cfg: JFConfig, command: str, rounds: list[dict]) -> None:
    """The export records its last round's config; write the whole recipe (rounds included) into
    selfspec.json and provenance.json, and each earlier round's training history."""
    from dataclasses import asdict

    from selfspec.checkpoints.metadata import load_metadata
    from selfspec.training.recipes import _relative

    finalize_provenance(out, command)
    whole = {k: _relative(v) for k, v in asdict(cfg).items()}
    meta = load_metadata(out)
    meta.recipe["last_round_config"] = meta.recipe.pop("config", None)
    meta.recipe["config"] = whole
    meta.write(out)
    prov_file = out / "provenance.json"
    prov = json.loads(prov_file.read_text())
    prov["last_round_config"], prov["config"] = prov.get("config"), whole
    prov["rounds"] = []
    for rnd in rounds:
        rprov = Path(rnd["export"]) / "provenance.json" if rnd.get("export") else None
        entry = {k: _relative(v) for k, v in rnd.items() if k != "history"}
        if rprov is not None and rprov.exists() and Path(rnd["export"]) != out:
            entry["history"] = json.loads(rprov.read_text()).get("history")
        prov["rounds"].append(entry)
    prov_file.write_text(json.dumps(prov, indent=2, default=str) + "\n")


def run(args: argparse.Namespace) -> int:
    run_recipe(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.jacobi_forcing.recipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(NAME, help=f"train {NAME}")
    add_arguments(p)
    add_measure_parser(sub, "measure a Jacobi Forcing model beside tiny-base and record the numbers")
    args = parser.parse_args(argv)
    if args.command == "measure":
        return run_measure(args, measure, format_measurement)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
