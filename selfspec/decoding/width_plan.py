"""A step's width chosen from the batch it runs in: the plan `selfspec tune` writes, and the
mode that follows it.

Self-speculation pays while a forward of several query tokens per request costs little more
than a forward of one. That depends on the batch: the wider the batch, the sooner the device
turns from flat to linear in query tokens. A `WidthPlan` lists, for batches of greedy rows and
for batches with sampled rows, buckets of batch sizes and the mode configuration each runs
(`mode: ar` is a plain one-token step). `PlannedMode` runs one mode object per bucket and picks
the bucket from each step's batch.

Lossless at every width: each bucket's mode is lossless on its own, and a sequence that moves to
another bucket's mode is started afresh by that mode (`Mode.start` from its committed history,
as after prefill), so what it carries over is only committed tokens. The first step after a
switch is the new mode's opening step (ISD: a propose-only step). The seed columns of a step are
a prefix of the widest bucket's, so every bucket reads its seeds where it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from selfspec.decoding.step import DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome


@dataclass(frozen=True)
class PlanBucket:
    max_batch: int | None  # serves batches of up to this many requests; None: any larger batch
    mode: str  # the plan's own mode or "ar"
    options: dict[str, Any] = field(default_factory=dict)  # mode options over the plan's base options

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_batch": self.max_batch, "mode": self.mode}
        out.update(self.options)
        return out


@dataclass(frozen=True)
class WidthPlan:
    greedy: tuple[PlanBucket, ...]  # for batches whose rows are all greedy
    sampled: tuple[PlanBucket, ...]  # for batches with at least one sampled row

    def bucket(self, batch_size: int, sampled: bool) -> int:
        """Index (in `greedy` or `sampled`) of the bucket serving this batch."""
        buckets = self.sampled if sampled else self.greedy
        for i, b in enumerate(buckets):
            if b.max_batch is None or batch_size <= b.max_batch:
                return i
        return len(buckets) - 1

    def to_dict(self) -> dict[str, Any]:
        return {"greedy": [b.to_dict() for b in self.greedy], "sampled": [b.to_dict() for b in self.sampled]}

    def describe(self) -> str:
        """One line: each list's buckets as `<=N: options`."""
        def one(b: PlanBucket) -> str:
            size = f"<={b.max_batch}" if b.max_batch is not None else "larger"
            opts = ",".join(f"{k}={v}" for k, v in b.options.items())
            return f"{size}: {b.mode}{' ' + opts if opts else ''}"
        return "; ".join(f"{name} [{' | '.join(one(b) for b in buckets)}]"
                         for name, buckets in (("greedy", self.greedy), ("sampled", self.sampled)))

    @staticmethod
    def from_dict(data: Any, mode: str) -> WidthPlan:
        """A plan from its YAML / JSON form: {greedy: [buckets], sampled: [buckets]} (one list
        alone serves both), each bucket {max_batch: N | null, mode: M, option: value, ...} in
        increasing max_batch, the last one open (null). ValueError naming the problem otherwise."""
        if isinstance(data, list):
            data = {"greedy": data, "sampled": data}
        if not isinstance(data, dict) or "greedy" not in data:
            raise ValueError("a width plan is {greedy: [buckets], sampled: [buckets]} or one list of buckets")
        unknown = sorted(set(data) - {"greedy", "sampled"})
        if unknown:
            raise ValueError(f"unknown width plan key(s) {unknown}: use greedy and sampled")
        lists = {k: _buckets(data[k], mode, k) for k in ("greedy", "sampled") if data.get(k) is not None}
        return WidthPlan(lists["greedy"], lists.get("sampled", lists["greedy"]))


def _buckets(items: Any, mode: str, name: str) -> tuple[PlanBucket, ...]:
    if not isinstance(items, list) or not items:
        raise ValueError(f"width plan {name}: a non-empty list of buckets, got {items!r}")
    out, last = [], 0
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"width plan {name}[{i}]: a mapping {{max_batch: N, mode: M, ...}}, got {item!r}")
        opts = dict(item)
        cap = opts.pop("max_batch", None)
        bucket_mode = str(opts.pop("mode", mode)).lower()
        if bucket_mode not in (mode, "ar"):
            raise ValueError(f"width plan {name}[{i}]: mode {bucket_mode!r}; a {mode} plan runs {mode} or ar")
        if bucket_mode == "ar" and opts:
            raise ValueError(f"width plan {name}[{i}]: mode ar takes no options, got {sorted(opts)}")
        if cap is not None:
            if not isinstance(cap, int) or cap <= last:
                raise ValueError(f"width plan {name}[{i}]: max_batch must be an integer above {last}, got {cap!r}")
            last = cap
        elif i != len(items) - 1:
            raise ValueError(f"width plan {name}[{i}]: only the last bucket may be open (max_batch: null)")
        out.append(PlanBucket(cap, bucket_mode, opts))
    return tuple(out)


class PlannedMode(Mode):
    """Runs the mode of the bucket each step's batch falls in (see module doc)."""

    def __init__(self, plan: WidthPlan, greedy_modes: list[Mode], sampled_modes: list[Mode], name: str):
        if len(greedy_modes) != len(plan.greedy) or len(sampled_modes) != len(plan.sampled):
            raise ValueError("one mode object per plan bucket")
        self.plan = plan
        self.greedy_modes, self.sampled_modes = list(greedy_modes), list(sampled_modes)
        every = self.greedy_modes + self.sampled_modes
        self.name = name
        self.seeds_per_step = max(m.seeds_per_step for m in every)
        self.max_width = max(m.max_width for m in every)
        self.greedy_only = any(m.greedy_only for m in every)
        self.current: Mode = self.greedy_modes[0]

    @property
    def step_width(self) -> int:
        """The widest layout of the mode the last `layouts` call chose."""
        return self.current.max_width

    def choose(self, seqs: list[DecodeSequence]) -> Mode:
        sampled = any(not s.sampling.greedy for s in seqs)
        modes = self.sampled_modes if sampled else self.greedy_modes
        return modes[self.plan.bucket(len(seqs), sampled)]

    def start(self, seq: DecodeSequence) -> None:
        seq.state, seq.state_owner = None, None  # the first step's bucket starts it

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        mode = self.choose(seqs)
        for s in seqs:
            if s.state_owner is not mode:
                mode.start(s)
                s.state_owner = mode
        self.current = mode
        return mode.layouts(seqs)

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        return self.current.finish(seqs, batch, logits, ctx)
