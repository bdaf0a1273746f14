"""I-DLM introspective-consistency conversion of a causal LM, and the gated LoRA for RISD.

`selfspec train idlm --base M --stride N [--curriculum 2,3,4] [--lora-rank R] [--data ...] --out DIR`

- Input: each training row is a window x of L+1 clean tokens; the model sees the packed
  row [MASK * L | x_0..x_{L-1}] (2L tokens, one forward), position ids 0..L-1 twice, and the
  I-DLM attention mask of `selfspec.training.masks` (MASK blocks of N-1 see the clean tokens
  before their block and the earlier MASKs of their block; the clean half is plain causal).
- Logit shift: the output at position p predicts x_{p+1} in both halves, so the clean half
  keeps the AR mapping (ISD's verify distribution p) and the MASK half learns the proposals q.
- Loss (`selfspec.training.losses`): CE_mask + scale * CE_clean; scale fixed (0.2) while
  N < `auto_balance_from` (default 4), auto-balanced from the N = 3 -> 4 expansion on.
- Stride curriculum: stages N = 2, 3, 4 ... share the run by `stage_fractions`.
- Full fine-tune (default) or LoRA (`lora_rank > 0`): PEFT adapters on `lora_targets`, base
  frozen, the LoRA residual gated per token to the MASK half (`selfspec.training.gating`,
  through the kernels' gated op), which is what RISD serves.
- Accelerate drives the loop (CPU, one GPU, or `accelerate launch` with DDP / FSDP /
  DeepSpeed); gradient accumulation; bf16 autocast on GPU; FlexAttention block mask on CUDA,
  explicit SDPA mask on CPU; tqdm; periodic held-out evaluation; checkpoints every
  `save_every` steps, `--resume` continues (bit-identically on CPU for a step-budgeted run).
- Time budget: with `time_budget_minutes`, the number of steps is re-planned from the measured
  step time (at step 10 and at every evaluation) so the cosine schedule and the curriculum
  finish inside the budget even on a busy machine. The plan is part of the checkpoint.
- Export (end of training, or `selfspec export`): `selfspec.training.export`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.errors import UsageError
from selfspec.training import masks as M
from selfspec.training.data import LOSS_CLEAN, LOSS_MASK_ONLY, batch_generator, load_data
from selfspec.training.export import (
    build_metadata,
    export_adapter,
    export_full,
    weights_sha256,
)
from selfspec.training.losses import IGNORE_INDEX, idlm_loss, shifted_labels
from selfspec.training.tokenizer import MASK_TOKEN

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class IDLMConfig:
    base: str
    out: str
    stride: int = 4
    curriculum: list[int] | None = None  # strides in order; default [stride]
    stage_fractions: list[float] | None = None  # share of the steps per stage; default equal
    lora_rank: int = 0  # 0: full fine-tune
    lora_alpha: float | None = None  # default 2 * rank
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    data: list[str] | None = None  # None: the stdlib corpus; several sources are mixed by data_weights
    data_weights: list[float] | None = None  # share of each micro-batch's rows per source (default equal)
    seq_len: int = 256
    batch_size: int = 8  # per process, per micro-batch
    grad_accum: int = 1
    steps: int = 1000
    time_budget_minutes: float | None = None
    lr: float = 1e-5
    min_lr_ratio: float = 0.1
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ce_scale: float = 0.2
    auto_balance_from: int = 4  # stages with N >= this use the auto-balanced clean loss
    mask_distill_weight: float = 0.0  # optional extra term (losses.self_distill_ce); 0 = the seed's loss
    ar_anchor_weight: float = 0.0  # optional extra term (losses.ar_anchor_kl), full fine-tune only; 0 = the seed's loss
    eval_every: int = 100
    eval_tokens: int = 16384
    eval_batch_size: int = 8
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 1
    checkpoint_dir: str | None = None  # default OUT/checkpoints
    resume: str | None = None  # "auto" (latest in checkpoint_dir) or a checkpoint path
    seed: int = 0
    threads: int | None = None
    mixed_precision: str = "auto"  # auto | no | bf16 | fp16
    attn_implementation: str = "auto"  # auto (flex on CUDA, sdpa on CPU) | sdpa | flex_attention | eager
    name: str | None = None  # model name recorded in provenance
    base_ref: str | None = None  # how an adapter names its base (default: --base as given)
    export: bool = True
    progress_bar: bool = True
    stop_after_steps: int | None = None  # leave after this many steps in this process, checkpointed (preemption)

    def check_data_paths(self) -> None:
        """Fail before the model loads, not minutes later. (Not in __post_init__: a recipe names
        data it generates on first use.)"""
        for source in self.data or []:
            if source != "stdlib" and not Path(source).expanduser().exists():
                raise UsageError(f"--data {source}: no such file or directory (give text / JSONL files, "
                                 "directories of them, or 'stdlib')")

    def __post_init__(self):
        if self.curriculum is None:
            self.curriculum = [self.stride]
        if self.curriculum[-1] != self.stride:
            raise UsageError(f"the curriculum must end at --stride {self.stride}: {self.curriculum}")
        if any(n < 2 for n in self.curriculum):
            raise UsageError(f"--stride / --curriculum {self.curriculum}: every stride must be >= 2 (N-1 MASK tokens per block)")
        if self.stage_fractions is None:
            self.stage_fractions = [1.0 / len(self.curriculum)] * len(self.curriculum)
        if len(self.stage_fractions) != len(self.curriculum):
            raise UsageError("--stage-fractions needs one value per curriculum stage")
        total = sum(self.stage_fractions)
        self.stage_fractions = [f / total for f in self.stage_fractions]
        if self.lora_rank and self.lora_alpha is None:
            self.lora_alpha = 2.0 * self.lora_rank

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0


# ------------------------------------------------------------------------------ schedule
def stage_index(cfg: IDLMConfig, step: int, planned: int) -> int:
    progress = step / max(1, planned)
    acc = 0.0
    for i, f in enumerate(cfg.stage_fractions):
        acc += f
        if progress < acc - 1e-12:
            return i
    return len(cfg.stage_fractions) - 1


def lr_at(cfg: IDLMConfig, step: int, planned: int) -> float:
    warmup = max(1, round(cfg.warmup_ratio * planned))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, planned - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def balance_for(cfg: IDLMConfig, stride: int) -> str:
    return "auto" if stride >= cfg.auto_balance_from else "fixed"


# ------------------------------------------------------------------------------ model
def resolve_attn_implementation(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "flex_attention" if device.type == "cuda" else "sdpa"


def ensure_mask_token(model, tokenizer) -> dict:
    """Make sure the tokenizer has [MASK] and the embeddings a row for it.

    A missing token is added as the tokenizer's mask token; a missing embedding row is added
    by resizing, and a newly added token's input (and, if untied, output) embedding is set to
    the mean of the existing rows. Returns what was done (recorded in the metadata)."""
    info = {"mask_token": None, "mask_token_id": None, "added_to_tokenizer": False, "embedding_resized": False,
            "initialised": "kept (existing row)"}
    vocab = tokenizer.get_vocab()
    if tokenizer.mask_token is None or tokenizer.mask_token not in vocab:
        if MASK_TOKEN in vocab:
            tokenizer.mask_token = MASK_TOKEN
        else:
            tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
            info["added_to_tokenizer"] = True
    mask_id = tokenizer.convert_tokens_to_ids(tokenizer.mask_token)
    emb = model.get_input_embeddings()
    n_old = emb.weight.shape[0]
    if mask_id >= n_old:
        model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
        info["embedding_resized"] = True
        emb = model.get_input_embeddings()
    if info["added_to_tokenizer"]:
        with torch.no_grad():
            rows = min(n_old, mask_id)
            emb.weight[mask_id] = emb.weight[:rows].float().mean(0).to(emb.weight.dtype)
            out = model.get_output_embeddings()
            if out is not None and out.weight.data_ptr() != emb.weight.data_ptr():
                out.weight[mask_id] = out.weight[:rows].float().mean(0).to(out.weight.dtype)
        info["initialised"] = "mean of the existing embedding rows"
    info["mask_token"] = tokenizer.mask_token
    info["mask_token_id"] = int(mask_id)
    return info


def load_base(base: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.models import resolve_model

    path = resolve_model(base)
    if (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        raise UsageError(f"--base must be a full model, not an adapter: {path}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    return path, model, tokenizer


def build_model(cfg: IDLMConfig, attn_implementation: str):
    """Base + [MASK] (+ gated LoRA). Returns (model, tokenizer, base_path, mask_info)."""
    base_path, model, tokenizer = load_base(cfg.base, attn_implementation)
    mask_info = ensure_mask_token(model, tokenizer)
    if cfg.is_lora:
        from peft import LoraConfig, get_peft_model

        from selfspec.training.gating import gate_lora_layers

        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.lora_targets),
                          lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, lcfg)
        gate_lora_layers(model)
    model.config.use_cache = False
    return model, tokenizer, base_path, mask_info


_MASK_CACHE: dict = {}


def _attention_mask(seq_len: int, stride: int, device, impl: str):
    key = (seq_len, stride, str(device), impl)
    if key not in _MASK_CACHE:
        _MASK_CACHE.clear() if len(_MASK_CACHE) > 8 else None
        _MASK_CACHE[key] = M.attention_mask_for(seq_len, stride, device, impl)
    return _MASK_CACHE[key]


def packed_forward(model, clean: torch.Tensor, stride: int, mask_token_id: int, attn_implementation: str,
                   gated: bool) -> torch.Tensor:
    """clean [B, L] -> logits [B, 2L, V] of the packed [MASK * L | clean] forward."""
    bsz, seq_len = clean.shape
    device = clean.device
    input_ids = M.packed_input_ids(clean, mask_token_id)
    position_ids = M.packed_position_ids(seq_len, device).expand(bsz, -1)
    attn = _attention_mask(seq_len, stride, device, attn_implementation)
    ctx = contextlib.nullcontext()
    if gated:
        from selfspec.training.gating import lora_gate

        ctx = lora_gate(model, M.mask_positions(bsz, seq_len, device))
    with ctx:
        return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attn, use_cache=False).logits


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(model, dataset, cfg: IDLMConfig, stride: int, mask_token_id: int, attn_implementation: str,
             device) -> dict:
    """Held-out metrics at stride N: AR (clean-half) CE / perplexity, MASK CE, per in-block
    offset j (the MASK at offset j predicts the token j+2 ahead of the last clean one) its CE
    and its greedy agreement with the AR path at the same position (argmax q == argmax p)."""
    was_training = model.training
    model.eval()
    block = stride - 1
    sums = {"clean": 0.0, "mask": 0.0, "n": 0}
    off_ce = [0.0] * block
    off_agree = [0] * block
    off_n = [0] * block
    for ids, lm in dataset.eval_batches(cfg.seq_len, cfg.eval_batch_size, cfg.eval_tokens):
        ids, lm = ids.to(device), lm.to(device)
        labels = shifted_labels(ids, lm > 0)
        logits = packed_forward(model, ids[:, :-1], stride, mask_token_id, attn_implementation,
                                gated=cfg.is_lora).float()
        seq_len = labels.shape[1]
        valid = labels != IGNORE_INDEX
        safe = labels.clamp_min(0)
        mlog, clog = logits[:, :seq_len], logits[:, seq_len:]
        m_ce = torch.nn.functional.cross_entropy(mlog.transpose(1, 2), safe, reduction="none")
        c_ce = torch.nn.functional.cross_entropy(clog.transpose(1, 2), safe, reduction="none")
        agree = mlog.argmax(-1) == clog.argmax(-1)
        offset = torch.arange(seq_len, device=device) % block
        sums["clean"] += float(c_ce[valid].sum())
        sums["mask"] += float(m_ce[valid].sum())
        sums["n"] += int(valid.sum())
        for j in range(block):
            sel = valid & (offset == j).unsqueeze(0)
            off_ce[j] += float(m_ce[sel].sum())
            off_agree[j] += int(agree[sel].sum())
            off_n[j] += int(sel.sum())
    if was_training:
        model.train()
    n = max(1, sums["n"])
    ar = sums["clean"] / n
    return {
        "stride": stride,
        "eval_tokens": sums["n"],
        "ar_loss": ar,
        "ar_perplexity": math.exp(ar),
        "mask_loss": sums["mask"] / n,
        "mask_loss_by_offset": [c / max(1, k) for c, k in zip(off_ce, off_n)],
        "greedy_agreement_by_offset": [a / max(1, k) for a, k in zip(off_agree, off_n)],
    }


# ------------------------------------------------------------------------------ checkpoints
def _checkpoint_root(cfg: IDLMConfig) -> Path:
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(cfg.out) / "checkpoints"


def latest_checkpoint(root: Path) -> Path | None:
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / "train_state.json").exists())
    return done[-1] if done else None


def _save_checkpoint(accelerator, cfg: IDLMConfig, state: dict) -> Path:
    root = _checkpoint_root(cfg)
    path = root / f"step-{state['step']:07d}"
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path / "accelerate"))
    if accelerator.is_main_process:
        (path / "train_state.json").write_text(json.dumps({**state, "config": asdict(cfg)}, indent=2) + "\n")
        old = sorted(p for p in root.glob("step-*") if p != path)
        for p in old[: max(0, len(old) - (cfg.keep_checkpoints - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


# ------------------------------------------------------------------------------ training
def _mixed_precision(cfg: IDLMConfig) -> str:
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    env = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if env:
        return env
    return "bf16" if torch.cuda.is_available() else "no"


def _replan(cfg: IDLMConfig, state: dict, loop_seconds: float, loop_steps: int, reserve_s: float) -> None:
    """Shrink or grow the planned steps so that the run ends inside its time budget."""
    if not cfg.time_budget_minutes or loop_steps <= 0:
        return
    per_step = loop_seconds / loop_steps
    left = cfg.time_budget_minutes * 60 - state["elapsed_s"] - reserve_s
    planned = state["step"] + max(1, int(left / per_step))
    state["planned_steps"] = int(max(state["step"] + 1, min(cfg.steps, planned)))


@torch.no_grad()
def anchor_teacher_logits(teacher: torch.nn.Module, ids: torch.Tensor, clean_labels: torch.Tensor) -> torch.Tensor:
    """The frozen base's logits [B, L, V] (fp32) for the AR anchor. The anchor reads only the
    positions with a clean label, so the teacher runs only on the rows that have one: on-policy
    rows (MASK half only, half of each recipe batch) get zeros that nothing reads."""
    rows = (clean_labels != IGNORE_INDEX).any(1)
    if bool(rows.all()):
        return teacher(input_ids=ids[:, :-1], use_cache=False).logits.float()
    out = torch.zeros(*clean_labels.shape, teacher.get_output_embeddings().weight.shape[0], device=ids.device)
    if bool(rows.any()):
        out[rows] = teacher(input_ids=ids[rows, :-1], use_cache=False).logits.float()
    return out


def train_idlm(cfg: IDLMConfig) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    started = time.time()
    cfg.check_data_paths()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=_mixed_precision(cfg))
    set_seed(cfg.seed)
    device = accelerator.device
    attn_impl = resolve_attn_implementation(cfg.attn_implementation, device)
    model, tokenizer, base_path, mask_info = build_model(cfg, attn_impl)
    mask_id = mask_info["mask_token_id"]
    data = load_data(tokenizer, cfg.data, cfg.data_weights)
    data_description = data.description
    accelerator.print(f"data: {data.train.num_tokens:,} train tokens, {data.heldout.num_tokens:,} held-out tokens; "
                      f"mask token {mask_info['mask_token']} = {mask_id}; attention {attn_impl}")

    teacher = None
    if cfg.ar_anchor_weight > 0 and not cfg.is_lora:  # the model as converted, before any step
        teacher = copy.deepcopy(model).eval().requires_grad_(False).to(device)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for _, p in params)
    n_total = sum(p.numel() for p in model.parameters())
    accelerator.print(f"model: {n_total / 1e6:.2f}M parameters, {n_trainable / 1e6:.3f}M trainable"
                      f" ({'LoRA r=%d' % cfg.lora_rank if cfg.is_lora else 'full fine-tune'})")
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    model, optimizer = accelerator.prepare(model, optimizer)

    state = {"step": 0, "planned_steps": cfg.steps, "stage": 0, "elapsed_s": 0.0, "history": [], "base_eval": None}
    resume_from = None
    if cfg.resume:
        resume_from = latest_checkpoint(_checkpoint_root(cfg)) if cfg.resume == "auto" else Path(cfg.resume)
        if cfg.resume != "auto" and not (resume_from / "train_state.json").is_file():
            raise UsageError(f"--resume {cfg.resume}: not a training checkpoint (no train_state.json); pass a "
                             f"step-* directory under {_checkpoint_root(cfg)} or --resume alone for the latest")
    if resume_from is not None:
        accelerator.load_state(str(resume_from / "accelerate"))
        saved = json.loads((resume_from / "train_state.json").read_text())
        saved.pop("config", None)
        state.update(saved)
        accelerator.print(f"resumed from {resume_from} at step {state['step']} of {state['planned_steps']}")

    state["data"] = data_description
    final_stride = cfg.stride
    if state["base_eval"] is None and accelerator.is_main_process:
        state["base_eval"] = evaluate(model, data.heldout, cfg, final_stride, mask_id, attn_impl, device)
        b = state["base_eval"]
        accelerator.print(f"before training: held-out AR loss {b['ar_loss']:.4f} (ppl {b['ar_perplexity']:.2f}), "
                          f"MASK loss {b['mask_loss']:.3f} at N={final_stride}")

    rank = accelerator.process_index
    model.train()
    loop_started = time.time()
    loop_steps = 0
    last_log = {}
    bar = tqdm(total=state["planned_steps"], initial=state["step"], desc=cfg.name or "idlm", unit="step",
               disable=not (cfg.progress_bar and accelerator.is_local_main_process), dynamic_ncols=True)
    segment_start = time.time()
    while state["step"] < state["planned_steps"]:
        step = state["step"]
        # a re-plan moves the stage boundaries; the curriculum never goes back to a shorter stride
        si = max(state.get("stage", 0), stage_index(cfg, step, state["planned_steps"]))
        state["stage"] = si
        stride = cfg.curriculum[si]
        balance = balance_for(cfg, stride)
        lr = lr_at(cfg, step, state["planned_steps"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        stats = {"mask_ce": 0.0, "clean_ce": 0.0, "scale": 0.0}
        for micro in range(cfg.grad_accum):
            ids, lm = data.train.sample(batch_generator(cfg.seed, step, micro, rank), cfg.batch_size, cfg.seq_len)
            ids, lm = ids.to(device), lm.to(device)
            labels = shifted_labels(ids, (lm & LOSS_MASK_ONLY) > 0)
            clean_labels = shifted_labels(ids, (lm & LOSS_CLEAN) > 0)
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    logits = packed_forward(model, ids[:, :-1], stride, mask_id, attn_impl, gated=cfg.is_lora)
                    teacher_logits = None if teacher is None else anchor_teacher_logits(teacher, ids, clean_labels)
                out = idlm_loss(logits, labels, balance, cfg.ce_scale, train_clean=not cfg.is_lora,
                                distill_weight=cfg.mask_distill_weight, clean_labels=clean_labels,
                                teacher_logits=teacher_logits, anchor_weight=cfg.ar_anchor_weight)
                accelerator.backward(out.total)
                if accelerator.sync_gradients and cfg.grad_clip:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            stats["mask_ce"] += float(out.mask_ce) / cfg.grad_accum
            stats["clean_ce"] += float(out.clean_ce) / cfg.grad_accum
            stats["scale"] += out.scale / cfg.grad_accum
            if out.anchor is not None:
                stats["anchor_kl"] = stats.get("anchor_kl", 0.0) + float(out.anchor) / cfg.grad_accum
        state["step"] = step + 1
        loop_steps += 1
        now = time.time()
        state["elapsed_s"] += now - segment_start
        segment_start = now
        last_log = {"step": state["step"], "stride": stride, "lr": lr, "balance": balance, **stats}
        bar.update(1)
        bar.set_postfix(N=stride, mask=f"{stats['mask_ce']:.3f}", clean=f"{stats['clean_ce']:.3f}",
                        scale=f"{stats['scale']:.2f}", lr=f"{lr:.1e}")

        if loop_steps == 10:
            _replan(cfg, state, time.time() - loop_started, loop_steps, reserve_s=_reserve(cfg))
            bar.total = state["planned_steps"]
        done = state["step"] >= state["planned_steps"]
        if (cfg.eval_every and state["step"] % cfg.eval_every == 0) or done:
            ev = evaluate(model, data.heldout, cfg, final_stride, mask_id, attn_impl, device) \
                if accelerator.is_main_process else {}
            state["history"].append({**last_log, "elapsed_s": round(state["elapsed_s"], 1), "heldout": ev})
            if ev:
                tqdm.write(f"step {state['step']}/{state['planned_steps']} N={stride}: train mask {stats['mask_ce']:.3f} "
                           f"clean {stats['clean_ce']:.3f} | held-out AR {ev['ar_loss']:.4f} (ppl {ev['ar_perplexity']:.2f}) "
                           f"MASK {ev['mask_loss']:.3f} agree@N={final_stride} "
                           + " ".join(f"{a:.2f}" for a in ev["greedy_agreement_by_offset"]))
            now = time.time()
            state["elapsed_s"] += now - segment_start
            segment_start = now
            if not done:
                _replan(cfg, state, time.time() - loop_started, loop_steps, reserve_s=_reserve(cfg))
                bar.total = state["planned_steps"]
        if cfg.save_every and state["step"] % cfg.save_every == 0 and state["step"] < state["planned_steps"]:
            _save_checkpoint(accelerator, cfg, state)
        if cfg.stop_after_steps and loop_steps >= cfg.stop_after_steps and state["step"] < state["planned_steps"]:
            bar.close()
            ckpt = _save_checkpoint(accelerator, cfg, state)
            accelerator.print(f"stopping after {loop_steps} steps as asked; resume from {ckpt}")
            return {"checkpoint": str(ckpt), "state": state, "model": accelerator.unwrap_model(model),
                    "tokenizer": tokenizer, "interrupted": True}
    bar.close()
    state["elapsed_s"] += time.time() - segment_start
    ckpt = _save_checkpoint(accelerator, cfg, state)
    result = {"checkpoint": str(ckpt), "state": state, "model": accelerator.unwrap_model(model), "tokenizer": tokenizer}
    if cfg.export and accelerator.is_main_process:
        result["export"] = str(export_model(accelerator.unwrap_model(model), tokenizer, cfg, state, base_path,
                                            mask_info, Path(cfg.out), train_seconds=time.time() - started))
    accelerator.wait_for_everyone()
    return result


def _reserve(cfg: IDLMConfig) -> float:
    """Seconds kept back from the time budget for the final evaluation and export."""
    return 30.0 + cfg.eval_tokens / 1000.0


# ------------------------------------------------------------------------------ export
def _command_line() -> str:
    return "selfspec " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name in ("selfspec", "cli.py") \
        else " ".join(sys.argv)


def export_model(model, tokenizer, cfg: IDLMConfig, state: dict, base_path: Path, mask_info: dict, out: Path,
                 train_seconds: float | None = None) -> Path:
    final = state["history"][-1]["heldout"] if state["history"] else {}
    base_eval = state.get("base_eval") or {}
    metrics = {
        "heldout_ar_loss": final.get("ar_loss"),
        "heldout_ar_perplexity": final.get("ar_perplexity"),
        "base_heldout_ar_perplexity": base_eval.get("ar_perplexity"),
        "heldout_mask_loss": final.get("mask_loss"),
        "mask_loss_by_offset": final.get("mask_loss_by_offset"),
        "greedy_agreement_by_offset": final.get("greedy_agreement_by_offset"),
        "eval_tokens": final.get("eval_tokens"),
        "steps": state["step"],
    }
    recipe = {"command": _command_line(), "config": asdict(cfg)}
    base_ref = cfg.base_ref or (cfg.base if not Path(cfg.base).exists() else str(Path(cfg.base).resolve()))
    provenance = {
        "model": cfg.name or out.name,
        "command": recipe["command"],
        "config": asdict(cfg),
        "seed": cfg.seed,
        "base": {"ref": base_ref, "path": str(base_path), "sha256": weights_sha256(base_path)},
        "data": state.get("data"),
        "mask_token": mask_info,
        "steps": state["step"],
        "tokens_seen": state["step"] * cfg.batch_size * cfg.grad_accum * cfg.seq_len,
        "train_seconds": round(state["elapsed_s"], 1),
        "total_seconds": round(train_seconds, 1) if train_seconds else None,
        "history": state["history"],
        "base_eval": base_eval,
        "metrics": metrics,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "saved_dtype": "bfloat16",
    }
    if cfg.is_lora:
        lora = {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": list(cfg.lora_targets),
                "base_sha256": provenance["base"]["sha256"]}
        meta = build_metadata(mode="risd", stride=cfg.stride, mask_token=mask_info["mask_token"],
                              mask_token_id=mask_info["mask_token_id"], lora=lora, base_model=base_ref,
                              converted_from=None, recipe=recipe, metrics=metrics)
        return export_adapter(model, tokenizer, out, meta, base_ref, provenance)
    meta = build_metadata(mode="isd", stride=cfg.stride, mask_token=mask_info["mask_token"],
                          mask_token_id=mask_info["mask_token_id"], lora=None, base_model=None,
                          converted_from=base_ref, recipe=recipe, metrics=metrics)
    return export_full(model, tokenizer, out, meta, provenance)


def export_from_checkpoint(checkpoint: Path, out: Path) -> Path:
    """`selfspec export`: rebuild the model of a training checkpoint and export it."""
    from safetensors.torch import load_file

    checkpoint = Path(checkpoint)
    if not (checkpoint / "train_state.json").exists():
        latest = latest_checkpoint(checkpoint) or latest_checkpoint(checkpoint / "checkpoints")
        if latest is None:
            raise UsageError(f"no training checkpoint in {checkpoint}")
        checkpoint = latest
    saved = json.loads((checkpoint / "train_state.json").read_text())
    cfg = IDLMConfig(**saved.pop("config"))
    model, tokenizer, base_path, mask_info = build_model(cfg, "sdpa")
    weights = checkpoint / "accelerate" / "model.safetensors"
    if weights.exists():
        sd = load_file(weights)
    else:
        sd = torch.load(checkpoint / "accelerate" / "pytorch_model.bin", map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed_tokens" in k}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
    return export_model(model, tokenizer, cfg, saved, base_path, mask_info, Path(out))


# ------------------------------------------------------------------------------ CLI
def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = IDLMConfig(base="", out="")
    parser.add_argument("--base", required=True, help="base causal LM: embedded name or HF checkpoint directory "
                        "(Qwen3, Qwen2, Llama, ...)")
    parser.add_argument("--out", required=True, help="export directory")
    parser.add_argument("--stride", type=int, default=d.stride, help="final ISD stride N (N-1 MASKs per block)")
    parser.add_argument("--curriculum", type=_int_list, default=None, help="strides in order, e.g. 2,3,4 "
                        "(must end at --stride; default: --stride only)")
    parser.add_argument("--stage-fractions", type=_float_list, default=None,
                        help="share of the steps per curriculum stage, e.g. 0.25,0.25,0.5 (default equal)")
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: train a gated LoRA (RISD) on a frozen base")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * rank)")
    parser.add_argument("--lora-targets", type=lambda s: [x for x in s.split(",") if x], default=None,
                        help="comma-separated module names (default: all attention and MLP projections)")
    parser.add_argument("--data", nargs="+", default=None,
                        help="'stdlib' (default) or text / JSONL files or directories (JSONL: text, prompt+response, "
                             "or messages records; chat records train on the responses only)")
    parser.add_argument("--data-weights", type=_float_list, default=None,
                        help="with several --data sources: share of each micro-batch per source, e.g. 0.5,0.5")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="clean tokens per row (the forward sees 2x)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per process per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=d.grad_accum)
    parser.add_argument("--steps", type=int, default=d.steps, help="optimizer steps at most")
    parser.add_argument("--time-budget-minutes", type=float, default=None,
                        help="re-plan the steps so that training (schedule and curriculum) ends inside this budget")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    parser.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip)
    parser.add_argument("--ce-scale", type=float, default=d.ce_scale, help="fixed clean-CE scale (default 0.2)")
    parser.add_argument("--auto-balance-from", type=int, default=d.auto_balance_from,
                        help="stages with stride >= this auto-balance the clean CE (default 4)")
    parser.add_argument("--mask-distill-weight", type=float, default=d.mask_distill_weight,
                        help="optional extra loss: soft CE of the MASK distribution towards the detached clean-half "
                             "distribution at the same position (default 0: the seed's loss exactly)")
    parser.add_argument("--ar-anchor-weight", type=float, default=d.ar_anchor_weight,
                        help="optional extra loss (full fine-tune): KL from the frozen base to the clean half, "
                             "holding the AR path to the base (default 0: the seed's loss exactly)")
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--eval-tokens", type=int, default=d.eval_tokens)
    parser.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every K steps (0: at the end)")
    parser.add_argument("--checkpoint-dir", default=None, help="default OUT/checkpoints")
    parser.add_argument("--resume", nargs="?", const="auto", default=None,
                        help="resume from the latest checkpoint (or the one given)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16", "fp16"])
    parser.add_argument("--attn-implementation", default="auto",
                        choices=["auto", "sdpa", "flex_attention", "eager"])
    parser.add_argument("--name", default=None, help="model name recorded in the provenance")
    parser.add_argument("--base-ref", default=None,
                        help="how the adapter's metadata names its base (default: --base as given)")
    parser.add_argument("--no-export", action="store_true")


def config_from_args(args: argparse.Namespace) -> IDLMConfig:
    kw = {k: getattr(args, k) for k in (
        "base", "out", "stride", "curriculum", "stage_fractions", "lora_rank", "lora_alpha", "data", "data_weights",
        "seq_len",
        "batch_size", "grad_accum", "steps", "time_budget_minutes", "lr", "min_lr_ratio", "warmup_ratio",
        "weight_decay", "grad_clip", "ce_scale", "auto_balance_from", "mask_distill_weight", "ar_anchor_weight", "eval_every", "eval_tokens", "save_every",
        "checkpoint_dir", "resume", "seed", "threads", "mixed_precision", "attn_implementation", "name", "base_ref")}
    if args.lora_targets:
        kw["lora_targets"] = args.lora_targets
    kw["export"] = not args.no_export
    return IDLMConfig(**kw)


def run(args: argparse.Namespace) -> int:
    result = train_idlm(config_from_args(args))
    if "export" in result:
        print(f"exported {result['export']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.idlm", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
