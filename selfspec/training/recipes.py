"""Recipes of the embedded I-DLM models, and their measurement.

    selfspec train tiny-idlm        # full I-DLM conversion of tiny-base, curriculum N = 2 -> 3 -> 4
    selfspec train tiny-idlm-lora   # gated LoRA over a frozen tiny-base (RISD), same curriculum

Each trains with `selfspec.training.idlm.objective` on the stdlib corpus (tiny-base's train split) mixed
50/50 with on-policy data (tiny-base's own greedy continuations of train-split prompts, MASK half
only; generated first if missing, see `SELFGEN`) under a wall-clock budget (the step plan adapts to the machine's speed so the schedule always anneals),
exports to `selfspec/assets/<name>/` (checkpoints go to runs/<name>/ under the working directory),
then measures on the held-out prompts (`selfspec/data/prompts/heldout.jsonl`, package data) with
the HF engine and writes the
numbers into the export's selfspec.json (`metrics.measured`) and provenance.json:
- held-out perplexity of the AR path (plain causal forward) beside tiny-base's;
- TPF of AR, ISD at N = 2, 3, 4 (greedy; temperature 1 with tau = 0 and tau = 1) or RISD, and
  whether greedy ISD / RISD reproduced the greedy AR output token for token;
- alpha, the introspective acceptance rate: the share of the model's own MASK proposals that
  its verify step (p/q acceptance against the causal path) accepts.
`python -m selfspec.training.recipes measure tiny-idlm` re-runs the measurement alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from selfspec.kernels.lora_gate import model_gate
from selfspec.decoding import registry
from selfspec.checkpoints.metadata import load_metadata
from selfspec.models import ASSETS_DIR
from selfspec.paths import check_package_write, recorded_path, runs_dir
from selfspec.prompts import HELDOUT_PROMPTS
from selfspec.training import config as C
from selfspec.training.idlm.objective import IDLMConfig, train_idlm


@dataclass(frozen=True)
class SelfgenSpec:
    """On-policy data of a recipe: `model`'s greedy continuations of `num` prompts cut from the
    train split (`selfspec.training.selfgen`), mixed with the corpus; they train the MASK half
    only (the clean / AR half learns from the corpus alone). The file name carries the count, so
    a recipe never picks up another recipe's (smaller) file; with the same seed the first records
    of a larger file are those of a smaller one."""

    model: str = "tiny-base"
    num: int = 1024
    prompt_tokens: int = 128
    new_tokens: int = 128
    seed: int = 0

    @property
    def file(self) -> Path:
        return runs_dir("selfgen", f"{self.model}-n{self.num}.jsonl")

    def command(self) -> str:
        return (f"python -m selfspec.training.selfgen --model {self.model} --out {_relative(str(self.file))} "
                f"--num {self.num} --prompt-tokens {self.prompt_tokens} --new-tokens {self.new_tokens} "
                f"--seed={self.seed}")

    def ensure(self) -> None:
        if not self.file.exists():
            from selfspec.training.selfgen import generate_selfgen

            generate_selfgen(self.model, self.file, self.num, self.prompt_tokens, self.new_tokens, seed=self.seed)


# tiny-idlm's run (about 1,900 steps, 4 on-policy rows each) sees its 8,192 continuations about once;
# the LoRA recipe keeps its 1,024 (each seen about 5 times), which its committed adapter was trained on.
SELFGEN: dict[str, SelfgenSpec] = {"tiny-idlm": SelfgenSpec(num=8192), "tiny-idlm-lora": SelfgenSpec(num=1024)}

RECIPES: dict[str, IDLMConfig] = {
    "tiny-idlm": IDLMConfig(
        base="tiny-base", out=str(ASSETS_DIR / "tiny-idlm"), name="tiny-idlm", base_ref="tiny-base",
        stride=4, curriculum=[2, 3, 4], stage_fractions=[0.15, 0.2, 0.65],
        data=["stdlib", str(SELFGEN["tiny-idlm"].file)], data_weights=[0.5, 0.5],
        seq_len=256, batch_size=8, steps=4000, time_budget_minutes=56.0,
        lr=5e-4, min_lr_ratio=0.05, warmup_ratio=0.03, weight_decay=0.0, grad_clip=1.0,
        ce_scale=0.2, auto_balance_from=4, ar_anchor_weight=1.0, eval_every=200, eval_tokens=16384, save_every=200,
        checkpoint_dir=str(runs_dir("tiny-idlm")), seed=0, threads=1, mixed_precision="bf16",
    ),
    "tiny-idlm-lora": IDLMConfig(
        base="tiny-base", out=str(ASSETS_DIR / "tiny-idlm-lora"), name="tiny-idlm-lora", base_ref="tiny-base",
        stride=4, curriculum=[2, 3, 4], stage_fractions=[0.15, 0.2, 0.65],
        lora_rank=64, lora_alpha=128.0,
        data=["stdlib", str(SELFGEN["tiny-idlm-lora"].file)], data_weights=[0.5, 0.5],
        seq_len=256, batch_size=8, steps=3000, time_budget_minutes=28.0,
        lr=3e-3, min_lr_ratio=0.05, warmup_ratio=0.03, weight_decay=0.0, grad_clip=1.0,
        eval_every=100, eval_tokens=16384, save_every=200,
        checkpoint_dir=str(runs_dir("tiny-idlm-lora")), seed=0, threads=1, mixed_precision="bf16",
    ),
}


# ------------------------------------------------------------------------------ measurement
def measure_prompts(prompts: str | Path, tokenizer, limit: int) -> tuple[str, list[list[int]]]:
    """(how a measurement names its prompts, their token ids): a prompt set (`selfspec.prompts`:
    tune, eval, humaneval, external) or a JSON-lines file, the first `limit` prompts."""
    from selfspec.prompts import SET_NAMES, load_prompts

    label = str(prompts) if str(prompts) in SET_NAMES else recorded_path(str(Path(prompts).resolve()))
    return label, load_prompts(prompts, tokenizer, limit)[1]


def measure(name_or_path: str, prompts_file: str | Path = HELDOUT_PROMPTS, max_new_tokens: int = 128,
            num_prompts: int = 64, alpha_prompts: int = 32) -> dict:
    from selfspec.engines.hf import HFEngine
    from selfspec.training.evaluate import (
        decode_tpf, heldout_ar_perplexity, introspective_acceptance,
    )

    started = time.time()
    engine = HFEngine.from_pretrained(name_or_path, dtype=torch.float32)
    meta = engine.metadata
    gated = meta is not None and registry.get(meta.mode).needs_adapter
    tok = engine.tokenizer
    label, prompts = measure_prompts(prompts_file, tok, num_prompts)
    mask_id = engine.resolve_mask_token()
    out: dict = {"prompts": label, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
                 "engine": "hf (fp32, CPU)"}

    # held-out perplexity of the AR path, beside tiny-base's (the base of the conversion)
    base = HFEngine.from_pretrained(meta.base_model_path if gated else (meta.converted_from or "tiny-base"),
                                    dtype=torch.float32)
    base_ppl = heldout_ar_perplexity(base.model, base.tokenizer)
    ppl = base_ppl if gated else heldout_ar_perplexity(engine.model, tok)
    out["heldout_ar_perplexity"] = ppl["heldout_perplexity"]
    out["base_heldout_ar_perplexity"] = base_ppl["heldout_perplexity"]
    out["heldout_ar_perplexity_change"] = ppl["heldout_perplexity"] / base_ppl["heldout_perplexity"] - 1
    out["heldout_tokens"] = ppl["tokens"]

    ar_ref = base if gated else engine  # greedy reference: RISD must equal the base's greedy AR output
    rows = [decode_tpf(ar_ref, prompts, "ar", max_new_tokens)]
    ar_greedy = rows[0]["outputs"]
    mode = "risd" if gated else "isd"
    for n in (2, 3, 4):
        g = decode_tpf(engine, prompts, mode, max_new_tokens, stride=n)
        g["greedy_equals_ar"] = sum(a == b for a, b in zip(g["outputs"], ar_greedy)) / len(prompts)
        rows.append(g)
        for tau in (0.0, 1.0):
            rows.append(decode_tpf(engine, prompts, mode, max_new_tokens, stride=n, tau=tau, temperature=1.0))
    for r in rows:
        r.pop("outputs")
    out["decode"] = rows

    # introspective acceptance of the proposals: temperature 1, a sampling server's 0.7, greedy
    gate = None
    if gated:
        engine.build_mode("risd")  # attaches the adapter (once) and its gate
        gate = model_gate(engine.model)
    alpha = {}
    for n in (2, 3, 4):
        for temp in (1.0, 0.7, 0.0):
            a = introspective_acceptance(engine.model, prompts[:alpha_prompts], n, mask_id, new_tokens=64,
                                         temperature=temp, seed=0, gate=gate)
            alpha[f"N={n},T={temp:g}"] = {"alpha": a["alpha"], "by_offset": a["alpha_by_offset"],
                                         "proposals": a["proposals"]}
    out["alpha"] = alpha
    out["alpha_prompts"] = alpha_prompts
    out["seconds"] = round(time.time() - started, 1)
    return out


def _relative(value):
    """Paths in a recorded config as `paths.recorded_path` writes them (lists item by item)."""
    if isinstance(value, list):
        return [_relative(v) for v in value]
    return recorded_path(value) if isinstance(value, str) else value


def finalize_provenance(model_dir: Path, command: str, selfgen: SelfgenSpec | None = None) -> None:
    """Record the recipe's own command, and machine-independent paths, in selfspec.json and
    provenance.json (the training code records what it was given)."""
    meta = load_metadata(model_dir)
    meta.recipe["command"] = command
    if "config" in meta.recipe:
        meta.recipe["config"] = {k: _relative(v) for k, v in meta.recipe["config"].items()}
    meta.write(model_dir)
    prov_file = model_dir / "provenance.json"
    if prov_file.exists():
        prov = json.loads(prov_file.read_text())
        prov["command"] = command
        prov["config"] = {k: _relative(v) for k, v in prov.get("config", {}).items()}
        if "base" in prov:
            prov["base"]["path"] = _relative(prov["base"]["path"])
        if selfgen is not None and _relative(str(selfgen.file)) in (prov.get("config", {}).get("data") or []):
            prov["selfgen"] = {**asdict(selfgen), "file": _relative(str(selfgen.file)), "command": selfgen.command()}
        prov_file.write_text(json.dumps(prov, indent=2, default=str) + "\n")


def record_measurement(model_dir: Path, measured: dict, prompt_set: str | None = None) -> None:
    """Merge the measurement into selfspec.json and provenance.json: under `measured` (the
    held-out prompts), or under `measured_by_prompts[prompt_set]` for another prompt set."""
    def merge(record: dict) -> None:
        if prompt_set is None:
            record["measured"] = measured
        else:
            record.setdefault("measured_by_prompts", {})[prompt_set] = measured

    meta = load_metadata(model_dir)
    merge(meta.metrics)
    meta.write(model_dir)
    prov_file = model_dir / "provenance.json"
    if prov_file.exists():
        prov = json.loads(prov_file.read_text())
        merge(prov)
        prov_file.write_text(json.dumps(prov, indent=2, default=str) + "\n")


def format_measurement(m: dict) -> str:
    lines = [f"held-out AR perplexity {m['heldout_ar_perplexity']:.3f} vs base {m['base_heldout_ar_perplexity']:.3f} "
             f"({100 * m['heldout_ar_perplexity_change']:+.2f}%)",
             f"{'mode':6s} {'N':>2s} {'T':>3s} {'tau':>4s} {'TPF':>6s} {'acc.len':>7s} {'greedy=AR':>9s}"]
    for r in m["decode"]:
        eq = r.get("greedy_equals_ar")
        lines.append(f"{r['mode']:6s} {r['stride'] or '-':>2} {r['temperature']:>3g} {r['tau']:>4g} {r['tpf']:6.3f} "
                     f"{r['mean_accepted_length']:7.3f} {'' if eq is None else f'{100 * eq:8.1f}%':>9s}")
    for k, v in m["alpha"].items():
        lines.append(f"alpha {k}: {v['alpha']:.3f} (by offset " + ", ".join(f"{a:.3f}" for a in v["by_offset"]) + ")")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
# what a recipe run may change; the distillation options let its variant with tempered MASK
# targets be retrained by the recipe's own command (docs/results.md, "Served step costs")
RECIPE_OPTIONS = ("out", "time_budget_minutes", "steps", "resume", "seed",
                  "mask_distill_weight", "mask_distill_temperatures")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """For `selfspec train tiny-idlm` and `selfspec train tiny-idlm-lora` (recipe chosen by the
    subcommand name, passed as `recipe`)."""
    C.add_arguments(parser, IDLMConfig, only=RECIPE_OPTIONS, overrides=True)  # default: the recipe's value
    parser.add_argument("--no-measure", action="store_true", help="skip the measurement after export")


def run_recipe(name: str, args: argparse.Namespace | None = None) -> dict:
    cfg = RECIPES[name]
    if args is not None:
        cfg = replace(cfg, **{k: v for k, v in C.given_options(IDLMConfig, args).items() if k in RECIPE_OPTIONS})
    check_package_write(cfg.out, f"selfspec train {name}")
    selfgen = SELFGEN.get(name)
    if selfgen is not None and str(selfgen.file) in (cfg.data or []):
        selfgen.ensure()
    result = train_idlm(cfg)
    command = " ".join(["selfspec", "train", name] + (sys.argv[2:] if sys.argv[1:2] == [name] else sys.argv[3:]))
    finalize_provenance(Path(cfg.out), command, selfgen)
    if args is None or not getattr(args, "no_measure", False):
        measured = measure(cfg.out)
        record_measurement(Path(cfg.out), measured)
        print(format_measurement(measured))
        result["measured"] = measured
    return result


def run(args: argparse.Namespace) -> int:
    run_recipe(args.recipe, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.recipes", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in RECIPES:
        p = sub.add_parser(name, help=f"train {name}")
        add_arguments(p)
        p.set_defaults(recipe=name)
    add_measure_parser(sub, "measure an exported model and record the numbers in its metadata")
    args = parser.parse_args(argv)
    if args.command == "measure":
        return run_measure(args, measure, format_measurement)
    return run(args)


def add_measure_parser(sub, help: str) -> None:
    """The `measure MODEL` subcommand of a recipe module."""
    p = sub.add_parser("measure", help=help)
    p.add_argument("model", help="embedded name or export directory")
    p.add_argument("--no-record", action="store_true", help="print only; do not write the numbers into the model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompts", default=None,
                   help="a prompt set (tune, eval, humaneval, external) or a JSON-lines file (default: the held-out prompts, "
                        "selfspec/data/prompts/heldout.jsonl); another set is recorded under measured_by_prompts.SET")


def run_measure(args: argparse.Namespace, measure_fn, format_fn) -> int:
    from selfspec.models import resolve_model

    if not args.no_record:
        check_package_write(resolve_model(args.model), f"measure {args.model}", "add --no-record to only print")
    extra = {"prompts_file": args.prompts} if args.prompts else {}
    m = measure_fn(args.model, num_prompts=args.num_prompts, **extra)
    print(format_fn(m))
    if not args.no_record:
        record_measurement(resolve_model(args.model), m, m["prompts"] if args.prompts else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
