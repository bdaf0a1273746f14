"""Image side: the real digits, the patch tokenizer, the image GPT objective and export, the
committed models, `generate-image`, and the γ rule."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from selfspec.images.data import digit_split, shifted
from selfspec.images.tokenizer import CODEBOOK_DIR, PatchVQ, psnr


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
    from selfspec.images.model import load_image_model
    from selfspec.images.gpt import RECIPES, ImageTokenLayout, train_image_gpt

    cfg = replace(RECIPES["tiny-c2i-student"], out=str(tmp_path / "m"), checkpoint_dir=str(tmp_path / "ck"), steps=3,
                  time_budget_minutes=None, eval_every=0, max_shift=0, batch_size=4, hidden_size=32, num_layers=1,
                  intermediate_size=64, progress_bar=False)
    result = train_image_gpt(cfg)
    out = Path(result["export"])
    assert {"config.json", "model.safetensors", "codebook.npy", "selfspec.json", "provenance.json"} <= \
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


def test_break_even_rounds():
    from selfspec.images.hbsjd import CompactionCosts
    from selfspec.images.gamma import break_even_rounds

    # forward cost linear in the rows, compaction cheap: a fraction of a round repays it
    linear = CompactionCosts.from_sweep({b: {"forward_s": 0.01 * b, "compact_s": 0.001} for b in range(1, 9)})
    assert break_even_rounds(linear, 8)[7] == pytest.approx(0.1)
    # forward cost flat (an unsaturated GPU): never worth compacting
    flat = CompactionCosts.from_sweep({b: {"forward_s": 0.01, "compact_s": 0.001} for b in range(1, 9)})
    assert set(break_even_rounds(flat, 8).values()) == {None}
    # flat down to 4 images, then cheaper: compacting to 3 pays after a third of a round
    knee = CompactionCosts.from_sweep({b: {"forward_s": 0.01 if b > 3 else 0.004, "compact_s": 0.002}
                                       for b in range(1, 9)})
    even = break_even_rounds(knee, 8)
    assert even[4] is None and even[3] == pytest.approx(1 / 3)


def test_calibrated_costs_on_the_student(student, student_ar):
    """The calibration measures every batch size up to B (B = 8: each one), and its costs drive a
    Hybrid rollout's compactions: whatever they measured, the greedy rollout is AR's."""
    from selfspec.images.gamma import calibrated_costs
    from selfspec.images.rollout import RolloutConfig

    costs = calibrated_costs(student.model, batch=8, window=4, repeats=2)
    assert costs.sizes == tuple(range(1, 9))
    labels, prefix, ar = student_ar
    out = student.engine().rollout(labels, prefix, RolloutConfig(window=8, execution="hybrid", costs=costs))
    assert torch.equal(out.codes, ar.codes) and out.rounds < ar.rounds


# ------------------------------------------------------------------------------ the committed models
@pytest.fixture(scope="module")
def student():
    from selfspec.images.model import load_image_model

    return load_image_model("tiny-c2i-student")


@pytest.fixture(scope="module")
def student_ar(student):
    """Six images (one per class 0-5) from half of their codes: labels, prefixes and the student's
    cached AR rollout, the greedy reference of the HB-SJD rollouts."""
    from selfspec.images.model import prefix_codes
    from selfspec.images.rollout import RolloutConfig

    labels = torch.arange(6) % 10
    prefix = prefix_codes(student, labels, 0.5)
    return labels, prefix, student.engine().rollout(labels, prefix, RolloutConfig(window=0))


def test_committed_models_and_provenance():
    from selfspec.models import ModelInfo, resolve_model

    sizes = {}
    for name in ("tiny-c2i-teacher", "tiny-c2i-student"):
        path = resolve_model(name)
        prov = ModelInfo(name, path, "").provenance()
        assert prov["data"]["sha256"] == digit_split().sha256 and prov["command"].startswith("selfspec train " + name)
        assert prov["train_seconds"] <= 30 * 60
        assert prov["heldout_loss"] < prov["history"][0]["heldout"]["heldout_loss"]  # still learning after the first eval
        sizes[name] = prov["parameters"]
        assert (path / "model.safetensors").stat().st_size < 12e6
    assert 4e6 < sizes["tiny-c2i-teacher"] < 6e6
    assert sizes["tiny-c2i-teacher"] / sizes["tiny-c2i-student"] >= 4


@pytest.mark.parametrize("schedule", ["independent", "lockstep", "window"])
def test_committed_student_greedy_hbsjd_equals_cached_ar(student, student_ar, schedule):
    from selfspec.images.hbsjd import CompactionCosts
    from selfspec.images.rollout import RolloutConfig

    engine = student.engine()
    labels, prefix, ar = student_ar
    costs = CompactionCosts.from_sweep({b: {"forward_s": 1.0 + 0.1 * b, "compact_s": 0.5} for b in range(1, 7)})
    for execution in ("full", "compact", "hybrid"):
        out = engine.rollout(labels, prefix, RolloutConfig(window=8, schedule=schedule, execution=execution,
                                                           costs=costs))
        assert torch.equal(out.codes, ar.codes), execution
        assert out.rounds < ar.rounds


def test_hybrid_compacts_early_when_the_rounds_left_repay_it(student):
    """Real prefixes, images finishing over 13 rounds; one finished image saves 0.1 a round against
    a compaction of 0.5. The one-round rule's γ would be 3 (full while more than 3 images run);
    counting the rounds left, Hybrid compacts at the first finish, when many rounds remain, and
    lets finished images ride along when few do."""
    from selfspec.images.hbsjd import CompactionCosts
    from selfspec.images.rollout import RolloutConfig
    from selfspec.images.model import prefix_codes

    engine = student.engine()
    labels = torch.arange(8) % 10
    prefix = prefix_codes(student, labels, 0.5)
    costs = CompactionCosts.from_sweep({b: {"forward_s": 1.0 + 0.1 * b, "compact_s": 0.5} for b in range(1, 9)})
    compact = engine.rollout(labels, prefix, RolloutConfig(window=8, execution="compact"))
    hybrid = engine.rollout(labels, prefix, RolloutConfig(window=8, execution="hybrid", costs=costs))
    assert torch.equal(hybrid.codes, compact.codes)
    first = next(t for t in hybrid.trace if t["active"] < 8)
    assert first["active"] == 7 and first["rows"] == 14
    assert 0 < hybrid.compactions < compact.compactions
    assert any(t["rows"] > 2 * t["active"] for t in hybrid.trace)


def test_hf_engine_runs_the_image_model(student):
    """A stock transformers checkpoint: the text engine's AR (no guidance) gives the rollout
    engine's guidance-free AR codes."""
    from selfspec.engines.hf import HFEngine
    from selfspec.images.rollout import RolloutConfig
    from selfspec.images.model import prefix_codes

    labels = torch.tensor([1, 7])
    prefix = prefix_codes(student, labels, 0.75)
    ar = student.engine().rollout(labels, prefix, RolloutConfig(window=0, cfg_scale=1.0))
    hf = HFEngine(student.model)
    prompts = [[int(student.layout.class_ids(c))] + p.tolist() for c, p in zip(labels, prefix)]
    outs = hf.generate(prompts, max_new_tokens=196 - prefix.shape[1], stop_token_ids=[])
    assert [o.token_ids for o in outs] == ar.codes[:, prefix.shape[1]:].tolist()


@pytest.mark.parametrize("name", ["tiny-c2i-teacher", "tiny-c2i-student"])
def test_generate_image_defaults_draw_digits(name):
    """`generate-image` as a user runs it (sampling at T = 1, HB-SJD with p/q verification, the
    default seed) draws strokes from both committed models; greedy decoding, from the class token
    alone, emits the background code everywhere: blank images."""
    import argparse

    from selfspec.images.generate import add_arguments, generate

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sampled = generate(parser.parse_args(["--model", name, "--num", "3"]))  # classes 0, 1, 2
    assert not sampled.greedy
    assert sampled.foreground_share > 0.15  # real digits: 25% of the codes
    ink = (sampled.images > 127).float().mean((1, 2))  # real digits: about 13% of the pixels
    assert (ink > 0.03).all(), ink
    greedy = generate(parser.parse_args(["--model", name, "--num", "3", "--temperature", "0"]))
    assert greedy.greedy and greedy.foreground_share < 0.02
    assert (greedy.images > 127).float().mean() < 0.01
    if name == "tiny-c2i-student":  # the same seed, the same images
        again = generate(parser.parse_args(["--model", name, "--num", "3"]))
        assert torch.equal(again.images, sampled.images)


# ------------------------------------------------------------------------------ quality metrics
def test_committed_classifier_and_metrics():
    from selfspec.images.evaluate import DigitClassifier, frechet_distance, image_metrics, inception_score

    clf = DigitClassifier.load()
    split = digit_split()
    with torch.no_grad():
        acc = (clf(split.heldout_images).argmax(-1) == split.heldout_labels).float().mean().item()
    assert acc >= 0.98
    same = image_metrics(split.heldout_images, split.heldout_labels, split.heldout_images, clf)
    assert abs(same.fid) < 1e-3 and same.precision == same.recall == 1.0 and same.conditional_accuracy == acc
    real = image_metrics(split.heldout_images, split.heldout_labels, split.train_images, clf)
    assert real.fid < 5.0 and real.precision > 0.9 and 7.0 < real.inception_score <= 10.0
    # all-one-class samples: IS near 1, poor recall, a large FID
    ones = split.heldout_images[split.heldout_labels == 1]
    collapsed = image_metrics(ones, torch.ones(len(ones), dtype=torch.long), split.train_images, clf)
    assert collapsed.inception_score < 1.5 and collapsed.recall < real.recall - 0.3 and collapsed.fid > 10 * real.fid
    uniform = torch.full((100, 10), 0.1)
    assert abs(inception_score(uniform) - 1.0) < 1e-5
    a = torch.randn(2000, 8).double().numpy()
    assert abs(frechet_distance(a, a + 1.0) - 8.0) < 0.05  # mean shift of 1 in 8 dims, same covariance
