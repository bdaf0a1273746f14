"""The OPD comparison run: the same teacher, student, steps and seed with the rollout backend the
only difference (seed 001's claim: HB-SJD cuts rollout time, quality stays).

    selfspec train opd-compare --out runs/opd-compare [--steps 300] [--verify greedy] [--eval-images 1000]

For each backend (`ar`, `hbsjd`) it trains `selfspec train opd` with checkpoints at the early,
middle and late thirds, then reports: rollout, training and end-to-end time, the student's image
quality before and after (FID / IS / precision / recall / class accuracy on `--eval-images`
samples against the 5,000 real digits) and the speedups of the rollout phase and of the whole run.
The checkpoint-stage check re-times one batch of rollouts (AR vs HB-SJD, CPU time, median of 3)
on the HB-SJD run's early, middle and late checkpoints. Writes `compare.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch


def _checkpoint_model(checkpoint: Path, like: torch.nn.Module) -> torch.nn.Module:
    import copy

    from safetensors.torch import load_file

    model = copy.deepcopy(like)
    weights = checkpoint / "accelerate" / "model.safetensors"
    model.load_state_dict(load_file(weights), strict=False)
    return model.eval()


def stage_speedups(run_dir: Path, student: str, batch: int, prefix_ratio: float, window: int, gamma: int,
                   cfg_scale: float, repeats: int = 3) -> list[dict]:
    """HB-SJD vs cached AR rollout CPU time on each saved checkpoint of a run."""
    from selfspec.engines.rollout import ImageRolloutEngine, RolloutConfig
    from selfspec.images import load_image_model, prefix_codes

    im = load_image_model(student)
    labels = torch.arange(batch) % 10
    prefix = prefix_codes(im, labels, prefix_ratio)
    out = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step-*")):
        model = _checkpoint_model(ckpt, im.model)
        engine = ImageRolloutEngine(model, im.layout)
        times = {}
        for name, cfg in {"ar": RolloutConfig(window=0, cfg_scale=cfg_scale),
                          "hbsjd": RolloutConfig(window=window, execution="hybrid", gamma=gamma,
                                                 cfg_scale=cfg_scale)}.items():
            cpu = []
            for _ in range(repeats):
                start = time.process_time()
                res = engine.rollout(labels, prefix, cfg)
                cpu.append(time.process_time() - start)
            times[name] = (statistics.median(cpu), res.rounds)
        out.append({"checkpoint": ckpt.name, "ar_cpu_s": round(times["ar"][0], 3),
                    "hbsjd_cpu_s": round(times["hbsjd"][0], 3), "hbsjd_rounds": times["hbsjd"][1],
                    "speedup": round(times["ar"][0] / times["hbsjd"][0], 3)})
    return out


def compare(base, out: Path) -> dict:
    from selfspec.training.opd import train_opd

    runs = {}
    for backend in ("ar", "hbsjd"):
        run_dir = out / backend
        cfg = replace(base, rollout=backend, out=str(run_dir / "model"), checkpoint_dir=str(run_dir / "checkpoints"),
                      save_every=max(1, base.steps // 3), keep_checkpoints=3, name=f"opd-{backend}")
        started = time.time()
        result = train_opd(cfg)
        state = result["state"]
        history = state["history"]
        runs[backend] = {"rollout_s": round(state.get("rollout_seconds", 0.0), 1),
                         "train_s": round(state["elapsed_s"], 1), "end_to_end_s": round(time.time() - started, 1),
                         "before": state.get("base_eval"), "after": history[-1]["heldout"] if history else None,
                         "steps": state["step"]}
    ar, hb = runs["ar"], runs["hbsjd"]
    gamma = json.loads((out / "hbsjd" / "model" / "provenance.json").read_text()).get("gamma") or 0
    report = {"config": {k: v for k, v in vars(base).items() if not k.startswith("_")}, "runs": runs,
              "rollout_speedup": round(ar["rollout_s"] / max(hb["rollout_s"], 1e-9), 3),
              "end_to_end_speedup": round(ar["end_to_end_s"] / max(hb["end_to_end_s"], 1e-9), 3),
              "rollout_share_ar": round(ar["rollout_s"] / max(ar["train_s"], 1e-9), 3),
              "stages": stage_speedups(out / "hbsjd", base.student, base.batch_size, base.prefix_ratio, base.window,
                                       gamma, base.cfg_scale)}
    share, s = report["rollout_share_ar"], report["rollout_speedup"]
    report["end_to_end_speedup_predicted"] = round(1 / (1 - share + share / s), 3) if s > 0 else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def format_report(r: dict) -> str:
    lines = [f"{'backend':8} {'rollout s':>9} {'train s':>8} {'e2e s':>7}  quality before -> after (FID, IS, P, R, class acc)"]
    for name, run in r["runs"].items():
        b, a = run["before"] or {}, run["after"] or {}
        q = lambda m: f"{m.get('fid', float('nan')):.2f}, {m.get('inception_score', float('nan')):.2f}, " \
                      f"{m.get('precision', float('nan')):.2f}, {m.get('recall', float('nan')):.2f}, " \
                      f"{m.get('conditional_accuracy', float('nan')):.2%}"  # noqa: E731
        lines.append(f"{name:8} {run['rollout_s']:9.1f} {run['train_s']:8.1f} {run['end_to_end_s']:7.1f}  {q(b)} -> {q(a)}")
    lines.append(f"rollout speedup {r['rollout_speedup']}x, end to end {r['end_to_end_speedup']}x "
                 f"(predicted from the rollout share {r['rollout_share_ar']:.0%}: {r['end_to_end_speedup_predicted']}x)")
    for st in r["stages"]:
        lines.append(f"  {st['checkpoint']}: HB-SJD {st['hbsjd_cpu_s']} s vs AR {st['ar_cpu_s']} s CPU -> {st['speedup']}x")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from selfspec.training import config as C
    from selfspec.training.opd import OPDConfig

    p.add_argument("--out", required=True, help="directory of both runs and compare.json")
    C.add_arguments(p, OPDConfig, only=("teacher", "student", "verify", "objective", "steps", "batch_size",
                                        "prefix_ratio", "window", "eval_images", "eval_every", "seed", "lr"),
                    overrides=True)


def run(args: argparse.Namespace) -> int:
    from selfspec.training import config as C
    from selfspec.training.opd import OPDConfig

    base = OPDConfig(out=str(Path(args.out) / "unused"), steps=300, eval_every=0, eval_images=1000)
    base = replace(base, **C.given_options(OPDConfig, args))
    report = compare(base, Path(args.out))
    print(format_report(report))
    return 0
