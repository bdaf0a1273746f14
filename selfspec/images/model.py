"""An image-token model on disk as one object (the GPT, its token layout, its VQ tokenizer), held-out
digit prefixes, and image grids: what `selfspec generate-image`, the HB-SJD rollouts, on-policy
distillation and their benchmarks load and show."""

from __future__ import annotations

import math
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
        from selfspec.images.rollout import ImageRolloutEngine

        return ImageRolloutEngine(self.model, self.layout, self.background_code)


def load_image_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> ImageModel:
    from transformers import AutoModelForCausalLM

    from selfspec.models import resolve_model
    from selfspec.images.gpt import ImageTokenLayout
    from selfspec.images.tokenizer import PatchVQ

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


def prefix_codes(im: ImageModel, labels: torch.Tensor, ratio: float) -> torch.Tensor:
    """[B, round(ratio * 196)] codes of held-out digits of each label (in order, cycling)."""
    plen = round(ratio * im.layout.tokens)
    if plen == 0:
        return torch.zeros(len(labels), 0, dtype=torch.long)
    from selfspec.images.data import digit_split

    split = digit_split()
    rows = []
    seen: dict[int, int] = {}
    for c in labels.tolist():
        idx = (split.heldout_labels == c).nonzero().squeeze(1)
        rows.append(idx[seen.get(c, 0) % len(idx)])
        seen[c] = seen.get(c, 0) + 1
    codes = im.vq.encode(split.heldout_images[torch.stack(rows)])
    return codes[:, :plen]
