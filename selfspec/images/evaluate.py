"""Image quality without downloaded weights: a digits classifier trained here, and the metrics
its features and probabilities give.

    selfspec train digits-classifier     # ~2 min; held-out accuracy >= 98%, committed
    selfspec eval-images --model tiny-c2i-student --num 5000 --cfg 2.0 [--out grid.png]

- Classifier: a small CNN (conv 32 -> conv 64 -> fc 64 -> 10) trained on the 4,500 train digits
  with random shifts of up to 2 px; its 64-d penultimate (pre-ReLU) features replace Inception's.
- FID: Fréchet distance between Gaussians fitted to the features of the samples and of the
  5,000 real digits (`scipy.linalg.sqrtm`, real part). The FID of the tokenizer's
  reconstructions of the real digits is the floor a token model can reach.
- IS: exp(E_x KL(p(y|x) || p(y))) over 10 splits (at most 10, the number of classes).
- Precision / recall: Kynkäänniemi et al. 2019, k-NN balls (k = 3) in feature space.
- Conditional accuracy: the classifier's label equals the conditioning class.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from selfspec.models import ASSETS_DIR
from selfspec.paths import check_package_write

CLASSIFIER_DIR = ASSETS_DIR / "digits-classifier"


class DigitClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.fc = nn.Linear(64 * 7 * 7, 64)
        self.head = nn.Linear(64, 10)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """[N, 28, 28] uint8 -> [N, 64] penultimate features (pre-ReLU)."""
        x = images.float().div(255.0).unsqueeze(1)
        return self.fc(self.conv(x))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.features(images)))

    @classmethod
    def load(cls, path: Path = CLASSIFIER_DIR) -> DigitClassifier:
        file = Path(path) / "classifier.pt"
        if not file.exists():
            raise FileNotFoundError(f"no digits classifier at {file}; build it with `selfspec train digits-classifier`")
        model = cls()
        model.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
        return model.eval()


def train_classifier(out: Path = CLASSIFIER_DIR, epochs: int = 12, seed: int = 0) -> dict:
    from tqdm import tqdm

    from selfspec.training.config import command_line
    from selfspec.images.data import digit_split, shifted

    torch.manual_seed(seed)
    split = digit_split()
    model = DigitClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(seed)
    n = len(split.train_labels)
    steps = epochs * (n // 64)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps)
    started = time.time()
    bar = tqdm(total=steps, desc="digits classifier", unit="step")
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(n // 64):
            idx = perm[s * 64 : (s + 1) * 64]
            dx, dy = torch.randint(-2, 3, (2,), generator=gen).tolist()
            x = shifted(split.train_images[idx], dx, dy)
            loss = nn.functional.cross_entropy(model(x), split.train_labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    model.eval()
    with torch.no_grad():
        acc = (model(split.heldout_images).argmax(-1) == split.heldout_labels).float().mean().item()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "classifier.pt")
    prov = {"model": "DigitClassifier (conv32-conv64-fc64-10)", "command": command_line(), "seed": seed,
            "epochs": epochs, "data": split.describe(), "heldout_accuracy": round(acc, 4),
            "parameters": sum(p.numel() for p in model.parameters()), "train_seconds": round(time.time() - started, 1)}
    (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
    print(f"held-out accuracy {acc:.2%} -> {out}")
    return prov


# ------------------------------------------------------------------------------ metrics
def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    from scipy import linalg

    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(cov_a @ cov_b)
    if not np.isfinite(covmean).all():
        eps = 1e-6 * np.eye(len(mu_a))
        covmean = linalg.sqrtm((cov_a + eps) @ (cov_b + eps))
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * covmean.real))


def inception_score(probs: torch.Tensor, splits: int = 10) -> float:
    # the splits are random subsets: samples generated (or stored) class by class would make
    # each split one class and the score ~1
    probs = probs[torch.randperm(len(probs), generator=torch.Generator().manual_seed(0))]
    scores = []
    for part in probs.chunk(splits):
        marginal = part.mean(0, keepdim=True)
        kl = (part * (part.clamp_min(1e-12).log() - marginal.clamp_min(1e-12).log())).sum(1).mean()
        scores.append(kl.exp().item())
    return float(np.mean(scores))


def precision_recall(real: torch.Tensor, fake: torch.Tensor, k: int = 3) -> tuple[float, float]:
    """Kynkäänniemi et al. 2019: a sample is precise if it falls inside some real sample's k-NN
    ball; recall is the same with the roles swapped."""

    def radii(x: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(x, x)
        return d.kthvalue(k + 1, dim=1).values  # the 0-th neighbour is the point itself

    def coverage(ref: torch.Tensor, ref_r: torch.Tensor, query: torch.Tensor) -> float:
        inside = torch.zeros(len(query), dtype=torch.bool)
        for s in range(0, len(query), 1024):
            inside[s : s + 1024] = (torch.cdist(query[s : s + 1024], ref) <= ref_r.unsqueeze(0)).any(1)
        return inside.float().mean().item()

    return coverage(real, radii(real), fake), coverage(fake, radii(fake), real)


@dataclass
class ImageMetrics:
    fid: float
    inception_score: float
    precision: float
    recall: float
    conditional_accuracy: float | None

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@torch.no_grad()
def image_metrics(images: torch.Tensor, labels: torch.Tensor | None, real: torch.Tensor,
                  classifier: DigitClassifier | None = None) -> ImageMetrics:
    clf = classifier or DigitClassifier.load()
    f_fake, f_real = clf.features(images), clf.features(real)
    probs = torch.softmax(clf.head(torch.relu(f_fake)), -1)
    acc = (probs.argmax(-1) == labels).float().mean().item() if labels is not None else None
    p, r = precision_recall(f_real, f_fake)
    return ImageMetrics(frechet_distance(f_fake.numpy().astype(np.float64), f_real.numpy().astype(np.float64)),
                        inception_score(probs), p, r, acc)


# ------------------------------------------------------------------------------ CLI
def add_classifier_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=str(CLASSIFIER_DIR), help="output directory (default: the embedded classifier)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)


def run_classifier(args: argparse.Namespace) -> int:
    check_package_write(args.out, "selfspec train digits-classifier")
    train_classifier(Path(args.out), args.epochs, args.seed)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-c2i-student", help="image-token model (default tiny-c2i-student)")
    p.add_argument("--num", type=int, default=5000, help="samples, classes in turn (default 5000)")
    p.add_argument("--cfg", type=float, default=2.0, help="guidance scale (default 2.0)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--batch", type=int, default=64, help="images per rollout (default 64)")
    p.add_argument("--window", type=int, default=8, help="HB-SJD window (probabilistic verification; 0 = AR)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="PNG grid of the first 100 samples (default: none)")
    p.add_argument("--json", default=None, help="write the metrics here")


def sample_images(im, num: int, cfg_scale: float, temperature: float, batch: int, window: int, seed: int,
                  progress: bool = True):
    """`num` images sampled from the class tokens alone (classes in turn), with probabilistic
    HB-SJD verification (AR's distribution; window 0 is AR sampling itself)."""
    from tqdm import tqdm

    from selfspec.images.rollout import RolloutConfig

    engine = im.engine()
    cfg = RolloutConfig(window=window, history_offset=im.layout.grid, verify="prob", cfg_scale=cfg_scale,
                        temperature=temperature)
    labels = torch.arange(num) % 10
    codes = []
    for s in tqdm(range(0, num, batch), desc="sampling", unit="batch", disable=not progress):
        lab = labels[s : s + batch]
        codes.append(engine.rollout(lab, torch.zeros(len(lab), 0, dtype=torch.long), cfg, seed=seed + s).codes)
    return im.vq.decode(torch.cat(codes)), labels


def run(args: argparse.Namespace) -> int:
    from selfspec.errors import UsageError
    from selfspec.images.model import load_image_model, save_grid
    from selfspec.images.data import load_digits

    if args.num < 20 or args.temperature <= 0:
        raise UsageError("--num must be at least 20 and --temperature > 0 (metrics need sampled images)")
    im = load_image_model(args.model)
    images, labels = sample_images(im, args.num, args.cfg, args.temperature, args.batch, args.window, args.seed)
    real = torch.from_numpy(load_digits()[0])
    metrics = image_metrics(images, labels, real)
    floor = image_metrics(im.vq.decode(im.vq.encode(real)), None, real)
    report = {"model": args.model, "num": args.num, "cfg": args.cfg, "temperature": args.temperature,
              **metrics.as_dict(), "tokenizer_floor_fid": round(floor.fid, 4)}
    print(json.dumps(report, indent=2))
    if args.out:
        order = torch.argsort(labels[:100], stable=True)
        save_grid(images[:100][order], args.out, columns=10)
        print(f"wrote {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
