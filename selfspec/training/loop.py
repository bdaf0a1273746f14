"""The training loop, one for every objective (`selfspec.training.objective`).

`train(objective)` reads top to bottom: settings, model, optimizer, resume, held-out baseline,
then per step the learning rate, the micro-batches under gradient accumulation (forward under
autocast, loss, backward, clip, optimizer step), logging, evaluation, re-planning, checkpoints;
at the end a checkpoint and the export (`selfspec.training.export`). The objective decides
what is trained, on which batches, with which loss; the loop decides how.

- Learning rate: linear warmup over `warmup_ratio` of the planned steps, then cosine decay to
  `min_lr_ratio * lr` at the last planned step.
- Time budget: with `time_budget_minutes`, the planned steps are re-planned from the measured
  step time (at step 10 and after every evaluation, keeping back time for the final evaluation
  and export) so that the schedule (and the objective's stages, which follow the plan) finish
  inside the budget even on a busy machine. The plan is part of the checkpoint.
- Accelerate drives devices and processes (CPU, one GPU, or `accelerate launch` with DDP / FSDP
  / DeepSpeed; on a machine without CUDA, several processes train on the CPU over gloo); bf16
  autocast on CUDA by default. With P processes each holds `batch_size` rows of one global
  micro-batch (`selfspec.training.distributed`): the run trains what one process with P times
  the batch size trains. Rank 0 evaluates (on the unwrapped model: a DDP forward on one rank
  alone would wait for the others) and exports; the logged statistics are the mean over ranks;
  a time-budget re-plan is rank 0's, broadcast, so every rank runs the same number of steps.
- The state keeps every step's statistics (`curve`: the loss curve, mean over processes) beside
  the evaluations (`history`).
- Checkpoints every `save_every` steps and at the end (`selfspec.training.checkpoint`);
  `resume` continues bit-identically on CPU (batches are a function of the step, the RNG state
  is in the checkpoint); `stop_after_steps` leaves early, checkpointed.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from selfspec.errors import UsageError
from selfspec.training.checkpoint import read_state, resume_checkpoint, save_checkpoint
from selfspec.training.config import LoopConfig
from selfspec.training.distributed import local_only
from selfspec.training.export import export_trained
from selfspec.training.objective import DEFAULT_OBJECTIVE, Objective


# ------------------------------------------------------------------------------ schedule
def lr_at(cfg: LoopConfig, step: int, planned: int) -> float:
    warmup = max(1, round(cfg.warmup_ratio * planned))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, planned - warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def replan(cfg: LoopConfig, state: dict, loop_seconds: float, loop_steps: int, reserve_s: float) -> None:
    """Shrink or grow the planned steps so that the run ends inside its time budget."""
    if not cfg.time_budget_minutes or loop_steps <= 0:
        return
    per_step = loop_seconds / loop_steps
    left = cfg.time_budget_minutes * 60 - state["elapsed_s"] - reserve_s
    planned = state["step"] + max(1, int(left / per_step))
    state["planned_steps"] = int(max(state["step"] + 1, min(cfg.steps, planned)))


def reserve_seconds(cfg: LoopConfig) -> float:
    """Seconds kept back from the time budget for the final evaluation and export."""
    return 30.0 + cfg.eval_tokens / 1000.0


def mixed_precision(cfg: LoopConfig) -> str:
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    env = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if env:
        return env
    return "bf16" if torch.cuda.is_available() else "no"


def mean_over_ranks(accelerator, stats: dict[str, float]) -> dict[str, float]:
    """Each statistic averaged over the processes (the values themselves with one)."""
    if accelerator.num_processes == 1 or not stats:
        return stats
    keys = sorted(stats)
    values = accelerator.reduce(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64,
                                             device=accelerator.device), reduction="mean")
    return {k: float(v) for k, v in zip(keys, values.tolist())}


def held_out(objective: Objective, accelerator, model) -> dict | None:
    """The held-out evaluation, on rank 0 (None elsewhere). Under FSDP every process runs it (a
    forward of a sharded model gathers its parameters from all of them); elsewhere rank 0 alone,
    on the unwrapped model (a DDP forward on one rank would wait for the others)."""
    from accelerate.utils import DistributedType

    with local_only():  # the objective's losses take no collective here (each process evaluates alone)
        if accelerator.distributed_type == DistributedType.FSDP:
            ev = objective.evaluate(model)
            return ev if accelerator.is_main_process else None
        return objective.evaluate(accelerator.unwrap_model(model)) if accelerator.is_main_process else None


def rank0_value(accelerator, value: int) -> int:
    """Rank 0's value on every process (time-based decisions must not differ between ranks)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast

    return int(broadcast(torch.tensor([value], device=accelerator.device), from_process=0).item())


# ------------------------------------------------------------------------------ the loop
def train(objective: Objective) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    cfg = objective.cfg
    started = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # several processes without CUDA (started by `accelerate launch`, i.e. torchrun): cpu=True makes
    # them form a gloo group instead of looking for a GPU backend and falling back to one process
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mixed_precision(cfg),
                              cpu=several and not torch.cuda.is_available())
    set_seed(cfg.seed)
    model = objective.build_model(accelerator.device)
    objective.setup_training(model, accelerator.print)

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for _, p in params)
    n_total = sum(p.numel() for p in model.parameters())
    accelerator.print(f"model: {n_total / 1e6:.2f}M parameters, {n_trainable / 1e6:.3f}M trainable")
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    model, optimizer = accelerator.prepare(model, optimizer)

    state = {"step": 0, "planned_steps": cfg.steps, "elapsed_s": 0.0, "history": [], "base_eval": None}
    resume_from = resume_checkpoint(cfg)
    if resume_from is not None:
        saved = read_state(resume_from)
        saved.pop("config", None)
        trained_by = saved.pop("objective", DEFAULT_OBJECTIVE)
        if trained_by != objective.name:
            raise UsageError(f"--resume {resume_from}: a checkpoint of a {trained_by} run, not of {objective.name}")
        accelerator.load_state(str(resume_from / "accelerate"))
        state.update(saved)
        accelerator.print(f"resumed from {resume_from} at step {state['step']} of {state['planned_steps']}")
    state["data"] = objective.data_description
    if state["base_eval"] is None:
        state["base_eval"] = held_out(objective, accelerator, model)
        if accelerator.is_main_process:
            accelerator.print(f"before training: held-out {objective.describe_eval(state['base_eval'])}")

    rank = accelerator.process_index
    model.train()
    loop_started = time.time()
    loop_steps = 0
    bar = tqdm(total=state["planned_steps"], initial=state["step"], desc=cfg.name or objective.name, unit="step",
               disable=not (cfg.progress_bar and accelerator.is_local_main_process), dynamic_ncols=True)
    segment_start = time.time()
    while state["step"] < state["planned_steps"]:
        step = state["step"]
        stage = objective.stage(step, state["planned_steps"], state)
        lr = lr_at(cfg, step, state["planned_steps"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        stats: dict[str, float] = {}
        for micro in range(cfg.grad_accum):
            batch = objective.batch(step, micro, rank)
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    outputs = objective.forward(model, batch, stage)
                loss, micro_stats = objective.loss(outputs, batch, stage)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.grad_clip:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for key, value in micro_stats.items():
                stats[key] = stats.get(key, 0.0) + value / cfg.grad_accum
        stats = mean_over_ranks(accelerator, stats)
        state.setdefault("curve", []).append({"step": step + 1, **stats})
        state["step"] = step + 1
        loop_steps += 1
        now = time.time()
        state["elapsed_s"] += now - segment_start
        segment_start = now
        shown = {**objective.postfix(stage, stats), "lr": f"{lr:.1e}"}
        bar.update(1)
        bar.set_postfix(**shown)

        if loop_steps == 10:
            replan(cfg, state, time.time() - loop_started, loop_steps, reserve_s=reserve_seconds(cfg))
            state["planned_steps"] = rank0_value(accelerator, state["planned_steps"])
            bar.total = state["planned_steps"]
        done = state["step"] >= state["planned_steps"]
        if (cfg.eval_every and state["step"] % cfg.eval_every == 0) or done:
            ev = held_out(objective, accelerator, model)
            state["history"].append({"step": state["step"], **stage, "lr": lr, **stats,
                                     "elapsed_s": round(state["elapsed_s"], 1), "heldout": ev})
            if ev:
                tqdm.write(f"step {state['step']}/{state['planned_steps']} "
                           + " ".join(f"{k}={v}" for k, v in shown.items())
                           + f" | held-out {objective.describe_eval(ev)}")
            now = time.time()
            state["elapsed_s"] += now - segment_start
            segment_start = now
            if not done:
                replan(cfg, state, time.time() - loop_started, loop_steps, reserve_s=reserve_seconds(cfg))
                state["planned_steps"] = rank0_value(accelerator, state["planned_steps"])
                bar.total = state["planned_steps"]
        if cfg.save_every and state["step"] % cfg.save_every == 0 and state["step"] < state["planned_steps"]:
            save_checkpoint(accelerator, cfg, state, objective.name)
        if cfg.stop_after_steps and loop_steps >= cfg.stop_after_steps and state["step"] < state["planned_steps"]:
            bar.close()
            ckpt = save_checkpoint(accelerator, cfg, state, objective.name)
            accelerator.print(f"stopping after {loop_steps} steps as asked; resume from {ckpt}")
            return {"checkpoint": str(ckpt), "state": state, "model": accelerator.unwrap_model(model),
                    "tokenizer": objective.tokenizer, "interrupted": True}
    bar.close()
    state["elapsed_s"] += time.time() - segment_start
    ckpt = save_checkpoint(accelerator, cfg, state, objective.name)
    result = {"checkpoint": str(ckpt), "state": state, "model": accelerator.unwrap_model(model),
              "tokenizer": objective.tokenizer}
    if cfg.export and accelerator.is_main_process:
        result["export"] = str(export_trained(accelerator.unwrap_model(model), objective, state, Path(cfg.out),
                                              train_seconds=time.time() - started))
    accelerator.wait_for_everyone()
    return result
