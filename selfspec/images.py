"""Image-token models on disk, and image grids (what `generate-image` and the benchmarks show).

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
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.errors import UsageError


@dataclass
class ImageModel:
    model: torch.nn.Module
    layout: "object"
    vq: "object"
    path: Path

    @property
    def background_code(self) -> int:
        return int(self.vq.encode(torch.zeros(1, 28, 28, dtype=torch.uint8))[0, 0])

    def engine(self):
        from selfspec.engines.rollout import ImageRolloutEngine

        return ImageRolloutEngine(self.model, self.layout, self.background_code)


def load_image_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> ImageModel:
    from transformers import AutoModelForCausalLM

    from selfspec.models import resolve_model
    from selfspec.training.image_gpt import ImageTokenLayout
    from selfspec.training.image_tokenizer import PatchVQ

    path = resolve_model(name_or_path)
    try:
        layout = ImageTokenLayout.load(path)
    except ValueError as e:
        raise UsageError(f"{e}: --model must be an image-token model (tiny-c2i-teacher, tiny-c2i-student, "
                         "or a `selfspec train image-gpt` export)") from None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return ImageModel(model, layout, PatchVQ.load(path), path)


def save_grid(images: torch.Tensor, out: str | Path, columns: int | None = None, titles: list[str] | None = None,
              scale: int = 3) -> Path:
    """[N, 28, 28] uint8 -> a PNG grid (matplotlib), white digits on black as in MNIST."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(images)
    cols = columns or min(n, 8)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * scale * 0.4, rows * scale * 0.4 + (0.3 if titles else 0)),
                             squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i].numpy(), cmap="gray", vmin=0, vmax=255)
            if titles:
                ax.set_title(titles[i], fontsize=6)
    fig.tight_layout(pad=0.2)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------ CLI
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
    from selfspec.engines.rollout import RolloutConfig

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


def prefix_codes(im: ImageModel, labels: torch.Tensor, ratio: float) -> torch.Tensor:
    """[B, round(ratio * 196)] codes of held-out digits of each label (in order, cycling)."""
    plen = round(ratio * im.layout.tokens)
    if plen == 0:
        return torch.zeros(len(labels), 0, dtype=torch.long)
    from selfspec.training.image_data import digit_split

    split = digit_split()
    rows = []
    seen: dict[int, int] = {}
    for c in labels.tolist():
        idx = (split.heldout_labels == c).nonzero().squeeze(1)
        rows.append(idx[seen.get(c, 0) % len(idx)])
        seen[c] = seen.get(c, 0) + 1
    codes = im.vq.encode(split.heldout_images[torch.stack(rows)])
    return codes[:, :plen]
