"""Recipe of the embedded base model `tiny-base`: a ~5M-parameter Qwen3 trained on the stdlib.

`selfspec train tiny-base` runs it end to end: tokenizer, model, held-out evaluation, bf16
export with provenance. Deterministic for a seed on one machine (CPU, fixed thread count).
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.training.corpus import HELDOUT_PERCENT, load_stdlib_split
from selfspec.training.tokenizer import EOS_TOKEN, IM_END, train_bpe_tokenizer


@dataclass
class TinyBaseConfig:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 4096
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 2400
    warmup_steps: int = 60
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 150
    eval_tokens: int = 65536
    seed: int = 0
    threads: int = 1  # one thread: on a shared 2-core machine two OpenMP threads stall each other
    time_budget_minutes: float = 45.0  # of the training loop; tokenizer and export come on top
    extra: dict = field(default_factory=dict)


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


def _progress(step: int, elapsed_s: float, cfg: TinyBaseConfig) -> float:
    """Fraction of the run done: by steps, or by wall-clock when the time budget binds first.

    The cosine schedule follows whichever is further along, so a run on a busy machine still
    anneals fully inside its time budget instead of being cut off at a high learning rate.
    """
    return max(step / cfg.steps, elapsed_s / (cfg.time_budget_minutes * 60))


def _lr_at(step: int, progress: float, cfg: TinyBaseConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


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
    n = (len(tokens) - 1) // seq_len
    total, count = 0.0, 0
    for start in range(0, n, batch_size):
        rows = range(start, min(n, start + batch_size))
        x = torch.stack([tokens[r * seq_len : r * seq_len + seq_len] for r in rows])
        y = torch.stack([tokens[r * seq_len + 1 : r * seq_len + seq_len + 1] for r in rows])
        logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        total += loss.item()
        count += y.numel()
    model.train()
    return total / count


def train_tiny_base(out_dir: Path, cfg: TinyBaseConfig) -> dict:
    from transformers import GenerationConfig

    started = time.time()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    split = load_stdlib_split()
    print(f"corpus: {len(split.train)} train files, {len(split.heldout)} held-out files from {split.root}")
    tokenizer = train_bpe_tokenizer((f.text for f in split.train), cfg.vocab_size, out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    tokenizer_seconds = time.time() - started

    train_tokens = tokenize_files(tokenizer, [f.text for f in split.train])
    heldout_tokens = tokenize_files(tokenizer, [f.text for f in split.heldout])
    eval_tokens = heldout_tokens[: cfg.eval_tokens + 1]
    print(f"tokens: train {len(train_tokens):,}, held-out {len(heldout_tokens):,} (eval on {len(eval_tokens) - 1:,})")

    model = build_model(cfg, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict] = []
    loop_started = time.time()
    steps_done = 0
    model.train()
    bar = tqdm(range(cfg.steps), desc="tiny-base", unit="step")
    for step in bar:
        starts = torch.randint(0, len(train_tokens) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = torch.stack([train_tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()])
        progress = _progress(step, time.time() - loop_started, cfg)
        if progress >= 1.0:
            tqdm.write(f"time budget of {cfg.time_budget_minutes} min reached at step {steps_done}")
            break
        lr = _lr_at(step, progress, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        steps_done = step + 1
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}")
        if steps_done % cfg.eval_every == 0 or steps_done == cfg.steps:
            ho = heldout_loss(model, eval_tokens, cfg.seq_len, cfg.batch_size)
            history.append({"step": steps_done, "train_loss": loss.item(), "heldout_loss": ho,
                            "elapsed_s": round(time.time() - started, 1)})
            tqdm.write(f"step {steps_done}: train {loss.item():.3f}  held-out {ho:.3f} (ppl {math.exp(ho):.1f})")

    final_heldout = heldout_loss(model, heldout_tokens, cfg.seq_len, cfg.batch_size)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    provenance = {
        "model": "tiny-base",
        "command": "selfspec train tiny-base " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["train", "tiny-base"] else " ".join(sys.argv),
        "config": asdict(cfg),
        "seed": cfg.seed,
        "parameters": n_params,
        "corpus": {
            "source": "Python standard library sources (site-packages and test directories excluded)",
            "python": platform.python_version(),
            "sha256": split.digest(),
            "train_files": len(split.train),
            "heldout_files": len(split.heldout),
            "heldout_rule": f"sha256(relative path) % 100 < {HELDOUT_PERCENT}",
            "heldout_paths": [f.relpath for f in split.heldout],
            "train_tokens": len(train_tokens),
            "heldout_tokens": len(heldout_tokens),
        },
        "steps": steps_done,
        "tokens_seen": steps_done * cfg.batch_size * cfg.seq_len,
        "epochs": round(steps_done * cfg.batch_size * cfg.seq_len / len(train_tokens), 3),
        "train_loss_last": history[-1]["train_loss"] if history else None,
        "heldout_loss": final_heldout,
        "heldout_perplexity": math.exp(final_heldout),
        "history": history,
        "tokenizer_seconds": round(tokenizer_seconds, 1),
        "total_seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
        "saved_dtype": "bfloat16",
    }
    (out_dir / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(f"saved {out_dir}: held-out loss {final_heldout:.3f} (ppl {math.exp(final_heldout):.1f}) "
          f"in {provenance['total_seconds'] / 60:.1f} min")
    return provenance
