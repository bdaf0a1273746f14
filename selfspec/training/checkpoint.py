"""Training checkpoints: `CHECKPOINT_DIR/step-NNNNNNN/` holds Accelerate's state (model,
optimizer, RNG) in `accelerate/` and the loop's state in `train_state.json` (step, planned steps,
elapsed time, history, the objective's own keys, its name and its config)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from selfspec.errors import UsageError

STATE_FILE = "train_state.json"


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(cfg.out) / "checkpoints"


def latest_checkpoint(root: Path) -> Path | None:
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).exists())
    return done[-1] if done else None


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run / checkpoint directory's latest checkpoint."""
    path = Path(path)
    if (path / STATE_FILE).exists():
        return path
    latest = latest_checkpoint(path) or latest_checkpoint(path / "checkpoints")
    if latest is None:
        raise UsageError(f"no training checkpoint in {path}")
    return latest


def read_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def save_checkpoint(accelerator, cfg, state: dict, objective_name: str) -> Path:
    root = checkpoint_root(cfg)
    path = root / f"step-{state['step']:07d}"
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path / "accelerate"))
    if accelerator.is_main_process:
        saved = {**state, "objective": objective_name, "config": asdict(cfg)}
        (path / STATE_FILE).write_text(json.dumps(saved, indent=2) + "\n")
        old = sorted(p for p in root.glob("step-*") if p != path)
        for p in old[: max(0, len(old) - (cfg.keep_checkpoints - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    accelerator.wait_for_everyone()
    return path


def resume_checkpoint(cfg) -> Path | None:
    """The checkpoint `cfg.resume` names ("auto": the latest in the checkpoint dir, None when
    there is none yet), or None without --resume."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(checkpoint_root(cfg))
    path = Path(cfg.resume)
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"--resume {cfg.resume}: not a training checkpoint (no {STATE_FILE}); pass a "
                         f"step-* directory under {checkpoint_root(cfg)} or --resume alone for the latest")
    return path
