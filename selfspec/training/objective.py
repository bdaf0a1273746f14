"""What the training loop (`selfspec.training.loop.train`) asks of a training method.

An objective owns everything that is particular to its method: the model(s) it trains and
any frozen teachers, its data and batches, its forward and loss, its held-out evaluation, its
per-step stage (e.g. I-DLM's stride curriculum) and what its export records. The loop owns
the rest (optimizer, schedule, time budget, accumulation, Accelerate, checkpoints, logging,
export). Objectives are named in `OBJECTIVES` (recorded in every checkpoint, so that
`selfspec export` can rebuild the model of any run).
"""

from __future__ import annotations

import abc
import importlib
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from selfspec.checkpoints.metadata import SelfspecMetadata
from selfspec.training.config import LoopConfig


class Objective(abc.ABC):
    name: ClassVar[str]  # its key in OBJECTIVES
    config_class: ClassVar[type[LoopConfig]]

    def __init__(self, cfg: LoopConfig) -> None:
        self.cfg = cfg
        self.tokenizer: Any = None  # saved with the export (set by build_model)
        self.data_description: dict | None = None  # recorded in checkpoints and provenance (set by setup_training)

    @abc.abstractmethod
    def build_model(self, device: torch.device) -> torch.nn.Module:
        """The model to train (with whatever the objective adds to it: tokens, adapters)."""

    @abc.abstractmethod
    def setup_training(self, model: torch.nn.Module, log: Callable[[str], None]) -> None:
        """What training needs beyond the model: data, frozen teachers. Not called by export."""

    def stage(self, step: int, planned_steps: int, state: dict) -> dict:
        """The settings of this step (logged in the history); may keep resumable keys in `state`.
        Default: one stage, nothing to log."""
        return {}

    @abc.abstractmethod
    def batch(self, step: int, micro: int, rank: int) -> Any:
        """The micro-batch of (step, micro-batch, process rank): a pure function of them, so
        that a resumed run sees the batches of an uninterrupted one."""

    @abc.abstractmethod
    def forward(self, model: torch.nn.Module, batch: Any, stage: dict) -> Any:
        """The forward pass(es) of a micro-batch (run under the loop's autocast)."""

    @abc.abstractmethod
    def loss(self, outputs: Any, batch: Any, stage: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss to back-propagate and scalar statistics (averaged over micro-batches)."""

    @abc.abstractmethod
    def evaluate(self, model: torch.nn.Module) -> dict:
        """Held-out metrics (on the main process; before training and every eval_every steps)."""

    @abc.abstractmethod
    def describe_eval(self, metrics: dict) -> str:
        """One line of `evaluate`'s metrics for the log."""

    @abc.abstractmethod
    def postfix(self, stage: dict, stats: dict[str, float]) -> dict[str, Any]:
        """What the progress bar and the log show of a step."""

    def metadata(self, state: dict) -> SelfspecMetadata | None:
        """The export's selfspec.json; default None: a plain model without one."""
        return None

    @abc.abstractmethod
    def provenance(self, model: torch.nn.Module, state: dict, out: Path, train_seconds: float | None) -> dict:
        """The export's provenance.json: how it was made and what it measured."""


OBJECTIVES: dict[str, str] = {
    "idlm": "selfspec.training.idlm.objective:IDLMObjective",
    "tiny-base": "selfspec.training.tiny_base:TinyBaseObjective",
    "jacobi-forcing": "selfspec.training.jacobi_forcing.objective:JFObjective",
    "image-gpt": "selfspec.images.gpt:ImageGPTObjective",
    "opd": "selfspec.images.opd:OPDObjective",
}
DEFAULT_OBJECTIVE = "idlm"  # of checkpoints written before they recorded their objective


def objective_class(name: str | None) -> type:
    """The objective class registered under `name` (imported on first use)."""
    key = name or DEFAULT_OBJECTIVE
    if key not in OBJECTIVES:
        raise ValueError(f"unknown training objective {key!r}; known: {', '.join(OBJECTIVES)}")
    module, _, attr = OBJECTIVES[key].partition(":")
    return getattr(importlib.import_module(module), attr)
