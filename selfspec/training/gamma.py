"""`selfspec calibrate-gamma`: where Hybrid execution switches from Full to Compact, measured.

Hybrid keeps every image's rows in the batch (Full: fixed shapes, finished images ride along)
while more than γ images are active, then removes finished images from the batch and the KV
cache (Compact) as they finish. Measured on this machine for one model, batch B and window W,
with guidance (2 rows per image) and the KV cache at mid-image length:

    t_f(b)  one verification forward of b images' rows at width W + 1
    t_c(b)  one compaction down to b images (KV `select` of every layer + the state gathers)

Rule: γ = the largest b < B with t_f(B) − t_f(b) ≥ t_c(b), i.e. compaction at b active images
pays for itself within one round of the smaller batch (there are always further rounds, so
this errs toward compacting too late, never too early). Data-independent: it needs the
model's shapes, not its images. Where a forward's cost hardly depends on its batch (a GPU
below saturation), γ is small and Hybrid ≈ Full; where it grows with the rows (CPU), γ is
close to B and Hybrid ≈ Compact. The sweep (t_f, t_c per b) is printed and written as JSON so
the choice can be checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from selfspec.engines.kv_cache import SlotKVCache
from selfspec.engines.rollout import causal_batch


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(model, batch: int, window: int, context: int = 99, guided: bool = True, repeats: int = 3,
                  sizes: list[int] | None = None) -> dict[int, dict[str, float]]:
    """{b: {"forward_s": t_f(b), "compact_s": t_c(b)}} for b in `sizes` (default 1..batch)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    per = 2 if guided else 1
    layers = model.config.num_hidden_layers
    vocab = model.config.vocab_size

    from selfspec.engines.rollout import ImageRolloutEngine

    engine = ImageRolloutEngine(model, None)

    def filled_cache(images: int) -> SlotKVCache:
        cache = SlotKVCache(layers, per * images, context + window + 2, device, dtype)
        engine._prefill(cache, torch.randint(0, vocab, (per * images, context), device=device))
        return cache

    full = filled_cache(batch)
    out: dict[int, dict[str, float]] = {}
    for b in sizes or list(range(1, batch + 1)):
        cache = filled_cache(b) if b != batch else full
        step = causal_batch(torch.randint(0, vocab, (per * b, window + 1), device=device))

        def forward() -> None:
            engine.runner.forward(cache, step)  # reserves the step's slots; nothing is committed
            cache._write_slots = None

        forward()  # warm-up
        t_f = _median_seconds(forward, repeats)
        rows = torch.arange(b, device=device)
        state = torch.zeros(batch, 210, dtype=torch.long, device=device)

        def compact() -> None:
            c = SlotKVCache(layers, full.batch_size, full.capacity, device, dtype)
            c.keys, c.values, c.lengths = list(full.keys), list(full.values), full.lengths.clone()
            c.select(torch.cat([rows, rows + batch]) if guided else rows)
            state.index_select(0, rows)

        t_c = _median_seconds(compact, repeats)
        out[b] = {"forward_s": t_f, "compact_s": t_c}
    return out


def calibrated_gamma(model, batch: int, window: int, guided: bool = True, repeats: int = 3) -> tuple[int, dict]:
    """(γ, the sweep it came from) for a batch of `batch` images at window W: the costs at
    1, B/8, 2B/8, ..., B images and the rule of `choose_gamma`."""
    step = max(1, batch // 8)
    sizes = sorted({1, *range(step, batch + 1, step), batch})
    costs = measure_costs(model, batch, window, guided=guided, repeats=repeats, sizes=sizes)
    return choose_gamma(costs, batch), costs


def choose_gamma(costs: dict[int, dict[str, float]], batch: int) -> int:
    """The rule of the module docstring; 0 (never compact) when compaction never pays."""
    t_full = costs[batch]["forward_s"]
    good = [b for b, c in costs.items() if b < batch and t_full - c["forward_s"] >= c["compact_s"]]
    return max(good) if good else 0


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-c2i-student", help="image-token model (default tiny-c2i-student)")
    p.add_argument("--batch", type=int, default=32, help="images per rollout batch B (default 32)")
    p.add_argument("--window", type=int, default=8, help="HB-SJD window W (default 8)")
    p.add_argument("--cfg", type=float, default=2.0, help="guidance scale (1: one row per image)")
    p.add_argument("--repeats", type=int, default=3, help="timings per point (median)")
    p.add_argument("--out", default=None, help="JSON to write (default runs/gamma/<model>-b<B>-w<W>.json)")


def run(args: argparse.Namespace) -> int:
    from selfspec.errors import UsageError
    from selfspec.training.image_model import load_image_model

    if args.batch < 2 or args.window < 0:
        raise UsageError("--batch must be >= 2 and --window >= 0")
    im = load_image_model(args.model)
    gamma, costs = calibrated_gamma(im.model, args.batch, args.window, guided=args.cfg != 1.0, repeats=args.repeats)
    for b, c in costs.items():
        print(f"b={b:3d}  t_f={c['forward_s'] * 1e3:7.2f} ms  t_c={c['compact_s'] * 1e3:6.2f} ms")
    print(f"gamma = {gamma} (batch {args.batch}, window {args.window})")
    out = Path(args.out or f"runs/gamma/{Path(str(im.path)).name}-b{args.batch}-w{args.window}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(args.model), "batch": args.batch, "window": args.window,
                               "cfg": args.cfg, "gamma": gamma, "threads": torch.get_num_threads(),
                               "costs": {str(b): c for b, c in costs.items()}}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
