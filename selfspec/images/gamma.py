"""`selfspec calibrate-gamma`: the costs Hybrid execution decides by, measured.

Hybrid keeps every image's rows in the batch (Full: fixed shapes, finished images ride along)
until removing the finished ones (Compact) pays. Measured on this machine for one model, batch
B and window W, with guidance (2 rows per image) and the KV cache at mid-image length:

    t_f(b)  one verification forward of b images' rows at width W + 1
    t_c(b)  one compaction down to b images (KV `select` of every layer + the state gathers)

Rule (`images.hbsjd.should_compact`, applied before every round of a rollout): with a of the
b images in the batch still running and r rounds to go (the active images' remaining tokens
over the tokens per image-round so far), compact when r × (t_f(b) − t_f(a)) > t_c(a). A
compaction is paid once and saves in every later round, so the question is not whether one
round of the smaller batch repays it but whether the rounds left do. Data-independent: the
table needs the model's shapes, not its images. Where a forward's cost grows with its rows
(CPU), compaction pays at the first finish; where it hardly does (a GPU below saturation), it
never does and Hybrid ≈ Full. The sweep (t_f, t_c per b) and the rounds after which compacting
from B to b pays are printed and written as JSON so the choice can be checked.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from selfspec.images.hbsjd import CompactionCosts
from selfspec.engines.kv_cache import SlotKVCache
from selfspec.images.rollout import causal_batch

STATE_GATHERS = 8  # the rollout state a compaction gathers besides the KV cache (seq, length, drafts, ...)


def _min_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` runs: on a shared machine other work only ever adds time."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.inference_mode()
def measure_costs(model, batch: int, window: int, context: int = 99, guided: bool = True, repeats: int = 10,
                  sizes: list[int] | None = None) -> dict[int, dict[str, float]]:
    """{b: {"forward_s": t_f(b), "compact_s": t_c(b)}} for b in `sizes` (default 1..batch)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    per = 2 if guided else 1
    layers = model.config.num_hidden_layers
    vocab = model.config.vocab_size

    from selfspec.images.rollout import ImageRolloutEngine

    engine = ImageRolloutEngine(model, None)

    def filled_cache(images: int) -> SlotKVCache:
        cache = SlotKVCache(layers, per * images, context + window + 2, device, dtype)
        engine._prefill(cache, torch.randint(0, vocab, (per * images, context), device=device))
        return cache

    full = filled_cache(batch)
    state = torch.zeros(batch, context + 2 * window + 2, dtype=torch.long, device=device)
    out: dict[int, dict[str, float]] = {}
    for b in sizes or list(range(1, batch + 1)):
        cache = filled_cache(b) if b != batch else full
        step = causal_batch(torch.randint(0, vocab, (per * b, window + 1), device=device))

        def forward() -> None:
            engine.runner.forward(cache, step)  # reserves the step's slots; nothing is committed
            cache._write_slots = None

        forward()  # warm-up
        t_f = _min_seconds(forward, repeats)
        rows = torch.arange(b, device=device)

        def compact() -> None:
            c = SlotKVCache(layers, full.batch_size, full.capacity, device, dtype)
            c.keys, c.values, c.lengths = list(full.keys), list(full.values), full.lengths.clone()
            c.select(torch.cat([rows, rows + batch]) if guided else rows)
            for _ in range(STATE_GATHERS):
                state.index_select(0, rows)

        t_c = _min_seconds(compact, repeats)
        out[b] = {"forward_s": t_f, "compact_s": t_c}
    return out


def calibrated_costs(model, batch: int, window: int, guided: bool = True, repeats: int = 10) -> CompactionCosts:
    """The costs of a batch of `batch` images at window W, measured at 1, B/8, 2B/8, ..., B images."""
    step = max(1, batch // 8)
    sizes = sorted({1, *range(step, batch + 1, step), batch})
    return CompactionCosts.from_sweep(measure_costs(model, batch, window, guided=guided, repeats=repeats, sizes=sizes))


def break_even_rounds(costs: CompactionCosts, batch: int) -> dict[int, float | None]:
    """Per measured size b < B: the rounds left above which compacting from B to b images pays
    (`should_compact`'s threshold); None where it never pays."""
    out: dict[int, float | None] = {}
    for b in costs.sizes:
        if b < batch:
            saving = costs.forward(batch) - costs.forward(b)
            out[b] = costs.compact(b) / saving if saving > 0 else None
    return out


def load_costs(path: str | Path) -> CompactionCosts:
    """The costs in a JSON written by `selfspec calibrate-gamma`."""
    return CompactionCosts.from_sweep(json.loads(Path(path).read_text())["costs"])


# ------------------------------------------------------------------------------ CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-c2i-student", help="image-token model (default tiny-c2i-student)")
    p.add_argument("--batch", type=int, default=32, help="images per rollout batch B (default 32)")
    p.add_argument("--window", type=int, default=8, help="HB-SJD window W (default 8)")
    p.add_argument("--cfg", type=float, default=2.0, help="guidance scale (1: one row per image)")
    p.add_argument("--repeats", type=int, default=10, help="timings per point (the fastest counts)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="JSON to write (default runs/gamma/<model>-b<B>-w<W>.json)")


def run(args: argparse.Namespace) -> int:
    from selfspec.errors import UsageError
    from selfspec.images.model import load_image_model

    if args.batch < 2 or args.window < 0 or args.repeats < 1:
        raise UsageError("--batch must be >= 2, --window >= 0 and --repeats >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    im = load_image_model(args.model)
    costs = calibrated_costs(im.model, args.batch, args.window, guided=args.cfg != 1.0, repeats=args.repeats)
    even = break_even_rounds(costs, args.batch)
    for b, f, c in zip(costs.sizes, costs.forward_s, costs.compact_s):
        pays = "" if b == args.batch else "never" if even[b] is None else f"> {even[b]:.3g} rounds left"
        print(f"b={b:3d}  t_f={f * 1e3:7.2f} ms  t_c={c * 1e3:6.3f} ms  compact {args.batch} -> {b}: {pays}")
    out = Path(args.out or f"runs/gamma/{Path(str(im.path)).name}-b{args.batch}-w{args.window}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(args.model), "batch": args.batch, "window": args.window,
                               "cfg": args.cfg, "threads": torch.get_num_threads(),
                               "costs": {str(b): c for b, c in costs.to_sweep().items()},
                               "break_even_rounds": {str(b): r for b, r in even.items()}}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
