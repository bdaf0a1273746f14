"""Data parallelism that trains what one process would: one global micro-batch, split by rank, and
losses normalised over every process's positions.

Under `accelerate launch` with P processes (DDP, FSDP, DeepSpeed) each process holds
`batch_size` rows of a global micro-batch of P * `batch_size` rows. The objectives draw the
global micro-batch from a generator that does not depend on the rank and keep their own rows
(`shard_rows` / `take_rows`), so a run with P processes sees exactly the rows of a one-process
run with P times the batch size. DDP averages the processes' gradients; a loss that is a mean
over counted positions (tokens with a label, weighted positions) would then be a mean of
per-process means, which is not the mean over the whole batch when the counts differ. So such a
loss is written as `global_mean(sum, count)`: its gradient is sum * P / (count of all
processes), whose average over processes is the gradient of the whole batch's mean, and its
value for logging is the whole batch's mean. With one process both are `sum / count`, as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import torch


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, number of processes): from torch.distributed once it is set up,
    else from the launcher's environment (RANK / WORLD_SIZE), else (0, 1)."""
    if _dist_ready():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_LOCAL = False


@contextlib.contextmanager
def local_only():
    """Losses computed inside are this process's own means, with no collective: for what one
    process runs alone (rank 0's held-out evaluation), where a collective would wait forever."""
    global _LOCAL
    old, _LOCAL = _LOCAL, True
    try:
        yield
    finally:
        _LOCAL = old


def data_parallel() -> bool:
    """True in a process of a multi-process run (the collectives are live), outside `local_only`."""
    return not _LOCAL and _dist_ready() and torch.distributed.get_world_size() > 1


def shard_rows(rows_per_process: int, rank: int) -> slice:
    """Process `rank`'s rows of a global micro-batch of world * rows_per_process rows."""
    return slice(rank * rows_per_process, (rank + 1) * rows_per_process)


def global_rows(rows_per_process: int) -> int:
    return rows_per_process * rank_and_world()[1]


def take_rows(batch: Any, rows: slice) -> Any:
    """The rows `rows` of a batch: tensors (dim 0), and tuples / lists / dicts / dataclasses of
    them; anything else (a layout, a flag, a seed) is shared by every row and kept whole."""
    if isinstance(batch, torch.Tensor):
        return batch[rows] if batch.dim() > 0 else batch
    if isinstance(batch, tuple):
        return type(batch)(*(take_rows(x, rows) for x in batch)) if hasattr(batch, "_fields") else \
            tuple(take_rows(x, rows) for x in batch)
    if isinstance(batch, list):
        return [take_rows(x, rows) for x in batch]
    if isinstance(batch, dict):
        return {k: take_rows(v, rows) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: take_rows(getattr(batch, f.name), rows)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def all_reduce_sum(value: torch.Tensor | float | int) -> torch.Tensor:
    """The sum over processes (detached); the value itself with one process."""
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if data_parallel():
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        t = t.to(device)
        torch.distributed.all_reduce(t)
        t = t.cpu()
    return t


def global_mean(total: torch.Tensor, count: torch.Tensor | float | int) -> torch.Tensor:
    """A mean over the counted positions of every process's rows (see the module docstring).

    The returned tensor back-propagates the right gradient under DDP's averaging; its value on
    each process is its own contribution (`global_value` gives the whole batch's mean)."""
    if not data_parallel():
        return total / count
    _, world = rank_and_world()
    all_count = float(all_reduce_sum(count))
    return total * world / max(all_count, 1e-8)  # 0 / 0 (nothing counted anywhere) is 0


def global_mean_and_value(total: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`global_mean` and the whole batch's mean (detached) from one all-reduce of (sum, count)."""
    if not data_parallel():
        loss = total / count
        return loss, loss.detach()
    _, world = rank_and_world()
    both = all_reduce_sum(torch.stack([total.detach().double().cpu(), torch.tensor(float(count), dtype=torch.float64)]))
    all_count = max(float(both[1]), 1e-8)
    return total * world / all_count, (both[0] / all_count).float()


def mean_over_positions(per: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The (weighted) mean of per-position values: over this process's positions alone with one
    process, over every process's positions (`global_mean`) with several."""
    if weight is None:
        return global_mean(per.sum(), per.numel()) if data_parallel() else per.mean()
    weight = weight.float()
    if data_parallel():
        return global_mean((per * weight).sum(), weight.sum())
    return (per * weight).sum() / weight.sum().clamp(min=1e-8)


def global_value(total: torch.Tensor, count: torch.Tensor | float | int) -> float:
    """The whole batch's mean of a `global_mean` (a float, for logging and for ratios)."""
    if not data_parallel():
        return float(total.detach() / count)
    return float(all_reduce_sum(total) / all_reduce_sum(count).clamp(min=1e-8))
