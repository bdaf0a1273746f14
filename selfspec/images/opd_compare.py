"""The OPD comparison run: the same teacher, student, steps and seed with the rollout backend the
only difference (the HB-SJD paper's claim: HB-SJD cuts rollout time, quality stays).

    selfspec train opd-compare --out runs/opd-compare [--steps 600] [--verify greedy] [--eval-images 1000]

For each backend (`ar`, `hbsjd`) it trains `selfspec train opd` with checkpoints at the early,
middle and late thirds, then reports: rollout, training and end-to-end time, the student's image
quality before and after (FID / IS / precision / recall / class accuracy on `--eval-images`
samples against the 5,000 real digits) and the speedups of the rollout phase, the training
loop and the whole run; the largest weight difference between the two students (greedy:
training identical up to floating-point ties) and the metrics' sampling noise. The
checkpoint-stage check re-times one batch of rollouts (AR vs HB-SJD, CPU time, median of 3) on
the HB-SJD run's early, middle and late checkpoints. Writes `compare.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from selfspec.errors import UsageError


def _checkpoint_model(checkpoint: Path, like: torch.nn.Module) -> torch.nn.Module:
    import copy

    from safetensors.torch import load_file

    model = copy.deepcopy(like)
    weights = checkpoint / "accelerate" / "model.safetensors"
    model.load_state_dict(load_file(weights), strict=False)
    return model.eval()


def stage_speedups(run_dir: Path, base, costs, repeats: int = 3) -> list[dict]:
    """HB-SJD vs cached AR rollout CPU time on each saved checkpoint of a run (`base`: its OPDConfig;
    `costs`: the Hybrid execution's `hbsjd.CompactionCosts`)."""
    from selfspec.images.rollout import ImageRolloutEngine
    from selfspec.images.model import load_image_model, prefix_codes
    from selfspec.images.opd import rollout_config

    im = load_image_model(base.student)
    labels = torch.arange(base.batch_size) % 10
    prefix = prefix_codes(im, labels, base.prefix_ratio)
    out = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step-*")):
        model = _checkpoint_model(ckpt, im.model)
        engine = ImageRolloutEngine(model, im.layout)
        times, codes = {}, {}
        for name in ("ar", "hbsjd"):
            cfg = rollout_config(base, name, costs)
            cpu = []
            for _ in range(repeats):
                start = time.process_time()
                res = engine.rollout(labels, prefix, cfg, seed=0)
                cpu.append(time.process_time() - start)
            times[name], codes[name] = (statistics.median(cpu), res.rounds), res.codes
        same = (codes["ar"] == codes["hbsjd"]).all(1).float().mean().item()
        out.append({"checkpoint": ckpt.name, "ar_cpu_s": round(times["ar"][0], 3),
                    "hbsjd_cpu_s": round(times["hbsjd"][0], 3), "hbsjd_rounds": times["hbsjd"][1],
                    "speedup": round(times["ar"][0] / times["hbsjd"][0], 3), "identical_images": round(same, 4)})
    return out


QUALITY = ("fid", "inception_score", "precision", "recall", "conditional_accuracy", "heldout_loss")


def _max_weight_difference(a: Path, b: Path) -> float:
    """Largest absolute difference between two exported students' weights (0: identical training)."""
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def compare(base, out: Path) -> dict:
    """Both runs, then the report. Times: `rollout_s` the student's rollouts; `loop_s` the training
    loop without the periodic evaluations (rollouts + distillation steps); `end_to_end_s` the
    whole command (loading, cost calibration, evaluations, export). The predicted loop speedup is
    Amdahl's from the AR loop's rollout share and the measured rollout speedup."""
    from selfspec.images.opd import train_opd

    for backend in ("ar", "hbsjd"):
        if any((out / backend / "checkpoints").glob("step-*")):
            raise UsageError(f"{out / backend} already holds a run (its checkpoints would mix into the stage "
                             "check); pass a new --out directory")
    runs, noise, costs = {}, None, {}
    for backend in ("ar", "hbsjd"):
        run_dir = out / backend
        cfg = replace(base, rollout=backend, out=str(run_dir / "model"), checkpoint_dir=str(run_dir / "checkpoints"),
                      save_every=max(1, base.steps // 3), keep_checkpoints=3, name=f"opd-{backend}")
        started = time.time()
        result = train_opd(cfg)
        end_to_end = time.time() - started
        state, objective = result["state"], result["objective"]
        costs[backend] = objective.rollout_config.costs
        history = state["history"]
        # The loop's clock counts the periodic evaluations, not the one before training (a fresh run's first).
        periodic = sum(objective.eval_durations[1:])
        # The state's sum is stamped at each step's start; the objective's includes the last step.
        rollout_s = max(state.get("rollout_seconds", 0.0), objective.rollout_seconds or 0.0)
        runs[backend] = {"rollout_s": round(rollout_s, 3),
                         "loop_s": round(state["elapsed_s"] - periodic, 3),
                         "eval_s": round(sum(objective.eval_durations), 1), "end_to_end_s": round(end_to_end, 1),
                         "before": state.get("base_eval"), "after": history[-1]["heldout"] if history else None,
                         "steps": state["step"]}
        if noise is None:  # the sampling noise of the metrics: the untrained student under a second seed
            second = objective.evaluate(objective.build_model(torch.device("cpu")), seed=54321)
            first = state.get("base_eval") or {}
            noise = {k: round(abs(second[k] - first[k]), 4) for k in QUALITY if k in first and k in second}
    ar, hb = runs["ar"], runs["hbsjd"]
    report = {"config": {k: v for k, v in vars(base).items() if not k.startswith("_")}, "runs": runs,
              "rollout_speedup": round(ar["rollout_s"] / max(hb["rollout_s"], 1e-9), 3),
              "loop_speedup": round(ar["loop_s"] / max(hb["loop_s"], 1e-9), 3),
              "end_to_end_speedup": round(ar["end_to_end_s"] / max(hb["end_to_end_s"], 1e-9), 3),
              "rollout_share_ar": round(ar["rollout_s"] / max(ar["loop_s"], 1e-9), 3),
              "metric_noise": noise,
              "max_weight_difference": _max_weight_difference(out / "ar" / "model", out / "hbsjd" / "model"),
              "stages": stage_speedups(out / "hbsjd", base, costs["hbsjd"])}
    share, s = report["rollout_share_ar"], report["rollout_speedup"]
    report["loop_speedup_predicted"] = round(1 / (1 - share + share / s), 3) if s > 0 else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def format_report(r: dict) -> str:
    def q(m: dict | None) -> str:
        m = m or {}
        return (f"{m.get('fid', float('nan')):.1f}, {m.get('inception_score', float('nan')):.2f}, "
                f"{m.get('precision', float('nan')):.3f}, {m.get('recall', float('nan')):.3f}, "
                f"{m.get('conditional_accuracy', float('nan')):.1%}, {m.get('heldout_loss', float('nan')):.3f}")

    lines = [f"{'backend':8} {'rollout s':>9} {'loop s':>7} {'eval s':>7} {'e2e s':>7}  "
             "before -> after (FID, IS, precision, recall, class acc, held-out nats/code)"]
    for name, run in r["runs"].items():
        lines.append(f"{name:8} {run['rollout_s']:9.1f} {run['loop_s']:7.1f} {run['eval_s']:7.1f} "
                     f"{run['end_to_end_s']:7.1f}  {q(run['before'])} -> {q(run['after'])}")
    lines.append(f"rollout speedup {r['rollout_speedup']}x; training loop {r['loop_speedup']}x (predicted from the "
                 f"AR loop's rollout share {r['rollout_share_ar']:.0%}: {r['loop_speedup_predicted']}x); "
                 f"end to end {r['end_to_end_speedup']}x")
    lines.append(f"max |weight difference| between the two students: {r['max_weight_difference']:.3g}; "
                 f"metric noise (untrained student, second seed): {r['metric_noise']}")
    for st in r["stages"]:
        same = (f" ({st['identical_images']:.0%} of the images identical to AR's)"
                if r["config"].get("verify") == "greedy" and "identical_images" in st else "")
        lines.append(f"  {st['checkpoint']}: HB-SJD {st['hbsjd_cpu_s']} s vs AR {st['ar_cpu_s']} s CPU -> "
                     f"{st['speedup']}x{same}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from selfspec.training import config as C
    from selfspec.images.opd import OPDConfig

    p.add_argument("--out", required=True, help="directory of both runs and compare.json")
    C.add_arguments(p, OPDConfig, only=("teacher", "student", "verify", "temperature", "objective", "steps",
                                        "batch_size", "prefix_ratio", "window", "eval_images", "eval_every", "seed",
                                        "lr"), overrides=True)


def run(args: argparse.Namespace) -> int:
    from selfspec.training import config as C
    from selfspec.images.opd import OPDConfig

    base = OPDConfig(out=str(Path(args.out) / "unused"), steps=600, eval_every=0, eval_images=1000)
    base = replace(base, **C.given_options(OPDConfig, args))
    report = compare(base, Path(args.out))
    print(format_report(report))
    return 0
