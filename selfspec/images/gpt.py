"""Class-conditional image-token GPTs, LlamaGen style, as stock transformers Qwen3 models.

Token ids: 0..255 are the patch codes (`images.tokenizer`), 256..265 the ten digit classes, 266
the null class (classifier-free guidance's unconditional row); the vocabulary is padded to 272.
A sequence is `[class, c_1 .. c_196]`; training is next-token cross-entropy on the codes, with
the class swapped for the null class with probability `label_dropout` (so the same model gives
the unconditional logits that guidance needs). Sampling restricts the logits to the codes
(`images.cfg`). 1D RoPE over the raster order, untied embeddings.

    selfspec train tiny-c2i-teacher    # ~4.9M parameters (hidden 256 x 6 layers)
    selfspec train tiny-c2i-student    # ~0.9M parameters (hidden 128 x 4 layers), 5-6x smaller

Each recipe trains on the 4,500 train digits, every one at the 25 shifts of +-2 px (pre-tokenised:
112,500 sequences), under a wall-clock budget, and exports to selfspec/assets/<name>/ with the
codebook, `selfspec.json` (mode "sjd", and the `image` block: id layout, grid, codebook file) and
provenance.json (held-out loss, data hash, command).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from selfspec.checkpoints.metadata import SelfspecMetadata, load_metadata
from selfspec.errors import UsageError
from selfspec.models import ASSETS_DIR
from selfspec.paths import check_package_write, runs_dir
from selfspec.training import config as C
from selfspec.training.config import LoopConfig, option
from selfspec.training.data import batch_generator
from selfspec.training.distributed import global_rows, shard_rows
from selfspec.images.data import NUM_CLASSES, digit_split, shifted
from selfspec.images.tokenizer import CODEBOOK_DIR, TOKENS, PatchVQ
from selfspec.training.losses import next_token_ce
from selfspec.training.loop import train
from selfspec.training.objective import Objective

CODEBOOK_FILE = "codebook.npy"


@dataclass(frozen=True)
class ImageTokenLayout:
    codebook_size: int = 256
    num_classes: int = NUM_CLASSES
    tokens: int = TOKENS  # codes per image
    grid: int = 14  # codes per row ("one row up" = grid tokens back)
    vocab_size: int = 272

    @property
    def class_offset(self) -> int:
        return self.codebook_size

    @property
    def null_id(self) -> int:
        return self.codebook_size + self.num_classes

    def class_ids(self, labels: torch.Tensor) -> torch.Tensor:
        return labels.long() + self.class_offset

    def metadata_block(self) -> dict:
        """The `image` block of the model's selfspec.json."""
        return {**asdict(self), "class_offset": self.class_offset, "null_id": self.null_id, "codebook": CODEBOOK_FILE}

    @classmethod
    def load(cls, model_dir: Path) -> ImageTokenLayout:
        meta = load_metadata(model_dir)
        if meta is None or not meta.image:
            raise ValueError(f"{model_dir} is not an image-token model (its selfspec.json has no \"image\" block)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in meta.image.items() if k in names})


@dataclass(kw_only=True)
class ImageGPTConfig(LoopConfig):
    """image-token GPT"""

    out: str = option(help="export directory")
    steps: int = option(4000, help="optimizer steps at most")
    time_budget_minutes: float | None = option(20.0, help="wall-clock budget of the training loop")
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_ratio: float = 0.03
    weight_decay: float = 0.05
    batch_size: int = 32
    eval_every: int = 100
    threads: int | None = 2
    mixed_precision: str = "no"
    hidden_size: int = option(256, help="model width")
    num_layers: int = option(6, help="decoder layers")
    num_heads: int = option(4, help="attention heads")
    num_kv_heads: int = option(2, help="key / value heads")
    head_dim: int = option(64, help="attention head size")
    intermediate_size: int = option(768, help="MLP width")
    label_dropout: float = option(0.1, help="share of rows trained with the null class (classifier-free guidance)")
    max_shift: int = option(2, help="augmentation: every train digit at every shift of up to this many pixels")

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_dropout < 1.0:
            raise UsageError(f"--label-dropout must be in [0, 1), got {self.label_dropout}")


def build_image_model(cfg: ImageGPTConfig, layout: ImageTokenLayout):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=layout.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=layout.null_id, eos_token_id=layout.null_id, pad_token_id=layout.null_id,
    )
    return Qwen3ForCausalLM(config)


def tokenize_split(vq: PatchVQ, images: torch.Tensor, max_shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S * N, 196] codes of every image at every shift (S = (2 * max_shift + 1)^2), and the
    index of the source image of each row."""
    rows, source = [], []
    index = torch.arange(len(images))
    for dy in range(-max_shift, max_shift + 1):
        for dx in range(-max_shift, max_shift + 1):
            rows.append(vq.encode(shifted(images, dx, dy)).to(torch.int16))
            source.append(index)
    return torch.cat(rows), torch.cat(source)


@torch.no_grad()
def sequence_loss(model, codes: torch.Tensor, class_ids: torch.Tensor, batch_size: int = 100) -> float:
    """Mean next-code cross-entropy (nats) of [N, 196] codes after their class tokens."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    for s in range(0, len(codes), batch_size):
        x = torch.cat([class_ids[s : s + batch_size, None], codes[s : s + batch_size].long()], 1).to(device)
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    model.train(was_training)
    return total / codes.numel()


class ImageGPTObjective(Objective):
    name = "image-gpt"
    config_class = ImageGPTConfig
    cfg: ImageGPTConfig

    def build_model(self, device: torch.device) -> torch.nn.Module:
        self.device = device
        self.layout = ImageTokenLayout()
        return build_image_model(self.cfg, self.layout)

    def setup_training(self, model: torch.nn.Module, log) -> None:
        cfg = self.cfg
        started = time.time()
        self.vq = PatchVQ.load(CODEBOOK_DIR)
        split = digit_split()
        self.codes, source = tokenize_split(self.vq, split.train_images, cfg.max_shift)
        self.labels = split.train_labels[source]
        self.heldout_codes = self.vq.encode(split.heldout_images)
        self.heldout_labels = split.heldout_labels
        log(f"digits: {len(self.codes):,} train sequences ({len(split.train_labels)} images x "
            f"{(2 * cfg.max_shift + 1) ** 2} shifts), {len(self.heldout_codes)} held out; "
            f"tokenised in {time.time() - started:.0f} s")
        self.data_description = {**split.describe(), "train_sequences": len(self.codes),
                                 "augmentation": f"all shifts of up to {cfg.max_shift} px",
                                 "tokenizer": str(CODEBOOK_DIR.relative_to(ASSETS_DIR.parent.parent))}

    def batch(self, step: int, micro: int, rank: int) -> torch.Tensor:
        cfg = self.cfg
        gen = batch_generator(cfg.seed, step, micro)
        rows = shard_rows(cfg.batch_size, rank)
        idx = torch.randint(0, len(self.codes), (global_rows(cfg.batch_size),), generator=gen)
        drop = (torch.rand(len(idx), generator=gen) < cfg.label_dropout)[rows]
        idx = idx[rows]
        cls = self.layout.class_ids(self.labels[idx])
        cls = torch.where(drop, torch.full_like(cls, self.layout.null_id), cls)
        return torch.cat([cls[:, None], self.codes[idx].long()], 1).to(self.device)

    def forward(self, model: torch.nn.Module, batch: torch.Tensor, stage: dict) -> torch.Tensor:
        return model(input_ids=batch[:, :-1]).logits

    def loss(self, logits: torch.Tensor, batch: torch.Tensor, stage: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return next_token_ce(logits, batch)

    def evaluate(self, model: torch.nn.Module) -> dict:
        lay = self.layout
        cond = sequence_loss(model, self.heldout_codes, lay.class_ids(self.heldout_labels))
        uncond = sequence_loss(model, self.heldout_codes, torch.full_like(self.heldout_labels, lay.null_id))
        return {"heldout_loss": cond, "heldout_loss_null_class": uncond}

    def describe_eval(self, ev: dict) -> str:
        return f"loss {ev['heldout_loss']:.3f} (null class {ev['heldout_loss_null_class']:.3f})"

    def postfix(self, stage: dict, stats: dict[str, float]) -> dict:
        return {"loss": f"{stats['loss']:.3f}"}

    def metadata(self, state: dict) -> SelfspecMetadata:
        return image_metadata(self.layout, self.name, state)

    def provenance(self, model: torch.nn.Module, state: dict, out: Path, train_seconds: float | None) -> dict:
        cfg = self.cfg
        history = state["history"]
        final = history[-1]["heldout"] if history else self.evaluate(model)
        return {
            "model": cfg.name, "command": C.command_line(), "config": asdict(cfg), "seed": cfg.seed,
            "parameters": sum(p.numel() for p in model.parameters()), "data": state.get("data"),
            "steps": state["step"], "sequences_seen": state["step"] * cfg.batch_size * cfg.grad_accum,
            "train_loss_last": history[-1]["loss"] if history else None,
            "heldout_loss": final["heldout_loss"], "heldout_loss_null_class": final["heldout_loss_null_class"],
            "heldout_bits_per_image": round(final["heldout_loss"] * TOKENS / math.log(2), 1),
            "history": history, "train_seconds": round(state["elapsed_s"], 1),
            "total_seconds": round(train_seconds, 1) if train_seconds else None, "torch": torch.__version__,
            "saved_dtype": "bfloat16",
        }


def image_metadata(layout: ImageTokenLayout, objective: str, state: dict) -> SelfspecMetadata:
    """An image-token model's selfspec.json. Mode "sjd": the text-side mode that runs these
    models unchanged (guidance-free); `image` is what the rollout engine needs: the id layout and
    the codebook file."""
    history = state["history"]
    final = history[-1]["heldout"] if history else {}
    return SelfspecMetadata(mode="sjd", image=layout.metadata_block(),
                            recipe={"command": C.command_line(), "objective": objective},
                            metrics={k: round(v, 4) if isinstance(v, float) else v for k, v in final.items()})


def export_image_side_files(out: Path) -> None:
    """An image model directory is self-contained: beside its selfspec.json (the id layout), the
    codebook that decodes it."""
    shutil.copy(CODEBOOK_DIR / CODEBOOK_FILE, out / CODEBOOK_FILE)
    shutil.copy(CODEBOOK_DIR / "provenance.json", out / "codebook_provenance.json")


def train_image_gpt(cfg: ImageGPTConfig) -> dict:
    objective = ImageGPTObjective(cfg)
    result = train(objective)
    if cfg.export and "export" in result:
        export_image_side_files(Path(result["export"]))
    return result


# ------------------------------------------------------------------------------ recipes
def _recipe(name: str, minutes: float, **sizes) -> ImageGPTConfig:
    return ImageGPTConfig(out=str(ASSETS_DIR / name), name=name, checkpoint_dir=str(runs_dir(name)),
                          time_budget_minutes=minutes, **sizes)


# The student's budget is deliberately short: it is the pre-trained starting point of on-policy
# distillation, so it must stay measurably behind the teacher (at 12 minutes the 0.86M student
# reached the 4.9M teacher's held-out loss, the teacher being compute-bound on 2 cores).
RECIPES: dict[str, ImageGPTConfig] = {
    "tiny-c2i-teacher": _recipe("tiny-c2i-teacher", 28.0),
    "tiny-c2i-student": _recipe("tiny-c2i-student", 5.0, hidden_size=128, num_layers=4, num_heads=4,
                                num_kv_heads=2, head_dim=32, intermediate_size=384),
}
RECIPE_OPTIONS = ("out", "steps", "time_budget_minutes", "seed", "resume")


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, ImageGPTConfig, only=RECIPE_OPTIONS, overrides=True)


def run_recipe(args: argparse.Namespace) -> int:
    from dataclasses import replace

    cfg = replace(RECIPES[args.recipe], **C.given_options(ImageGPTConfig, args))
    check_package_write(cfg.out, f"selfspec train {args.recipe}")
    train_image_gpt(cfg)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, ImageGPTConfig)


def run(args: argparse.Namespace) -> int:
    train_image_gpt(C.from_args(ImageGPTConfig, args))
    return 0
