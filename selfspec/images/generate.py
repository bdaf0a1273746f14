"""`selfspec generate-image`: images from an image-token model (`images.model`), as a grid.

    selfspec generate-image --model tiny-c2i-student --class 3 --num 16 --cfg 2.0 --mode hbsjd --out grid.png

`--mode ar` is cached AR, `--mode hbsjd` Independent HB-SJD (`--window`, `--history-offset`,
`--verify greedy|prob`); both under classifier-free guidance (`--cfg 1` turns it off). Greedy
(`--temperature 0`, the default) gives the same images in both modes; with a temperature each
image is sampled (AR sampling, or SJD's p/q verification, which keeps AR's distribution).
`--prefix-ratio r` keeps the first r of a real held-out digit's codes and completes the rest
(what on-policy distillation rolls out).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from selfspec.errors import UsageError
from selfspec.images.model import load_image_model, prefix_codes, save_grid


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-c2i-student", help="image-token model (default tiny-c2i-student)")
    p.add_argument("--class", dest="label", type=int, default=None,
                   help="digit class 0-9 (default: 0-9 in turn)")
    p.add_argument("--num", type=int, default=16, help="images (default 16)")
    p.add_argument("--cfg", type=float, default=2.0, help="classifier-free guidance scale (1 = off; default 2.0)")
    p.add_argument("--mode", choices=["ar", "hbsjd"], default="hbsjd", help="cached AR or HB-SJD (default hbsjd)")
    p.add_argument("--window", type=int, default=8, help="HB-SJD drafts per image per round (default 8)")
    p.add_argument("--history-offset", type=int, default=None, help="HB-SJD history offset H (default: one row up)")
    p.add_argument("--verify", choices=["greedy", "prob"], default=None,
                   help="HB-SJD verification (default: greedy at temperature 0, prob otherwise)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else sample")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--prefix-ratio", type=float, default=0.0, help="complete real held-out digits from this share of "
                   "their codes (default 0: from the class token alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grid.png", help="PNG grid to write (default grid.png)")


def run(args: argparse.Namespace) -> int:
    from selfspec.images.rollout import RolloutConfig

    if args.label is not None and not 0 <= args.label <= 9:
        raise UsageError(f"--class must be a digit class 0-9, got {args.label}")
    if args.num < 1:
        raise UsageError(f"--num must be at least 1, got {args.num}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0.0 <= args.prefix_ratio < 1.0:
        raise UsageError(f"--prefix-ratio must be in [0, 1), got {args.prefix_ratio}")
    verify = args.verify or ("greedy" if args.temperature == 0 else "prob")
    if verify == "greedy" and args.temperature > 0 and args.mode == "hbsjd":
        raise UsageError("--verify greedy is greedy decoding: use --temperature 0, or --verify prob to sample")
    if verify == "prob" and args.temperature == 0:
        raise UsageError("--verify prob samples: give a --temperature > 0")
    im = load_image_model(args.model)
    lay = im.layout
    window = 0 if args.mode == "ar" else args.window
    try:
        cfg = RolloutConfig(window=window, history_offset=args.history_offset or lay.grid, verify=verify,
                            cfg_scale=args.cfg, temperature=args.temperature or 1.0, top_k=args.top_k)
    except ValueError as e:
        raise UsageError(str(e)) from None
    labels = torch.full((args.num,), args.label) if args.label is not None else torch.arange(args.num) % 10
    prefix = prefix_codes(im, labels, args.prefix_ratio)
    started = time.perf_counter()
    res = im.engine().rollout(labels, prefix, cfg, seed=args.seed)
    seconds = time.perf_counter() - started
    out = save_grid(im.vq.decode(res.codes), args.out, titles=[str(int(c)) for c in labels])
    print(f"wrote {out}: {args.num} images of class {args.label if args.label is not None else '0-9'}, "
          f"mode {args.mode}, cfg {args.cfg}", file=sys.stderr)
    print(f"[{res.rounds} rounds, {res.tokens_per_round:.2f} tokens per image-round "
          f"({res.summary()['foreground_per_round']:.2f} foreground), {seconds:.2f} s]", file=sys.stderr)
    return 0
