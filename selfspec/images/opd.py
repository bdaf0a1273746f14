"""Visual on-policy distillation (OPD) with a swappable rollout backend (the HB-SJD paper).

    selfspec train opd --teacher tiny-c2i-teacher --student tiny-c2i-student \\
        --rollout ar|hbsjd [--verify greedy|prob] [--objective gkd|varkd] --out DIR

Each step takes real train digits' classes and their first `--prefix-ratio` of codes; with
probability `--on-policy` (λ) the student completes them itself - frozen, in eval mode, under
classifier-free guidance - with the chosen backend (`--rollout ar`: cached AR; `hbsjd`:
Independent HB-SJD with Hybrid execution; greedy or probabilistic verification), otherwise the
real completion is used. The loss compares the student's and the teacher's next-code
distributions (conditional logits, codes only) on the generated suffix and, with weight
`--prefix-weight`, on the real prefix:
- `gkd`: the generalised Jensen-Shannon divergence with `--beta` (0 forward KL, 1 reverse KL;
  GKD, Agarwal et al. 2023), token-level;
- `varkd`: a VarKD-style objective (`losses.varkd_lite`: selective teacher supervision on
  student samples, teacher targets truncated to their top-k) - our reading of a paper without
  public code, named for what it is; knobs `--varkd-confidence`, `--varkd-top-k`.
The backend changes nothing but the rollouts' speed: greedy HB-SJD gives cached AR's tokens.
Rollout time is measured per step and recorded (provenance `rollout_seconds`); evaluation
samples `--eval-images` images (T = 1, CFG) and reports FID / IS / precision / recall / class
accuracy against the real digits (`images.evaluate`). Checkpoints, resume, tqdm and export
are the training loop's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.errors import UsageError
from selfspec.training import config as C
from selfspec.training.config import LoopConfig, option
from selfspec.training.data import batch_generator
from selfspec.training.distributed import global_rows, shard_rows
from selfspec.training.losses import generalized_jsd, varkd_lite
from selfspec.training.loop import train
from selfspec.training.objective import Objective


@dataclass(kw_only=True)
class OPDConfig(LoopConfig):
    """on-policy distillation"""

    out: str = option(help="export directory of the distilled student")
    teacher: str = option("tiny-c2i-teacher", help="teacher image-token model (frozen)")
    student: str = option("tiny-c2i-student", help="student image-token model (trained)")
    rollout: str = option("hbsjd", choices=["ar", "hbsjd"], help="student rollout backend")
    verify: str = option("greedy", choices=["greedy", "prob"],
                         help="rollout decoding: greedy, or sampling (AR sampling / SJD p/q verification)")
    objective: str = option("gkd", choices=["gkd", "varkd"], help="distillation loss")
    beta: float = option(0.5, help="GKD's beta: 0 forward KL, 1 reverse KL, between: generalised JSD")
    on_policy: float = option(1.0, help="lambda: share of steps on the student's own rollouts")
    prefix_ratio: float = option(0.5, help="share of each real digit's codes given before the rollout")
    prefix_weight: float = option(1.0, help="loss weight of the real prefix's positions (0: the suffix alone, "
                                            "as in the HB-SJD paper; positions no loss sees drift, and sampling "
                                            "starts there)")
    cfg_scale: float = option(2.0, help="guidance scale of the rollouts")
    label_dropout: float = option(0.1, help="share of rows distilled with the null class for both models (keeps "
                                            "the unconditional branch that guidance subtracts in step)")
    temperature: float = option(1.0, help="rollout temperature with --verify prob")
    window: int = option(8, help="HB-SJD window W")
    history_offset: int = option(14, help="HB-SJD history offset H (14: one row up)")
    compaction_costs: str | None = option(None, help="Hybrid execution's cost table, a `selfspec calibrate-gamma` "
                                                     "JSON (default: measured at start)")
    varkd_confidence: float = option(0.3, help="varkd: teacher top-1 probability that selects a position")
    varkd_top_k: int = option(16, help="varkd: teacher codes kept (and renormalised) in the target")
    eval_images: int = option(200, help="images sampled per evaluation (FID / IS / P / R / class accuracy)")
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    batch_size: int = 16
    steps: int = 200
    eval_every: int = 50
    threads: int | None = 2
    mixed_precision: str = "no"

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise UsageError(f"--beta must be in [0, 1], got {self.beta}")
        if not 0.0 <= self.on_policy <= 1.0:
            raise UsageError(f"--on-policy must be in [0, 1], got {self.on_policy}")
        if not 0.0 <= self.prefix_ratio < 1.0:
            raise UsageError(f"--prefix-ratio must be in [0, 1), got {self.prefix_ratio}")
        if not 0.0 <= self.prefix_weight <= 1.0:
            raise UsageError(f"--prefix-weight must be in [0, 1], got {self.prefix_weight}")
        if not 0.0 <= self.label_dropout < 1.0:
            raise UsageError(f"--label-dropout must be in [0, 1), got {self.label_dropout}")
        if self.verify == "prob" and self.temperature <= 0:
            raise UsageError("--verify prob samples: --temperature must be > 0")
        if self.window < 1 or self.history_offset < 1:
            raise UsageError("--window and --history-offset must be >= 1")


def rollout_config(cfg: OPDConfig, backend: str, costs):
    """The rollouts of `backend` under `cfg`: cached AR (window 0), or HB-SJD with Hybrid execution
    deciding by `costs` (`hbsjd.CompactionCosts`)."""
    from selfspec.images.rollout import RolloutConfig

    hbsjd = backend == "hbsjd"
    return RolloutConfig(window=cfg.window if hbsjd else 0, history_offset=cfg.history_offset, verify=cfg.verify,
                         execution="hybrid" if hbsjd else "compact", costs=costs if hbsjd else None,
                         cfg_scale=cfg.cfg_scale, temperature=cfg.temperature)


def _costs_json(costs) -> dict | None:
    return None if costs is None else {str(b): c for b, c in costs.to_sweep().items()}


def _restricted(logits: torch.Tensor, num_codes: int) -> torch.Tensor:
    from selfspec.images.cfg import restrict_to_codes

    return restrict_to_codes(logits.float(), num_codes)


class OPDObjective(Objective):
    name = "opd"
    config_class = OPDConfig
    cfg: OPDConfig

    def build_model(self, device: torch.device) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        from selfspec.models import resolve_model
        from selfspec.images.gpt import ImageTokenLayout

        self.device = device
        path = resolve_model(self.cfg.student)
        self.layout = ImageTokenLayout.load(path)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)

    def setup_training(self, model: torch.nn.Module, log) -> None:
        from selfspec.images.model import load_image_model
        from selfspec.images.data import digit_split

        cfg = self.cfg
        self.teacher = load_image_model(cfg.teacher, device=str(self.device))
        if self.teacher.layout != self.layout:
            raise UsageError(f"teacher {cfg.teacher} and student {cfg.student} use different token layouts")
        for p in self.teacher.model.parameters():
            p.requires_grad_(False)
        self.vq = self.teacher.vq
        split = digit_split()
        self.codes = self.vq.encode(split.train_images)
        self.labels = split.train_labels
        self.real_images = torch.cat([split.train_images, split.heldout_images])
        self.heldout_codes, self.heldout_labels = self.vq.encode(split.heldout_images), split.heldout_labels
        self.rollout_config = self._rollout_config(model, log)
        self.rollout_seconds = None
        self.eval_durations: list[float] = []  # this process's evaluations, in order (the first: before training)
        self.data_description = {**split.describe(), "teacher": cfg.teacher, "student": cfg.student}

    def _rollout_config(self, model, log):
        from selfspec.images.gamma import calibrated_costs, load_costs

        cfg, costs = self.cfg, None
        if cfg.rollout == "hbsjd":
            if cfg.compaction_costs:
                costs = load_costs(cfg.compaction_costs)
            else:
                costs = calibrated_costs(model, cfg.batch_size, cfg.window, guided=cfg.cfg_scale != 1.0)
                log(f"hybrid execution: compaction costs measured at batch {cfg.batch_size}, window {cfg.window}")
        return rollout_config(cfg, cfg.rollout, costs)

    def stage(self, step: int, planned_steps: int, state: dict) -> dict:
        if self.rollout_seconds is None:  # first step of this process (a resumed run continues the sum)
            self.rollout_seconds = float(state.get("rollout_seconds", 0.0))
        state["rollout_seconds"] = round(self.rollout_seconds, 3)
        return {}

    def batch(self, step: int, micro: int, rank: int) -> dict:
        cfg = self.cfg
        gen = batch_generator(cfg.seed, step, micro)
        rows = shard_rows(cfg.batch_size, rank)
        idx = torch.randint(0, len(self.codes), (global_rows(cfg.batch_size),), generator=gen)
        on_policy = bool(torch.rand((), generator=gen) < cfg.on_policy)
        null_rows = torch.rand(len(idx), generator=gen) < cfg.label_dropout
        seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
        idx = idx[rows]
        # the rollout seed is per process: a sampled rollout of this process's rows draws its own numbers
        return {"labels": self.labels[idx], "codes": self.codes[idx].long(), "on_policy": on_policy,
                "null_rows": null_rows[rows], "seed": seed + rows.start}

    def rollout(self, model: torch.nn.Module, labels: torch.Tensor, prefix: torch.Tensor, seed: int):
        """The student completes `prefix` frozen and in eval mode; back in training mode after."""
        from selfspec.images.rollout import ImageRolloutEngine

        was_training = model.training
        model.eval()
        try:
            started = time.perf_counter()
            res = ImageRolloutEngine(model, self.layout, None).rollout(labels, prefix, self.rollout_config, seed=seed)
            self.rollout_seconds = (self.rollout_seconds or 0.0) + time.perf_counter() - started
        finally:
            model.train(was_training)
        return res

    def forward(self, model: torch.nn.Module, batch: dict, stage: dict) -> dict:
        lay = self.layout
        plen = round(self.cfg.prefix_ratio * lay.tokens)
        codes = batch["codes"].to(self.device)
        labels = batch["labels"].to(self.device)
        stats = {}
        if batch["on_policy"]:  # the unwrapped student: its rollout forwards are this process's alone
            from accelerate.utils import extract_model_from_parallel

            res = self.rollout(extract_model_from_parallel(model), labels, codes[:, :plen], batch["seed"])
            codes = res.codes.to(self.device)
            stats = {"rounds": float(res.rounds), "tokens_per_round": res.tokens_per_round}
        # Rollouts are conditioned on the class; the distillation input of a dropped row is the null
        # class for teacher and student alike, as in pre-training, so the unconditional branch that
        # guidance subtracts is distilled too.
        cls = torch.where(batch["null_rows"].to(self.device), lay.null_id, lay.class_ids(labels))
        x = torch.cat([cls[:, None], codes], 1)
        student = _restricted(model(input_ids=x[:, :-1]).logits, lay.codebook_size)
        with torch.no_grad():
            teacher = _restricted(self.teacher.model(input_ids=x[:, :-1]).logits, lay.codebook_size)
        # Logits row t predicts code t. The suffix (generated on-policy steps) has weight 1; the real
        # prefix `prefix_weight`: with the suffix alone the first half's predictions, which no
        # loss sees, drift (measured: FID 352 -> 499 in 150 on-policy steps), and images sampled from
        # scratch start there.
        mask = torch.full(codes.shape, self.cfg.prefix_weight, device=self.device)
        mask[:, plen:] = 1.0
        return {"student": student, "teacher": teacher, "codes": codes, "mask": mask, "stats": stats}

    def loss(self, out: dict, batch: dict, stage: dict) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        if cfg.objective == "gkd":
            loss = generalized_jsd(out["student"], out["teacher"], cfg.beta, out["mask"])
            extra = {}
        else:
            loss, share = varkd_lite(out["student"], out["teacher"], out["codes"], out["mask"], cfg.varkd_confidence,
                                     cfg.varkd_top_k)
            extra = {"selected": share}
        return loss, {"loss": loss.item(), **out["stats"], **extra,
                      "rollout_s_total": self.rollout_seconds or 0.0}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, seed: int = 12345) -> dict:
        from selfspec.images.model import ImageModel
        from selfspec.images.evaluate import image_metrics, sample_images
        from selfspec.images.gpt import sequence_loss

        was_training = model.training
        model.eval()
        started = time.perf_counter()
        try:
            im = ImageModel(model, self.layout, self.vq, Path("."))
            images, labels = sample_images(im, self.cfg.eval_images, self.cfg.cfg_scale, 1.0, 64, 8, seed=seed,
                                           progress=False)
            metrics = image_metrics(images, labels, self.real_images).as_dict()
            metrics["heldout_loss"] = round(sequence_loss(model, self.heldout_codes,
                                                          self.layout.class_ids(self.heldout_labels)), 4)
            metrics["heldout_loss_null_class"] = round(sequence_loss(
                model, self.heldout_codes, torch.full_like(self.heldout_labels, self.layout.null_id)), 4)
        finally:
            model.train(was_training)
            self.eval_durations.append(time.perf_counter() - started)
        return metrics

    def describe_eval(self, ev: dict) -> str:
        return (f"FID {ev['fid']:.2f} IS {ev['inception_score']:.2f} P {ev['precision']:.2f} R {ev['recall']:.2f} "
                f"class acc {ev['conditional_accuracy']:.2%} loss {ev['heldout_loss']:.3f} "
                f"(null class {ev['heldout_loss_null_class']:.3f})")

    def postfix(self, stage: dict, stats: dict[str, float]) -> dict:
        shown = {"loss": f"{stats['loss']:.4f}", "rollout_s": f"{stats.get('rollout_s_total', 0.0):.0f}"}
        if "tokens_per_round" in stats:
            shown["tok/rd"] = f"{stats['tokens_per_round']:.2f}"
        return shown

    def metadata(self, state: dict):
        from selfspec.images.gpt import image_metadata

        return image_metadata(self.layout, self.name, state)

    def provenance(self, model: torch.nn.Module, state: dict, out: Path, train_seconds: float | None) -> dict:
        cfg = self.cfg
        history = state["history"]
        return {"model": cfg.name or "opd-student", "command": C.command_line(), "config": asdict(cfg),
                "data": state.get("data"), "steps": state["step"], "before": state.get("base_eval"),
                "after": history[-1]["heldout"] if history else None, "history": history,
                "rollout_seconds": round(max(state.get("rollout_seconds", 0.0), self.rollout_seconds or 0.0), 2),
                "train_seconds": round(state["elapsed_s"], 1),
                "total_seconds": round(train_seconds, 1) if train_seconds else None,
                "compaction_costs": _costs_json(self.rollout_config.costs),
                "parameters": sum(p.numel() for p in model.parameters())}


def train_opd(cfg: OPDConfig) -> dict:
    """Runs the distillation; the result is the training loop's plus the `objective` (its timers)."""
    from selfspec.images.gpt import export_image_side_files

    objective = OPDObjective(cfg)
    result = train(objective)
    if "export" in result:
        export_image_side_files(Path(result["export"]))
    return {**result, "objective": objective}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, OPDConfig)


def run(args: argparse.Namespace) -> int:
    train_opd(C.from_args(OPDConfig, args))
    return 0
