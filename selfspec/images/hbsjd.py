"""HB-SJD rounds over a batch of images, as tensor ops (after *Accelerating Visual On-Policy
Distillation with Batched Speculative Jacobi Rollouts*, the HB-SJD paper).

The rules are SJD's (`sjd.py`: `history_drafts`, `next_window`; tests check these tensor forms
against those list forms) and `verify.py`'s; what this module adds is their batched,
tensor-only form and the progress schedules:

State of image b: `seq[b, :length[b]]` are its known tokens (class, prefix, generated codes);
the last, `seq[length - 1]`, is the pending token, whose KV is not cached yet. Its window holds
W drafts for the positions length .. length + W - 1. One round forwards `[pending, drafts]`;
row i - 1 judges draft i; `keep[b]` tokens are then committed: the pending token and the first
keep - 1 drafts get their KV (a prefix of the step, `SlotKVCache.commit_prefix`), and the keep
tokens of the verified chain (accepted drafts, then the correction / bonus) are appended to seq,
its last one the new pending token (its KV is computed by the next round: no repair pass).

Schedules (how many tokens an image keeps):
- `independent` (HB-SJD): every image keeps its own accepted prefix + 1.
- `lockstep` (the batched behaviour of the public SJD code, which takes the minimum accepted
  length): every active image keeps min over the active images, + 1.
- `window` (the HB-SJD paper's Fig. 2a): fixed windows of W positions; an image that has completed the
  current window idles (keeps nothing) until every image has, then the window moves on.

`window = 0` is cached AR in the same machinery: one query token, no drafts, keep 1.
No per-image Python: loops run over the W window positions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEDULES = ("independent", "lockstep", "window")
VERIFY_RULES = ("greedy", "prob")


@dataclass
class HBSJDConfig:
    window: int = 16  # W drafts per image per round (0: cached AR)
    history_offset: int = 14  # H: history drafts copy the token H positions back (14 = one row up)
    verify: str = "greedy"  # greedy | prob (SJD p/q acceptance, residual resampling)
    schedule: str = "independent"

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (0 = cached AR), got {self.window}")
        if self.history_offset < 1:
            raise ValueError(f"history_offset must be >= 1, got {self.history_offset}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_RULES)}, got {self.verify!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")


def history_fill(seq: torch.Tensor, length: torch.Tensor, drafts: torch.Tensor, reused: torch.Tensor,
                 offset: int) -> torch.Tensor:
    """Drafts [B, W]: the first reused[b] kept, every later one the token `offset` positions
    before it (a known token, or an earlier draft when offset <= its index; the first token of
    the sequence before the start), as `sjd.history_drafts` extends a list."""
    width = drafts.shape[1]
    cols = torch.arange(width, device=drafts.device)
    # drafts before index `offset` copy known tokens only: one gather for all of them
    head = min(width, offset)
    src = (length.unsqueeze(1) + cols[:head] - offset).clamp(min=0)
    out = torch.where(cols[:head] < reused.unsqueeze(1), drafts[:, :head], seq.gather(1, src))
    if head == width:
        return out
    out = torch.cat([out, drafts[:, head:]], 1)
    for j in range(head, width):  # a later draft may copy an earlier one (offset <= its index)
        src = length + j - offset
        from_seq = seq.gather(1, src.clamp(min=0).unsqueeze(1)).squeeze(1)
        value = torch.where(src >= length, out[:, j - offset], from_seq)
        out[:, j] = torch.where(j < reused, out[:, j], value)
    return out


def reuse_predictions(predictions: torch.Tensor, keep: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next window's leading drafts: the predictions of rows keep .. W (row r predicts the
    position after step token r, so row keep predicts the position after the new pending
    token), as `sjd.next_window`. Returns (drafts [B, W] with the rest undefined, reused [B])."""
    rows = predictions.shape[1]  # W + 1
    idx = (keep.unsqueeze(1) + torch.arange(window, device=keep.device)).clamp(max=rows - 1)
    return predictions.gather(1, idx), (rows - keep).clamp(min=0, max=window)


def chain_tokens(drafts: torch.Tensor, accept_len: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """[B, W + 1]: the verified chain, accepted drafts then the correction / bonus at accept_len
    (entries after it are the unverified drafts, never kept)."""
    chain = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1)
    return chain.scatter(1, accept_len.unsqueeze(1), next_tokens.unsqueeze(1))


def draft_counts(length: torch.Tensor, total: int, window: int, schedule: str,
                 window_end: torch.Tensor | None) -> torch.Tensor:
    """How many of each image's W drafts are real this round: never past the image's end; under
    the `window` schedule never past the current window's end."""
    limit = (total - length).clamp(min=0)
    if schedule == "window" and window_end is not None:
        limit = torch.minimum(limit, (window_end - length).clamp(min=0))
    return limit.clamp(max=window)


def keep_counts(accept_len: torch.Tensor, length: torch.Tensor, total: int, active: torch.Tensor, schedule: str,
                window_end: torch.Tensor | None) -> torch.Tensor:
    """Tokens each image commits this round (0 for finished or idling images)."""
    keep = accept_len + 1
    if schedule == "lockstep":
        floor = torch.where(active, accept_len, torch.full_like(accept_len, torch.iinfo(accept_len.dtype).max))
        keep = torch.minimum(keep, floor.min() + 1)
    if schedule == "window" and window_end is not None:
        active = active & (length < window_end)
    # the last token needs no KV: an image stops at `total` known tokens
    keep = torch.minimum(keep, (total - length).clamp(min=0))
    return torch.where(active, keep, torch.zeros_like(keep))


def advance_window_end(window_end: torch.Tensor, length: torch.Tensor, active: torch.Tensor, window: int) -> torch.Tensor:
    """The `window` schedule moves every image to the next window once all active images have
    completed the current one."""
    all_done = bool((~active | (length >= window_end)).all())
    return window_end + window if all_done else window_end


def append_chain(seq: torch.Tensor, length: torch.Tensor, chain: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """seq with chain[b, :keep[b]] written at length[b] .. (seq has W + 1 spare columns)."""
    width = chain.shape[1]
    pos = length.unsqueeze(1) + torch.arange(width, device=seq.device)
    current = seq.gather(1, pos)
    write = torch.arange(width, device=seq.device).unsqueeze(0) < keep.unsqueeze(1)
    return seq.scatter(1, pos, torch.where(write, chain, current))


# ------------------------------------------------------------------------------ Hybrid execution
@dataclass(frozen=True)
class CompactionCosts:
    """Measured seconds per batch size b (images in the batch, ascending): one verification
    forward of b images' rows (`forward_s`) and one compaction down to b images (`compact_s`,
    the KV `select` of every layer and the state gathers). `images.gamma.calibrated_costs`
    measures them. Between measured sizes the costs are interpolated linearly, beyond them held
    flat; the forward costs are first made non-decreasing in b (pool-adjacent-violators), since
    more rows never cost less and a noisy dip would otherwise read as a saving."""

    sizes: tuple[int, ...]
    forward_s: tuple[float, ...]
    compact_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or not len(self.sizes) == len(self.forward_s) == len(self.compact_s):
            raise ValueError("costs need one forward and one compaction time per size")
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"sizes must be strictly increasing, got {self.sizes}")

    @classmethod
    def from_sweep(cls, sweep: dict) -> "CompactionCosts":
        """From {b: {"forward_s", "compact_s"}} (the calibration's JSON; keys may be strings)."""
        items = sorted((int(b), c) for b, c in sweep.items())
        return cls(tuple(b for b, _ in items), tuple(float(c["forward_s"]) for _, c in items),
                   tuple(float(c["compact_s"]) for _, c in items))

    def to_sweep(self) -> dict[int, dict[str, float]]:
        return {b: {"forward_s": f, "compact_s": c} for b, f, c in zip(self.sizes, self.forward_s, self.compact_s)}

    def forward(self, images: int) -> float:
        return _interpolate(self.sizes, _non_decreasing(self.forward_s), images)

    def compact(self, images: int) -> float:
        return _interpolate(self.sizes, self.compact_s, images)


def _non_decreasing(values: tuple[float, ...]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _interpolate(xs: tuple[int, ...], ys, x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[-1]


def rounds_left(length: torch.Tensor, total: int, active: torch.Tensor, tokens_per_round: float) -> float:
    """Rounds until the last active image is complete (this one included), estimated from the
    tokens the active images still need and the tokens an image has committed per round so far."""
    remaining = int(torch.where(active, total - length, torch.zeros_like(length)).max())
    return max(1.0, remaining / max(tokens_per_round, 1.0))


def should_compact(costs: CompactionCosts, batch: int, active: int, rounds: float) -> bool:
    """Hybrid execution's rule: with `active` of the `batch` images in the batch still running and
    `rounds` rounds to go, remove the finished ones when the forwards it saves over those rounds,
    rounds × (t_f(batch) − t_f(active)), exceed one compaction, t_c(active). A compaction is paid
    once and saves in every later round, so it pays late in a rollout only for many finished
    images, early even for one; where a forward's cost hardly depends on its rows (a GPU below
    saturation) it never pays, and the batch keeps its shape to the end."""
    if active >= batch:
        return False
    return rounds * (costs.forward(batch) - costs.forward(active)) > costs.compact(active)
