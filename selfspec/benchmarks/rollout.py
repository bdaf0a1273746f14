"""Rollout benchmark of image-token models: cached AR, Batch-Synchronous SJD and HB-SJD (seed 001).

    selfspec bench rollout --model tiny-c2i-student --batch 8,16,32,64 --window 8 \\
        --prefix-ratio 0.5 --repeats 3 --out runs/bench-rollout [--sweeps w,h,gamma,prefix]

Every batch completes real held-out digits from their first `prefix-ratio` of codes, under CFG
2.0, in each arm: `ar` (cached AR), `sync-lockstep` (the batch advances by its minimum accepted
length, what the public SJD code does), `sync-window` (fixed windows, the seed's Fig. 2a),
`hbsjd-full` / `hbsjd-compact` / `hbsjd-hybrid` (Independent HB-SJD, γ from the
`calibrate-gamma` rule measured in the same run); greedy, and probabilistic (SJD p/q
verification vs AR sampling at T = 1) for AR and Hybrid. Per arm: CPU time (median of
`--repeats` runs; the 2 cores are shared, so CPU time is the figure to compare) and wall time,
the mean and p95 latency at which images finish, verification rounds, committed tokens per
image-round split into background (the empty patch code) and foreground, and greedy equality
with AR. Sweeps: W at every batch size (Hybrid, γ as calibrated for --window), and at the first
batch size H, γ (±25% and more around the calibrated value) and prefix ratio. Writes `rollout.json` and `rollout.png` under --out.

JSON schema ("selfspec.bench.rollout/v1"): {"schema", "model", "cfg", "prefix_ratio", "window",
"history_offset", "repeats", "threads", "gamma": {B: γ}, "rows": [{"batch", "arm", "verify",
"window", "history_offset", "gamma", "prefix_ratio", "cpu_s", "wall_s", "mean_latency_s",
"p95_latency_s", "rounds", "tokens_per_round", "foreground_per_round", "background_per_round",
"speedup_vs_ar_cpu", "speedup_vs_ar_wall", "equal_to_ar" (greedy) | null, "sweep": null | "w" | "h" |
"gamma" | "prefix"}]}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.errors import UsageError

ARMS = {
    "ar": dict(window=0),
    "sync-lockstep": dict(schedule="lockstep", execution="compact"),
    "sync-window": dict(schedule="window", execution="compact"),
    "hbsjd-full": dict(execution="full"),
    "hbsjd-compact": dict(execution="compact"),
    "hbsjd-hybrid": dict(execution="hybrid"),
}


def timed_rollout(engine, labels, prefix, cfg, repeats: int, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """Median CPU and wall time of `repeats` identical rollouts, with the last run's statistics."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        res = engine.rollout(labels, prefix, cfg, seed=seed)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    stats = res.summary()
    stats.update(cpu_s=round(statistics.median(cpu), 4), wall_s=round(statistics.median(wall), 4))
    return stats, res.codes


def run_bench(model: str, batches: list[int], window: int, history_offset: int | None, prefix_ratio: float,
              cfg_scale: float, repeats: int, sweeps: list[str], out: Path, verify: list[str]) -> dict:
    from selfspec.engines.rollout import RolloutConfig
    from selfspec.training.image_model import load_image_model, prefix_codes
    from selfspec.training.gamma import calibrated_gamma

    im = load_image_model(model)
    engine = im.engine()
    lay = im.layout
    h = history_offset or lay.grid
    rows: list[dict] = []
    gammas: dict[int, int] = {}

    def one(batch, arm, verify_rule, w, hh, gamma, ratio, sweep, ar_ref):
        labels = torch.arange(batch) % 10
        prefix = prefix_codes(im, labels, ratio)
        opts = dict(window=w, history_offset=hh, verify=verify_rule, cfg_scale=cfg_scale, gamma=gamma)
        opts.update(ARMS[arm])
        stats, codes = timed_rollout(engine, labels, prefix, RolloutConfig(**opts), repeats)
        row = {"batch": batch, "arm": arm, "verify": verify_rule, "window": opts["window"], "history_offset": hh,
               "gamma": gamma if arm == "hbsjd-hybrid" else None, "prefix_ratio": ratio, "sweep": sweep, **stats}
        if ar_ref is not None:
            ref_stats, ref_codes = ar_ref
            row["speedup_vs_ar_cpu"] = round(ref_stats["cpu_s"] / stats["cpu_s"], 3)
            row["speedup_vs_ar_wall"] = round(ref_stats["wall_s"] / stats["wall_s"], 3)
            row["equal_to_ar"] = bool(torch.equal(codes, ref_codes)) if verify_rule == "greedy" else None
        rows.append(row)
        return stats, codes

    plan = [(b, v) for b in batches for v in verify]
    main_ar: dict[tuple[int, str], tuple] = {}
    with tqdm(total=len(plan), desc="bench rollout", unit="config") as bar:
        for batch, v in plan:
            if batch not in gammas:
                gammas[batch] = calibrated_gamma(im.model, batch, window, guided=cfg_scale != 1.0, repeats=repeats)[0]
            g = gammas[batch]
            ar = main_ar[(batch, v)] = one(batch, "ar", v, window, h, g, prefix_ratio, None, None)
            rows[-1].update(speedup_vs_ar_cpu=1.0, speedup_vs_ar_wall=1.0, equal_to_ar=True if v == "greedy" else None)
            arms = [a for a in ARMS if a != "ar"] if v == "greedy" else ["hbsjd-hybrid"]
            for arm in arms:
                one(batch, arm, v, window, h, g, prefix_ratio, None, ar)
            bar.update(1)
        b0 = batches[0]
        g0 = gammas[b0]
        sweep_plan = []  # (sweep, batch, W, H, γ, prefix ratio); W at every batch size, the rest at the first
        if "w" in sweeps:
            sweep_plan += [("w", b, w, h, gammas[b], prefix_ratio) for b in batches for w in (2, 4, 8, 16)
                           if w != window]
        if "h" in sweeps:
            sweep_plan += [("h", b0, window, hh, g0, prefix_ratio) for hh in (1, lay.grid // 2, 2 * lay.grid) if hh != h]
        if "gamma" in sweeps:
            values = sorted({max(0, min(b0, round(g0 * f))) for f in (0.5, 0.75, 1.25)} - {g0})
            sweep_plan += [("gamma", b0, window, h, g, prefix_ratio) for g in values]
        if "prefix" in sweeps:
            sweep_plan += [("prefix", b0, window, h, g0, r) for r in (0.2, 0.75) if r != prefix_ratio]
        refs = {(b, prefix_ratio): main_ar[(b, "greedy")] for b in batches if (b, "greedy") in main_ar}
        for sweep, b, w, hh, g, ratio in tqdm(sweep_plan, desc="sweeps", unit="config"):
            if (b, ratio) not in refs:  # AR at another prefix ratio, the reference of that row
                refs[(b, ratio)] = one(b, "ar", "greedy", w, hh, g, ratio, sweep, None)
            one(b, "hbsjd-hybrid", "greedy", w, hh, g, ratio, sweep, refs[(b, ratio)])
    result = {"schema": "selfspec.bench.rollout/v1", "model": model, "cfg": cfg_scale, "prefix_ratio": prefix_ratio,
              "window": window, "history_offset": h, "repeats": repeats, "threads": torch.get_num_threads(),
              "gamma": gammas, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "rollout.png")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in result["rows"] if r["sweep"] is None and r["verify"] == "greedy"]
    batches = sorted({r["batch"] for r in main})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm in ARMS:
        pts = [(r["batch"], r["speedup_vs_ar_cpu"], r["rounds"]) for r in main if r["arm"] == arm]
        if pts:
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm)
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=arm)
    best = best_window(result)
    if best:
        axes[0].plot(list(best), [b["speedup_vs_ar_cpu"] for b in best.values()], marker="*", ls="--",
                     label="hbsjd-hybrid, best W (" + "/".join(str(b["window"]) for b in best.values()) + ")")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(xscale="log", xticks=batches, xticklabels=[str(b) for b in batches], xlabel="batch (images)",
                ylabel="speedup vs cached AR (CPU time)", title=f"{result['model']}: greedy, W={result['window']}, "
                f"prefix {result['prefix_ratio']}")
    axes[1].set(xscale="log", xticks=batches, xticklabels=[str(b) for b in batches], xlabel="batch (images)",
                ylabel="verification rounds", title="rounds per rollout")
    for ax in axes:
        ax.minorticks_off()
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def best_window(result: dict) -> dict[int, dict]:
    """Per batch size, the greedy Hybrid row (main run or W sweep) with the best CPU-time speedup."""
    best: dict[int, dict] = {}
    for r in result["rows"]:
        if r["arm"] == "hbsjd-hybrid" and r["verify"] == "greedy" and r["sweep"] in (None, "w") \
                and r["prefix_ratio"] == result["prefix_ratio"]:
            if r["batch"] not in best or r["speedup_vs_ar_cpu"] > best[r["batch"]]["speedup_vs_ar_cpu"]:
                best[r["batch"]] = r
    return dict(sorted(best.items()))


def format_table(result: dict) -> str:
    head = f"{'batch':>5} {'arm':14} {'verify':6} {'W':>2} {'H':>2} {'γ':>3} {'pref':>4} {'cpu s':>7} {'×AR cpu':>7} " \
           f"{'×AR wall':>8} {'rounds':>6} {'tok/rd':>6} {'fg/rd':>5} {'p95 s':>6} {'=AR':>4} sweep"
    lines = [head]
    for r in result["rows"]:
        eq = {True: "yes", False: "NO", None: "-"}[r.get("equal_to_ar")]
        lines.append(f"{r['batch']:5d} {r['arm']:14} {r['verify']:6} {r['window']:2d} {r['history_offset']:2d} "
                     f"{'' if r['gamma'] is None else r['gamma']:>3} {r['prefix_ratio']:4.2f} {r['cpu_s']:7.3f} "
                     f"{r.get('speedup_vs_ar_cpu', 1.0):7.3f} {r.get('speedup_vs_ar_wall', 1.0):8.3f} {r['rounds']:6d} "
                     f"{r['tokens_per_round']:6.2f} {r['foreground_per_round']:5.2f} {r['p95_latency_s']:6.3f} {eq:>4} "
                     f"{r['sweep'] or ''}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-c2i-student", help="image-token model (default tiny-c2i-student)")
    p.add_argument("--batch", type=_ints, default=[8, 16, 32, 64], help="batch sizes (default 8,16,32,64)")
    p.add_argument("--window", type=int, default=8, help="HB-SJD window W (default 8)")
    p.add_argument("--history-offset", type=int, default=None, help="H (default: one row up, 14)")
    p.add_argument("--prefix-ratio", type=float, default=0.5, help="share of each real digit's codes given (default 0.5)")
    p.add_argument("--cfg", type=float, default=2.0, help="guidance scale (default 2.0)")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; CPU and wall time are their median")
    p.add_argument("--verify", default="greedy,prob", help="greedy, prob or both (default greedy,prob)")
    p.add_argument("--sweeps", default="w,h,gamma,prefix", help="sweeps at the first batch size (w,h,gamma,prefix; "
                   "'none' for none)")
    p.add_argument("--out", default="runs/bench-rollout", help="directory for rollout.json and rollout.png")


def run(args: argparse.Namespace) -> int:
    verify = [v for v in args.verify.split(",") if v]
    if not verify or any(v not in ("greedy", "prob") for v in verify):
        raise UsageError(f"--verify takes greedy and/or prob, got {args.verify!r}")
    sweeps = [] if args.sweeps == "none" else [s for s in args.sweeps.split(",") if s]
    bad = [s for s in sweeps if s not in ("w", "h", "gamma", "prefix")]
    if bad:
        raise UsageError(f"unknown sweep(s) {', '.join(bad)}: choose from w, h, gamma, prefix (or none)")
    if any(b < 2 for b in args.batch) or args.window < 1 or args.repeats < 1:
        raise UsageError("--batch sizes must be >= 2, --window >= 1, --repeats >= 1")
    if not 0.0 <= args.prefix_ratio < 1.0:
        raise UsageError(f"--prefix-ratio must be in [0, 1), got {args.prefix_ratio}")
    result = run_bench(args.model, args.batch, args.window, args.history_offset, args.prefix_ratio, args.cfg,
                       args.repeats, sweeps, Path(args.out), verify)
    print(format_table(result))
    for b, r in best_window(result).items():
        print(f"batch {b}: best W = {r['window']}, Hybrid {r['speedup_vs_ar_cpu']}x cached AR (CPU time), "
              f"{r['speedup_vs_ar_wall']}x wall")
    print(f"γ per batch: {result['gamma']}; wrote {Path(args.out) / 'rollout.json'} and rollout.png")
    return 0
