"""Jacobi Forcing rows from recorded trajectories: the noise schedule, the state picked per block,
and the packed tensors of a batch (`selfspec.training.jacobi_forcing.masks` defines the layout).

- A state's noise (`state_noise`) is the fraction of the block from its first wrong token on:
  (n - d) / n with d the first offset where the state differs from the fixed point (a suffix
  length, not a Hamming distance: everything after the first error is conditioned on it).
- The target noise of block i (`target_noise`) comes from w evenly spaced levels
  W = {0, 1/w, ..., (w-1)/w} (the paper's Eq. 7; the public code's linspace also includes 1.0):
  progressive t_i = W[(i + phase) mod w] (the seed's cyclic schedule), reverse
  t_i = W[w - 1 - ((i + phase) mod w)], random t_i = W[u] with u drawn from the batch's seeded
  generator. `phase` is the epoch number: a second pass over the same trajectory sees each
  block at another noise level.
- `pick_state`: the recorded state nearest to t_i (the first on ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.training.jacobi_forcing.masks import JFLayout

SCHEDULES = ("progressive", "random", "reverse")


def first_error(state: list[int], fixed: list[int]) -> int:
    """d: the first offset where `state` differs from `fixed` (len(fixed) if none)."""
    for i, (a, b) in enumerate(zip(state, fixed)):
        if a != b:
            return i
    return len(fixed)


def state_noise(state: list[int], fixed: list[int]) -> float:
    n = len(fixed)
    return (n - first_error(state, fixed)) / n


def noise_levels(window: int) -> list[float]:
    return [i / window for i in range(window)]


def target_noise(schedule: str, block: int, window: int, phase: int = 0,
                 generator: torch.Generator | None = None) -> float:
    levels = noise_levels(window)
    k = (block + phase) % window
    if schedule == "progressive":
        return levels[k]
    if schedule == "reverse":
        return levels[window - 1 - k]
    if schedule == "random":
        return levels[int(torch.randint(0, window, (1,), generator=generator))]
    raise ValueError(f"unknown noise schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def pick_state(states: list[list[int]], fixed: list[int], target: float) -> list[int]:
    best, best_gap = states[0], float("inf")
    for s in states:
        gap = abs(state_noise(s, fixed) - target)
        if gap < best_gap:
            best, best_gap = s, gap
    return best


@dataclass
class Trajectory:
    """One prompt's record: its greedy response cut into blocks and each block's Jacobi states
    (states[0] is the initial draft, states[-1] the fixed point = the response block)."""

    prompt_ids: list[int]
    response_ids: list[int]  # T * n greedy tokens (not cut at EOS)
    states: list[list[list[int]]]  # [T][k][n]
    eos_at: int | None = None  # offset of the first EOS in the response (nothing after it counts)

    @property
    def block_size(self) -> int:
        return len(self.states[0][0])

    @property
    def num_blocks(self) -> int:
        return len(self.states)

    def fixed(self, j: int) -> list[int]:
        n = self.block_size
        return self.response_ids[j * n : (j + 1) * n]

    @classmethod
    def from_record(cls, rec: dict) -> Trajectory:
        return cls(rec["prompt_ids"], rec["response_ids"], [b["states"] for b in rec["blocks"]], rec.get("eos_at"))

    def to_record(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "eos_at": self.eos_at,
                "block_size": self.block_size, "blocks": [{"states": s} for s in self.states]}


@dataclass
class JFBatch:
    input_ids: torch.Tensor  # [B, L]
    position_ids: torch.Tensor  # [B, L]
    prompt_lens: torch.Tensor  # [B]
    noisy: torch.Tensor  # [B, T, n] the noisy states
    clean: torch.Tensor  # [B, T, n] the fixed points
    predicts: torch.Tensor  # [B, T, n] bool: the output at this offset counts (its input is before the response's EOS)
    layout: JFLayout
    plain_ids: torch.Tensor  # [B, P + Tn] prompt + response (left-padded): the plain causal row


def pack(prompts: list[list[int]], noisy: torch.Tensor, clean: torch.Tensor, pad_id: int, context: str = "nc",
         window: int = 1, eos_at: list[int | None] | None = None) -> JFBatch:
    """Rows `[pad][prompt][k_0][c_0]...[k_{T-1}][c_{T-1}]` from prompts and [B, T, n] states."""
    from selfspec.training.jacobi_forcing.masks import position_ids

    bsz, num_blocks, n = clean.shape
    plen = max(len(p) for p in prompts)
    layout = JFLayout(plen, n, num_blocks, context, window)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    head = torch.full((bsz, plen), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        head[b, plen - len(p):] = torch.tensor(p, dtype=torch.long)
    blocks = torch.stack([noisy, clean], dim=2).reshape(bsz, 2 * num_blocks * n)
    input_ids = torch.cat([head, blocks], dim=1)
    offset = torch.arange(num_blocks * n).view(num_blocks, n)
    limits = torch.tensor([num_blocks * n if e is None else e for e in (eos_at or [None] * bsz)])
    predicts = offset.unsqueeze(0) < limits.view(bsz, 1, 1)
    plain = torch.cat([head, clean.reshape(bsz, -1)], dim=1)
    return JFBatch(input_ids, position_ids(layout, prompt_lens), prompt_lens, noisy, clean, predicts, layout, plain)


def pack_trajectories(trajs: list[Trajectory], pad_id: int, schedule: str, window: int, context: str, phase: int,
                      generator: torch.Generator | None = None) -> JFBatch:
    """One row per trajectory, block i's noisy state picked at the schedule's target noise."""
    noisy, clean = [], []
    for tr in trajs:
        rows = []
        for j in range(tr.num_blocks):
            t = target_noise(schedule, j, window, phase, generator)
            rows.append(pick_state(tr.states[j], tr.fixed(j), t))
        noisy.append(rows)
        n = tr.block_size
        clean.append([tr.fixed(j) for j in range(tr.num_blocks)])
        if any(len(r) != n for r in rows):
            raise ValueError("a trajectory's states differ in length from its block size")
    return pack([tr.prompt_ids for tr in trajs], torch.tensor(noisy), torch.tensor(clean), pad_id, context, window,
                [tr.eos_at for tr in trajs])
