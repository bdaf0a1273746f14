"""I-DLM introspective-consistency conversion of a causal LM, and the gated LoRA for RISD.

`selfspec train idlm --base M --stride N [--curriculum 2,3,4] [--lora-rank R] [--data ...] --out DIR`

The I-DLM objective of the training loop (`selfspec.training.loop`, which owns the schedule,
time budget, accumulation, Accelerate, checkpoints / resume, evaluation cadence and export):
- Input: each training row is a window x of L+1 clean tokens; the model sees the packed
  row [MASK * L | x_0..x_{L-1}] (2L tokens, one forward), position ids 0..L-1 twice, and the
  I-DLM attention mask of `selfspec.training.idlm.masks` (MASK blocks of N-1 see the clean tokens
  before their block and the earlier MASKs of their block; the clean half is plain causal).
  FlexAttention block mask on CUDA, explicit SDPA mask on CPU.
- Logit shift: the output at position p predicts x_{p+1} in both halves, so the clean half
  keeps the AR mapping (ISD's verify distribution p) and the MASK half learns the proposals q.
- Loss (`selfspec.training.losses`): CE_mask + scale * CE_clean; scale fixed (0.2) while
  N < `auto_balance_from` (default 4), auto-balanced from the N = 3 -> 4 expansion on;
  optional MASK self-distillation and AR anchor (KL from the frozen base) terms.
- Stride curriculum: stages N = 2, 3, 4 ... share the (re-planned) run by `stage_fractions`.
- Full fine-tune (default) or LoRA (`lora_rank > 0`): PEFT adapters on `lora_targets`, base
  frozen, the LoRA residual gated per token to the MASK half (`selfspec.training.idlm.gating`,
  through the kernels' gated op), which is what RISD serves.
- Held-out evaluation: AR perplexity, MASK CE, per-offset agreement with the AR path.
- Export: a full checkpoint (mode "isd") or the adapter alone (mode "risd"), with the
  metadata `IDLMObjective.metadata` gives (`selfspec.training.export`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.checkpoints.metadata import LoraMetadata, SelfspecMetadata, weights_sha256
from selfspec.errors import UsageError
from selfspec.training import config as C
from selfspec.training.idlm import masks as M
from selfspec.training.config import LoopConfig, option
from selfspec.training.data import LOSS_CLEAN, LOSS_MASK, batch_generator, load_data
from selfspec.training.distributed import global_rows, shard_rows, take_rows
from selfspec.training.loop import train
from selfspec.training.objective import Objective
from selfspec.training.losses import IGNORE_INDEX, idlm_loss, shifted_labels
from selfspec.training.tokenizer import MASK_TOKEN

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(kw_only=True)
class IDLMConfig(LoopConfig):
    """I-DLM"""

    base: str = option(help="base causal LM: embedded name or HF checkpoint directory (Qwen3, Qwen2, Llama, ...)")
    stride: int = option(4, help="final ISD stride N (N-1 MASKs per block)")
    curriculum: list[int] | None = option(
        None, help="strides in order, e.g. 2,3,4 (must end at --stride; default: --stride only)")
    stage_fractions: list[float] | None = option(
        None, help="share of the steps per curriculum stage, e.g. 0.25,0.25,0.5 (default equal)")
    lora_rank: int = option(0, help="> 0: train a gated LoRA (RISD) on a frozen base")
    lora_alpha: float | None = option(None, help="LoRA alpha (default 2 * rank)")
    lora_targets: list[str] = option(default_factory=lambda: list(DEFAULT_LORA_TARGETS),
                                     help="comma-separated module names (default: all attention and MLP projections)")
    data: list[str] | None = option(
        None, nargs="+", help="'stdlib' (default) or text / JSONL files or directories (JSONL: text, prompt+response, "
                              "or messages records; chat records train on the responses only)")
    data_weights: list[float] | None = option(
        None, help="with several --data sources: share of each micro-batch per source, e.g. 0.5,0.5")
    seq_len: int = option(256, help="clean tokens per row (the forward sees 2x)")
    ce_scale: float = option(0.2, help="fixed clean-CE scale (default 0.2)")
    auto_balance_from: int = option(4, help="stages with stride >= this auto-balance the clean CE (default 4)")
    mask_distill_weight: float = option(
        0.0, help="optional extra loss: soft CE of the MASK distribution towards the detached clean-half "
                  "distribution at the same position (default 0: CE_mask + scale * CE_clean alone)")
    mask_distill_temperatures: list[float] = option(
        default_factory=lambda: [1.0],
        help="temperatures of that distillation, one per batch in turn (e.g. 1.0,0.7: every other batch "
             "matches the MASK and clean distributions tempered to 0.7, a sampling server's temperature)")
    ar_anchor_weight: float = option(
        0.0, help="optional extra loss (full fine-tune): KL from the frozen base to the clean half, "
                  "holding the AR path to the base (default 0: CE_mask + scale * CE_clean alone)")
    eval_batch_size: int = option(8, help="rows per held-out evaluation batch")
    attn_implementation: str = option("auto", choices=["auto", "sdpa", "flex_attention", "eager"],
                                      help="auto: flex_attention on CUDA, sdpa on CPU")
    base_ref: str | None = option(None, help="how the adapter's metadata names its base (default: --base as given)")

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
        if not self.mask_distill_temperatures or any(t <= 0 for t in self.mask_distill_temperatures):
            raise UsageError(f"--mask-distill-temperatures {self.mask_distill_temperatures}: give one or more "
                             "temperatures > 0, e.g. 1.0,0.7")
        if self.lora_rank and self.lora_alpha is None:
            self.lora_alpha = 2.0 * self.lora_rank

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0


# ------------------------------------------------------------------------------ stride curriculum
def stage_index(cfg: IDLMConfig, step: int, planned: int) -> int:
    progress = step / max(1, planned)
    acc = 0.0
    for i, f in enumerate(cfg.stage_fractions):
        acc += f
        if progress < acc - 1e-12:
            return i
    return len(cfg.stage_fractions) - 1


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

        from selfspec.training.idlm.gating import gate_lora_layers

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
        from selfspec.training.idlm.gating import lora_gate

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


# ------------------------------------------------------------------------------ objective
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


class IDLMObjective(Objective):
    """I-DLM conversion (full fine-tune or gated LoRA) as an objective of the training loop."""

    name = "idlm"
    config_class = IDLMConfig
    cfg: IDLMConfig

    def __init__(self, cfg: IDLMConfig):
        super().__init__(cfg)
        self.data = None
        self.teacher = None  # the frozen base of the AR anchor

    def build_model(self, device: torch.device) -> torch.nn.Module:
        self.device = device
        self.attn_impl = resolve_attn_implementation(self.cfg.attn_implementation, device)
        model, self.tokenizer, self.base_path, self.mask_info = build_model(self.cfg, self.attn_impl)
        self.mask_id = self.mask_info["mask_token_id"]
        return model

    def setup_training(self, model: torch.nn.Module, log) -> None:
        cfg = self.cfg
        self.data = load_data(self.tokenizer, cfg.data, cfg.data_weights)
        self.data_description = self.data.description
        log(f"data: {self.data.train.num_tokens:,} train tokens, {self.data.heldout.num_tokens:,} held-out tokens; "
            f"mask token {self.mask_info['mask_token']} = {self.mask_id}; attention {self.attn_impl}; "
            + (f"LoRA r={cfg.lora_rank}" if cfg.is_lora else "full fine-tune"))
        if cfg.ar_anchor_weight > 0 and not cfg.is_lora:  # the model as converted, before any step
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False).to(self.device)

    def stage(self, step: int, planned_steps: int, state: dict) -> dict:
        # a re-plan moves the stage boundaries; the curriculum never goes back to a shorter stride
        si = max(state.get("stage", 0), stage_index(self.cfg, step, planned_steps))
        state["stage"] = si
        stride = self.cfg.curriculum[si]
        stage = {"stride": stride, "balance": balance_for(self.cfg, stride)}
        if self.cfg.mask_distill_weight > 0:
            temps = self.cfg.mask_distill_temperatures
            stage["distill_temperature"] = temps[step % len(temps)]
        return stage

    def batch(self, step: int, micro: int, rank: int):
        """(ids [B, L+1], MASK-half labels [B, L], clean-half labels [B, L])."""
        cfg = self.cfg
        ids, lm = self.data.train.sample(batch_generator(cfg.seed, step, micro), global_rows(cfg.batch_size),
                                         cfg.seq_len)
        ids, lm = take_rows((ids, lm), shard_rows(cfg.batch_size, rank))
        ids, lm = ids.to(self.device), lm.to(self.device)
        return ids, shifted_labels(ids, (lm & LOSS_MASK) > 0), shifted_labels(ids, (lm & LOSS_CLEAN) > 0)

    def forward(self, model: torch.nn.Module, batch, stage: dict):
        ids, _, clean_labels = batch
        logits = packed_forward(model, ids[:, :-1], stage["stride"], self.mask_id, self.attn_impl,
                                gated=self.cfg.is_lora)
        teacher_logits = None if self.teacher is None else anchor_teacher_logits(self.teacher, ids, clean_labels)
        return logits, teacher_logits

    def loss(self, outputs, batch, stage: dict) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        (logits, teacher_logits), (_, labels, clean_labels) = outputs, batch
        out = idlm_loss(logits, labels, stage["balance"], cfg.ce_scale, train_clean=not cfg.is_lora,
                        distill_weight=cfg.mask_distill_weight, clean_labels=clean_labels,
                        teacher_logits=teacher_logits, anchor_weight=cfg.ar_anchor_weight,
                        distill_temperature=stage.get("distill_temperature", 1.0))
        stats = {"mask_ce": float(out.mask_ce), "clean_ce": float(out.clean_ce), "scale": out.scale}
        if out.distill is not None:
            stats["distill_ce"] = float(out.distill)
        if out.anchor is not None:
            stats["anchor_kl"] = float(out.anchor)
        return out.total, stats

    def evaluate(self, model: torch.nn.Module) -> dict:
        return evaluate(model, self.data.heldout, self.cfg, self.cfg.stride, self.mask_id, self.attn_impl, self.device)

    def describe_eval(self, ev: dict) -> str:
        return (f"AR loss {ev['ar_loss']:.4f} (ppl {ev['ar_perplexity']:.2f}) MASK loss {ev['mask_loss']:.3f} "
                f"agree@N={ev['stride']} " + " ".join(f"{a:.2f}" for a in ev["greedy_agreement_by_offset"]))

    def postfix(self, stage: dict, stats: dict[str, float]) -> dict:
        return {"N": stage["stride"], "mask": f"{stats['mask_ce']:.3f}", "clean": f"{stats['clean_ce']:.3f}",
                "scale": f"{stats['scale']:.2f}"}

    # -------------------------------------------------------------------------- export
    @property
    def base_ref(self) -> str:
        cfg = self.cfg
        return cfg.base_ref or (cfg.base if not Path(cfg.base).exists() else str(Path(cfg.base).resolve()))

    @functools.cached_property
    def base_sha256(self) -> str:
        try:
            return weights_sha256(self.base_path)
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None

    def _metrics(self, state: dict) -> dict:
        final = state["history"][-1]["heldout"] if state["history"] else {}
        base_eval = state.get("base_eval") or {}
        return {
            "heldout_ar_loss": final.get("ar_loss"),
            "heldout_ar_perplexity": final.get("ar_perplexity"),
            "base_heldout_ar_perplexity": base_eval.get("ar_perplexity"),
            "heldout_mask_loss": final.get("mask_loss"),
            "mask_loss_by_offset": final.get("mask_loss_by_offset"),
            "greedy_agreement_by_offset": final.get("greedy_agreement_by_offset"),
            "eval_tokens": final.get("eval_tokens"),
            "steps": state["step"],
        }

    def metadata(self, state: dict) -> SelfspecMetadata:
        cfg = self.cfg
        common = dict(stride=cfg.stride, mask_token=self.mask_info["mask_token"],
                      mask_token_id=self.mask_info["mask_token_id"],
                      recipe={"command": C.command_line(), "config": asdict(cfg)}, metrics=self._metrics(state))
        if cfg.is_lora:
            lora = LoraMetadata(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=list(cfg.lora_targets),
                                base_sha256=self.base_sha256)
            return SelfspecMetadata(mode="risd", lora=lora, base_model=self.base_ref, **common)
        return SelfspecMetadata(mode="isd", converted_from=self.base_ref, **common)

    def provenance(self, model, state: dict, out: Path, train_seconds: float | None) -> dict:
        cfg = self.cfg
        return {
            "model": cfg.name or out.name,
            "command": C.command_line(),
            "config": asdict(cfg),
            "seed": cfg.seed,
            "base": {"ref": self.base_ref, "path": str(self.base_path), "sha256": self.base_sha256},
            "data": state.get("data"),
            "mask_token": self.mask_info,
            "steps": state["step"],
            "tokens_seen": state["step"] * cfg.batch_size * cfg.grad_accum * cfg.seq_len,
            "train_seconds": round(state["elapsed_s"], 1),
            "total_seconds": round(train_seconds, 1) if train_seconds else None,
            "history": state["history"],
            "base_eval": state.get("base_eval") or {},
            "metrics": self._metrics(state),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "saved_dtype": "bfloat16",
        }


def train_idlm(cfg: IDLMConfig) -> dict:
    cfg.check_data_paths()
    return train(IDLMObjective(cfg))


# ------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, IDLMConfig)


def run(args: argparse.Namespace) -> int:
    result = train_idlm(C.from_args(IDLMConfig, args))
    if "export" in result:
        print(f"exported {result['export']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.idlm.objective", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
