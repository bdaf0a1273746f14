"""Image side: the real digits, the patch tokenizer, the image GPT objective and export, the
committed models, `generate-image`, and the γ rule."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from selfspec.training.image_data import digit_split, shifted
from selfspec.training.image_tokenizer import CODEBOOK_DIR, PatchVQ, psnr


def test_digit_split_is_real_balanced_and_deterministic():
    a, b = digit_split(), digit_split()
    assert a.train_images.shape == (4500, 28, 28) and a.heldout_images.shape == (500, 28, 28)
    assert torch.bincount(a.train_labels).tolist() == [450] * 10
    assert torch.bincount(a.heldout_labels).tolist() == [50] * 10
    assert torch.equal(a.heldout_images, b.heldout_images)
    assert a.sha256 == "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
    # real digits: mostly background, a stroke in the middle
    assert 0.7 < (a.train_images == 0).float().mean() < 0.85
    assert a.train_images[:, 10:18, 10:18].float().mean() > 4 * a.train_images[:, :3].float().mean()


def test_shift_moves_the_digit():
    img = torch.zeros(1, 28, 28, dtype=torch.uint8)
    img[0, 10, 12] = 255
    assert shifted(img, 2, -1)[0, 9, 14] == 255 and shifted(img, 2, -1).sum() == 255
    assert torch.equal(shifted(img, 0, 0), img)


def test_committed_codebook_round_trip():
    vq = PatchVQ.load(CODEBOOK_DIR)
    assert vq.codebook.shape == (256, 4)
    held = digit_split().heldout_images
    codes = vq.encode(held)
    assert codes.shape == (500, 196) and codes.max() < 256
    assert psnr(held, vq.decode(codes)) > 32.0  # provenance: 33.48 dB
    assert torch.equal(vq.encode(vq.decode(codes)), codes)  # decoded images re-encode to their codes
    # codes in raster order of the 14 x 14 grid: the top-left patch is the top-left 2 x 2 pixels
    one = torch.zeros(1, 28, 28, dtype=torch.uint8)
    one[0, 26:, 26:] = 255
    c = vq.encode(one)[0]
    assert (c[:-1] == c[0]).all() and c[-1] != c[0]


def test_image_gpt_trains_exports_and_generates(tmp_path, capsys):
    from selfspec.cli import main
    from selfspec.images import load_image_model
    from selfspec.training.image_gpt import RECIPES, ImageTokenLayout, train_image_gpt

    cfg = replace(RECIPES["tiny-c2i-student"], out=str(tmp_path / "m"), checkpoint_dir=str(tmp_path / "ck"), steps=3,
                  time_budget_minutes=None, eval_every=0, max_shift=0, batch_size=4, hidden_size=32, num_layers=1,
                  intermediate_size=64, progress_bar=False)
    result = train_image_gpt(cfg)
    out = Path(result["export"])
    assert {"config.json", "model.safetensors", "codebook.npy", "image_layout.json", "provenance.json"} <= \
        {p.name for p in out.iterdir()}
    im = load_image_model(out)
    assert im.layout == ImageTokenLayout() and im.model.config.vocab_size == 272
    assert im.background_code == int(PatchVQ.load(CODEBOOK_DIR).encode(torch.zeros(1, 28, 28, dtype=torch.uint8))[0, 0])
    png = tmp_path / "grid.png"
    assert main(["generate-image", "--model", str(out), "--num", "4", "--class", "3", "--out", str(png)]) == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["generate-image", "--model", str(out), "--class", "12"]) == 2
    assert "--class must be a digit class 0-9" in capsys.readouterr().err
    assert main(["generate-image", "--model", "tiny-base"]) == 2
    assert "must be an image-token model" in capsys.readouterr().err


def test_gamma_rule():
    from selfspec.tuning.gamma import choose_gamma

    # forward cost linear in the rows, compaction cheap: compact as soon as an image finishes
    linear = {b: {"forward_s": 0.01 * b, "compact_s": 0.001} for b in range(1, 9)}
    assert choose_gamma(linear, 8) == 7
    # forward cost flat (an unsaturated GPU): never worth compacting
    flat = {b: {"forward_s": 0.01, "compact_s": 0.001} for b in range(1, 9)}
    assert choose_gamma(flat, 8) == 0
    # flat down to 4 images, then cheaper: compact from 3 on
    knee = {b: {"forward_s": 0.01 if b > 3 else 0.004, "compact_s": 0.002} for b in range(1, 9)}
    assert choose_gamma(knee, 8) == 3
