"""Recipe of the embedded base model `tiny-base`: a ~5M-parameter Qwen3 trained on the stdlib.

`selfspec train tiny-base` runs it end to end: tokenizer, model, held-out evaluation, bf16
export with provenance. Pre-training is an objective of the training loop
(`selfspec.training.loop`: the same learning-rate schedule, time-budget re-planning,
checkpoints and export as every other run). Deterministic for a seed on one machine (CPU,
fixed thread count).
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.models import ASSETS_DIR
from selfspec.paths import check_package_write, runs_dir
from selfspec.training import config as C
from selfspec.training.config import LoopConfig, option
from selfspec.corpus import HELDOUT_PERCENT, load_stdlib_split
from selfspec.training.data import batch_generator
from selfspec.training.distributed import global_rows, shard_rows
from selfspec.training.losses import next_token_ce
from selfspec.training.loop import train
from selfspec.training.objective import Objective
from selfspec.training.tokenizer import EOS_TOKEN, IM_END, train_bpe_tokenizer



@dataclass(kw_only=True)
class TinyBaseConfig(LoopConfig):
    """tiny-base"""

    # the loop's settings, with tiny-base's values
    out: str = option(str(ASSETS_DIR / "tiny-base"), help="output directory (default: the package's embedded tiny-base)")
    steps: int = option(2400, help="optimizer steps at most (default 2400)")
    time_budget_minutes: float | None = option(
        45.0, help="wall-clock budget of the training loop; the LR schedule anneals within it (default 45)")
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_ratio: float = 0.025  # 60 of 2400 steps
    weight_decay: float = 0.1
    eval_every: int = 150
    eval_tokens: int = 65536  # the final evaluation reads the whole held-out split
    checkpoint_dir: str | None = str(runs_dir("tiny-base"))  # under the working directory
    threads: int | None = 1  # one thread: on a shared 2-core machine two OpenMP threads stall each other
    mixed_precision: str = "no"  # fp32, as tiny-base was trained
    # the model and its data
    vocab_size: int = option(8192, help="byte-level BPE vocabulary")
    hidden_size: int = option(256, help="model width")
    num_layers: int = option(4, help="decoder layers")
    num_heads: int = option(4, help="attention heads")
    num_kv_heads: int = option(2, help="key / value heads")
    head_dim: int = option(64, help="attention head size")
    intermediate_size: int = option(768, help="MLP width")
    max_position_embeddings: int = option(4096, help="longest position")
    seq_len: int = option(512, help="tokens per training window")


def build_model(cfg: TinyBaseConfig, eos_id: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return Qwen3ForCausalLM(config)


def tokenize_files(tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, seq_len: int, batch_size: int) -> float:
    """Mean next-token cross-entropy over consecutive non-overlapping windows of `tokens`."""
    model.eval()
    device = next(model.parameters()).device
    n = (len(tokens) - 1) // seq_len
    total, count = 0.0, 0
    for start in range(0, n, batch_size):
        rows = range(start, min(n, start + batch_size))
        x = torch.stack([tokens[r * seq_len : r * seq_len + seq_len] for r in rows])
        y = torch.stack([tokens[r * seq_len + 1 : r * seq_len + seq_len + 1] for r in rows])
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        total += loss.item()
        count += y.numel()
    model.train()
    return total / count


class TinyBaseObjective(Objective):
    """Next-token pre-training of tiny-base on the stdlib train split, as an objective of the
    training loop (one stage; a plain AR model, so no selfspec.json)."""

    name = "tiny-base"
    config_class = TinyBaseConfig
    cfg: TinyBaseConfig

    def build_model(self, device: torch.device) -> torch.nn.Module:
        """Trains the tokenizer first (it fixes the vocabulary), into the export directory."""
        from transformers import GenerationConfig

        cfg = self.cfg
        self.device = device
        started = time.time()
        self.split = load_stdlib_split()
        print(f"corpus: {len(self.split.train)} train files, {len(self.split.heldout)} held-out files "
              f"from {self.split.root}")
        self.tokenizer = train_bpe_tokenizer((f.text for f in self.split.train), cfg.vocab_size, Path(cfg.out))
        self.tokenizer_seconds = time.time() - started
        eos_id = self.tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        im_end_id = self.tokenizer.convert_tokens_to_ids(IM_END)
        model = build_model(cfg, eos_id)
        model.generation_config = GenerationConfig(eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id)
        return model

    def setup_training(self, model: torch.nn.Module, log) -> None:
        cfg = self.cfg
        self.train_tokens = tokenize_files(self.tokenizer, [f.text for f in self.split.train])
        self.heldout_tokens = tokenize_files(self.tokenizer, [f.text for f in self.split.heldout])
        self.eval_tokens = self.heldout_tokens[: cfg.eval_tokens + 1]
        log(f"tokens: train {len(self.train_tokens):,}, held-out {len(self.heldout_tokens):,} "
            f"(eval on {len(self.eval_tokens) - 1:,})")
        self.data_description = {
            "source": "Python standard library sources (site-packages and test directories excluded)",
            "python": platform.python_version(),
            "sha256": self.split.digest(),
            "train_files": len(self.split.train),
            "heldout_files": len(self.split.heldout),
            "heldout_rule": f"sha256(relative path) % 100 < {HELDOUT_PERCENT}",
            "heldout_paths": [f.relpath for f in self.split.heldout],
            "train_tokens": len(self.train_tokens),
            "heldout_tokens": len(self.heldout_tokens),
        }

    def batch(self, step: int, micro: int, rank: int) -> torch.Tensor:
        """[B, seq_len + 1] random windows of the train stream."""
        cfg = self.cfg
        gen = batch_generator(cfg.seed, step, micro)
        starts = torch.randint(0, len(self.train_tokens) - cfg.seq_len - 1, (global_rows(cfg.batch_size),),
                               generator=gen)[shard_rows(cfg.batch_size, rank)]
        return torch.stack([self.train_tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()]).to(self.device)

    def forward(self, model: torch.nn.Module, batch: torch.Tensor, stage: dict) -> torch.Tensor:
        return model(input_ids=batch[:, :-1]).logits

    def loss(self, logits: torch.Tensor, batch: torch.Tensor, stage: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return next_token_ce(logits, batch)

    def evaluate(self, model: torch.nn.Module) -> dict:
        loss = heldout_loss(model, self.eval_tokens, self.cfg.seq_len, self.cfg.batch_size)
        return {"heldout_loss": loss, "heldout_perplexity": math.exp(loss)}

    def describe_eval(self, ev: dict) -> str:
        return f"loss {ev['heldout_loss']:.3f} (ppl {ev['heldout_perplexity']:.1f})"

    def postfix(self, stage: dict, stats: dict[str, float]) -> dict:
        return {"loss": f"{stats['loss']:.3f}"}

    def provenance(self, model: torch.nn.Module, state: dict, out: Path, train_seconds: float | None) -> dict:
        cfg = self.cfg
        final = heldout_loss(model, self.heldout_tokens, cfg.seq_len, cfg.batch_size)
        tokens_seen = state["step"] * cfg.batch_size * cfg.grad_accum * cfg.seq_len
        corpus = state.get("data") or {}
        history = state["history"]
        print(f"held-out loss {final:.3f} (ppl {math.exp(final):.1f})")
        return {
            "model": cfg.name or "tiny-base",
            "command": C.command_line(),
            "config": asdict(cfg),
            "seed": cfg.seed,
            "parameters": sum(p.numel() for p in model.parameters()),
            "corpus": corpus,
            "steps": state["step"],
            "tokens_seen": tokens_seen,
            "epochs": round(tokens_seen / corpus["train_tokens"], 3) if corpus.get("train_tokens") else None,
            "train_loss_last": history[-1]["loss"] if history else None,
            "heldout_loss": final,
            "heldout_perplexity": math.exp(final),
            "history": history,
            "tokenizer_seconds": round(getattr(self, "tokenizer_seconds", 0.0), 1),
            "train_seconds": round(state["elapsed_s"], 1),
            "total_seconds": round(train_seconds, 1) if train_seconds else None,
            "torch": torch.__version__,
            "saved_dtype": "bfloat16",
        }


def train_tiny_base(cfg: TinyBaseConfig) -> dict:
    return train(TinyBaseObjective(cfg))


# ------------------------------------------------------------------------------ CLI
CLI_OPTIONS = ("out", "steps", "time_budget_minutes", "seed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, TinyBaseConfig, only=CLI_OPTIONS)


def run(args: argparse.Namespace) -> int:
    cfg = C.from_args(TinyBaseConfig, args)
    check_package_write(cfg.out, "selfspec train tiny-base")
    train_tiny_base(cfg)
    return 0
