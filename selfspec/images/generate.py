"""`selfspec generate-image`: digits sampled from an image-token model (`images.model`), as a PNG grid.

    selfspec generate-image --model tiny-c2i-student --class 3 --num 16 --cfg 2.0 --mode hbsjd --out grid.png

By default every image is sampled: temperature 1 (`--temperature`), classifier-free guidance 2.0
(`--cfg 1` turns it off), and with `--mode hbsjd` (Independent HB-SJD: `--window`,
`--history-offset`) the drafts are verified by SJD's probabilistic p/q rule (`--verify prob`),
which keeps the distribution of AR sampling; `--mode ar` is cached AR sampling. The draws follow
`--seed` (default 0): the same command writes the same grid.

Greedy decoding only when asked (`--temperature 0` or `--verify greedy`): both modes then give the
same images, token for token (the exactness check of HB-SJD), but the greedy choice of these digit
models is the empty-background code almost everywhere, so from the class token alone the images
are blank. `--prefix-ratio r` keeps the first r of a real held-out digit's codes and completes the
rest (what on-policy distillation rolls out).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from selfspec.errors import UsageError
from selfspec.images.model import load_image_model, prefix_codes, save_grid

GREEDY_NOTE = ("note: greedy decoding of these digit models emits the empty-background code almost everywhere "
               "(from the class token alone: blank images); sample (the default, --temperature 1) to draw digits")


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
                   help="prob: sample (HB-SJD verifies by SJD's p/q rule; the default); greedy: greedy decoding "
                        "(blank images from the class token alone)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default 1; 0 = greedy, as --verify greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest codes (default 0 = all)")
    p.add_argument("--prefix-ratio", type=float, default=0.0, help="complete real held-out digits from this share of "
                   "their codes (default 0: from the class token alone)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampled draws (default 0)")
    p.add_argument("--out", default="grid.png", help="PNG grid to write (default grid.png)")


def decoding(args: argparse.Namespace) -> tuple[str, float]:
    """(verify, temperature) from --verify and --temperature: sampling at T = 1 unless greedy is asked."""
    if args.temperature is not None and args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if args.verify == "greedy":
        if args.temperature:
            raise UsageError("--verify greedy is greedy decoding: drop --temperature, or use --verify prob to sample")
        return "greedy", 0.0
    temperature = 1.0 if args.temperature is None else args.temperature
    if temperature == 0:
        if args.verify == "prob":
            raise UsageError("--verify prob samples: give a --temperature > 0")
        return "greedy", 0.0
    return "prob", temperature


@dataclass
class Generated:
    images: torch.Tensor  # [N, 28, 28] uint8
    labels: torch.Tensor  # [N]
    result: object  # rollout.RolloutResult
    seconds: float
    greedy: bool

    @property
    def foreground_share(self) -> float:
        """Share of the generated codes that are not the empty-background code."""
        r = self.result
        return r.committed_foreground / max(1, r.committed_foreground + r.committed_background)


def generate(args: argparse.Namespace) -> Generated:
    """The images `generate-image` draws for these arguments (nothing written)."""
    from selfspec.images.rollout import RolloutConfig

    if args.label is not None and not 0 <= args.label <= 9:
        raise UsageError(f"--class must be a digit class 0-9, got {args.label}")
    if args.num < 1:
        raise UsageError(f"--num must be at least 1, got {args.num}")
    if not 0.0 <= args.prefix_ratio < 1.0:
        raise UsageError(f"--prefix-ratio must be in [0, 1), got {args.prefix_ratio}")
    verify, temperature = decoding(args)
    im = load_image_model(args.model)
    lay = im.layout
    window = 0 if args.mode == "ar" else args.window
    try:
        cfg = RolloutConfig(window=window, history_offset=args.history_offset or lay.grid, verify=verify,
                            cfg_scale=args.cfg, temperature=temperature or 1.0, top_k=args.top_k)
    except ValueError as e:
        raise UsageError(str(e)) from None
    labels = torch.full((args.num,), args.label) if args.label is not None else torch.arange(args.num) % 10
    prefix = prefix_codes(im, labels, args.prefix_ratio)
    started = time.perf_counter()
    res = im.engine().rollout(labels, prefix, cfg, seed=args.seed)
    seconds = time.perf_counter() - started
    return Generated(im.vq.decode(res.codes), labels, res, seconds, verify == "greedy")


def run(args: argparse.Namespace) -> int:
    g = generate(args)
    out = save_grid(g.images, args.out, titles=[str(int(c)) for c in g.labels])
    how = "greedy" if g.greedy else f"sampled at T={args.temperature if args.temperature is not None else 1.0:g}"
    print(f"wrote {out}: {args.num} images of class {args.label if args.label is not None else '0-9'}, "
          f"mode {args.mode}, {how}, cfg {args.cfg}, seed={args.seed}", file=sys.stderr)
    res = g.result
    print(f"[{res.rounds} rounds, {res.tokens_per_round:.2f} tokens per image-round "
          f"({res.summary()['foreground_per_round']:.2f} foreground), {g.seconds:.2f} s]", file=sys.stderr)
    if g.greedy:
        print(GREEDY_NOTE, file=sys.stderr)
    return 0
