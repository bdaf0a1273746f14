"""Rollout benchmark of image-token models: cached AR, Batch-Synchronous SJD and HB-SJD (the HB-SJD paper).

    selfspec bench rollout --model tiny-c2i-student --batch 8,16,32,64 --window 8 \\
        --prefix-ratio 0.5 --repeats 3 --threads 1 --out runs/bench-rollout [--sweeps w,h,prefix]

Every batch completes real held-out digits from their first `prefix-ratio` of codes, under CFG
2.0, in each arm: `ar` (cached AR), `sync-lockstep` (the batch advances by its minimum accepted
length, what the public SJD code does), `sync-window` (fixed windows, the HB-SJD paper's Fig. 2a),
`hbsjd-full` / `hbsjd-compact` / `hbsjd-hybrid` (Independent HB-SJD; Hybrid compacts when the
rounds left repay it, on the `calibrate-gamma` costs measured in the same run); greedy, and
probabilistic (SJD p/q verification vs AR sampling at T = 1) for AR and Hybrid. Per arm: CPU
time (median of `--repeats` runs; the 2 cores are shared, so CPU time is the figure to compare;
`--threads 1` keeps OpenMP's spin-waiting out of it) and wall time, the mean and p95 latency at
which images finish, verification rounds, compactions, committed tokens per image-round split
into background (the empty patch code) and foreground, and greedy equality with AR. Sweeps: W
at every batch size (Hybrid, costs as calibrated for --window), and at the first batch size H
and prefix ratio. Writes `rollout.json` and `rollout.png` under --out.

JSON schema ("selfspec.bench.rollout/v2"): {"schema", "model", "cfg", "prefix_ratio", "window",
"history_offset", "repeats", "threads", "costs": {B: {b: {"forward_s", "compact_s"}}}, "rows":
[{"batch", "arm", "verify", "window", "history_offset", "prefix_ratio", "cpu_s", "wall_s",
"mean_latency_s", "p95_latency_s", "rounds", "compactions", "tokens_per_round",
"foreground_per_round", "background_per_round", "speedup_vs_ar_cpu", "speedup_vs_ar_wall",
"equal_to_ar" (greedy) | null, "sweep": null | "w" | "h" | "prefix"}]}
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


def timed_rollouts(engine, labels, prefix, cfgs: dict, repeats: int,
                   seed: int = 0) -> dict[str, tuple[dict, torch.Tensor]]:
    """Per config: the median CPU and wall time of `repeats` identical rollouts, with the last
    run's statistics and codes. The configs take turns (one run of each per repeat), so a
    transient slowdown of the shared machine costs each config at most one run, which the median
    drops, instead of every run of one config."""
    cpu: dict[str, list[float]] = {name: [] for name in cfgs}
    wall: dict[str, list[float]] = {name: [] for name in cfgs}
    last = {}
    for _ in range(repeats):
        for name, cfg in cfgs.items():
            c0, w0 = time.process_time(), time.perf_counter()
            last[name] = engine.rollout(labels, prefix, cfg, seed=seed)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    out = {}
    for name, res in last.items():
        stats = res.summary()
        stats.update(cpu_s=round(statistics.median(cpu[name]), 4), wall_s=round(statistics.median(wall[name]), 4))
        out[name] = (stats, res.codes)
    return out


def run_bench(model: str, batches: list[int], window: int, history_offset: int | None, prefix_ratio: float,
              cfg_scale: float, repeats: int, sweeps: list[str], out: Path, verify: list[str]) -> dict:
    from selfspec.images.rollout import RolloutConfig
    from selfspec.images.gamma import calibrated_costs
    from selfspec.images.model import load_image_model, prefix_codes

    im = load_image_model(model)
    engine = im.engine()
    lay = im.layout
    h = history_offset or lay.grid
    rows: list[dict] = []
    costs = {}  # batch -> CompactionCosts

    def group(batch, arms, verify_rule, w, hh, ratio, sweep, ar_ref=None):
        """Rows for `arms`, timed in turns; cached AR (an arm here, or `ar_ref`) is their reference."""
        labels = torch.arange(batch) % 10
        prefix = prefix_codes(im, labels, ratio)
        cfgs = {}
        for arm in arms:
            opts = dict(window=w, history_offset=hh, verify=verify_rule, cfg_scale=cfg_scale, costs=costs[batch])
            opts.update(ARMS[arm])
            cfgs[arm] = RolloutConfig(**opts)
        timed = timed_rollouts(engine, labels, prefix, cfgs, repeats)
        ref_stats, ref_codes = timed.get("ar") or ar_ref
        for arm, (stats, codes) in timed.items():
            row = {"batch": batch, "arm": arm, "verify": verify_rule, "window": cfgs[arm].window, "history_offset": hh,
                   "prefix_ratio": ratio, "sweep": sweep, **stats,
                   "speedup_vs_ar_cpu": round(ref_stats["cpu_s"] / stats["cpu_s"], 3),
                   "speedup_vs_ar_wall": round(ref_stats["wall_s"] / stats["wall_s"], 3),
                   "equal_to_ar": bool(torch.equal(codes, ref_codes)) if verify_rule == "greedy" else None}
            rows.append(row)
        return timed

    plan = [(b, v) for b in batches for v in verify]
    main_ar: dict[tuple[int, str], tuple] = {}
    with tqdm(total=len(plan), desc="bench rollout", unit="config") as bar:
        for batch, v in plan:
            if batch not in costs:
                costs[batch] = calibrated_costs(im.model, batch, window, guided=cfg_scale != 1.0)
            arms = list(ARMS) if v == "greedy" else ["ar", "hbsjd-hybrid"]
            main_ar[(batch, v)] = group(batch, arms, v, window, h, prefix_ratio, None)["ar"]
            bar.update(1)
        b0 = batches[0]
        sweep_plan = []  # (sweep, batch, W, H, prefix ratio); W at every batch size, the rest at the first
        if "w" in sweeps:
            sweep_plan += [("w", b, w, h, prefix_ratio) for b in batches for w in (2, 4, 8, 16) if w != window]
        if "h" in sweeps:
            sweep_plan += [("h", b0, window, hh, prefix_ratio) for hh in (1, lay.grid // 2, 2 * lay.grid) if hh != h]
        if "prefix" in sweeps:
            sweep_plan += [("prefix", b0, window, h, r) for r in (0.2, 0.75) if r != prefix_ratio]
        refs = {(b, prefix_ratio): main_ar[(b, "greedy")] for b in batches if (b, "greedy") in main_ar}
        for sweep, b, w, hh, ratio in tqdm(sweep_plan, desc="sweeps", unit="config"):
            if (b, ratio) in refs:
                group(b, ["hbsjd-hybrid"], "greedy", w, hh, ratio, sweep, refs[(b, ratio)])
            else:  # AR at another prefix ratio, the reference of that row
                refs[(b, ratio)] = group(b, ["ar", "hbsjd-hybrid"], "greedy", w, hh, ratio, sweep)["ar"]
    result = {"schema": "selfspec.bench.rollout/v2", "model": model, "cfg": cfg_scale, "prefix_ratio": prefix_ratio,
              "window": window, "history_offset": h, "repeats": repeats, "threads": torch.get_num_threads(),
              "costs": {b: c.to_sweep() for b, c in costs.items()}, "rows": rows}
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
    head = f"{'batch':>5} {'arm':14} {'verify':6} {'W':>2} {'H':>2} {'cmp':>3} {'pref':>4} {'cpu s':>7} {'×AR cpu':>7} " \
           f"{'×AR wall':>8} {'rounds':>6} {'tok/rd':>6} {'fg/rd':>5} {'p95 s':>6} {'=AR':>4} sweep"
    lines = [head]
    for r in result["rows"]:
        eq = {True: "yes", False: "NO", None: "-"}[r.get("equal_to_ar")]
        lines.append(f"{r['batch']:5d} {r['arm']:14} {r['verify']:6} {r['window']:2d} {r['history_offset']:2d} "
                     f"{r['compactions']:3d} {r['prefix_ratio']:4.2f} {r['cpu_s']:7.3f} "
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
    p.add_argument("--sweeps", default="w,h,prefix", help="sweeps: w at every batch size, h and prefix at the first "
                   "('none' for none)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 keeps OpenMP's "
                   "spin-waiting out of the CPU times)")
    p.add_argument("--out", default="runs/bench-rollout", help="directory for rollout.json and rollout.png")


def run(args: argparse.Namespace) -> int:
    verify = [v for v in args.verify.split(",") if v]
    if not verify or any(v not in ("greedy", "prob") for v in verify):
        raise UsageError(f"--verify takes greedy and/or prob, got {args.verify!r}")
    sweeps = [] if args.sweeps == "none" else [s for s in args.sweeps.split(",") if s]
    bad = [s for s in sweeps if s not in ("w", "h", "prefix")]
    if bad:
        raise UsageError(f"unknown sweep(s) {', '.join(bad)}: choose from w, h, prefix (or none)")
    if args.threads:
        torch.set_num_threads(args.threads)
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
    print(f"wrote {Path(args.out) / 'rollout.json'} and rollout.png")
    return 0
