"""`PlannedMode`: runs the mode of the bucket of a width plan (`width_plan.py`) each step's batch
falls in, restarting a sequence that changes bucket from its committed tokens, under the plan's
run-time check (`online_check.py`) and, while AR steps serve, the candidate watch
(`candidate_watch.py`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from selfspec.decoding.widths.candidate_watch import CandidateWatch
from selfspec.decoding.widths.online_check import OnlineCheck, size_class
from selfspec.decoding.step import DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome
from selfspec.decoding.widths.width_plan import WidthPlan


@dataclass
class SequencePlan:
    """What a planned mode keeps per sequence (beside the running bucket mode's `seq.state`)."""

    owner: Mode | None = None  # the bucket mode whose `start` made `seq.state` (None: none yet)
    watch: CandidateWatch | None = None  # the candidate watch while AR steps serve the sequence


class PlannedMode(Mode):
    """Runs the mode of the bucket each step's batch falls in (see module doc)."""

    def __init__(self, plan: WidthPlan, greedy_modes: list[Mode], sampled_modes: list[Mode], name: str,
                 ar_mode: Mode | None = None, lookup_modes: dict[int, Mode] | None = None):
        """`ar_mode`: the plain AR mode the online check runs where it measures AR faster (the
        check is off without it, or when the plan has `online: false`). `lookup_modes`: by
        `id` of a bucket's mode object, the lookup step of that bucket's own context candidate,
        the check's third arm there."""
        if len(greedy_modes) != len(plan.greedy) or len(sampled_modes) != len(plan.sampled):
            raise ValueError("one mode object per plan bucket")
        self.plan = plan
        self.ar_mode = ar_mode
        self.lookup_modes = dict(lookup_modes or {})
        self.check = OnlineCheck(plan.online) if plan.online is not None and ar_mode is not None else None
        self._last: tuple[Any, str] | None = None  # the key and arm of the last planned step
        self.greedy_modes, self.sampled_modes = list(greedy_modes), list(sampled_modes)
        every = self.greedy_modes + self.sampled_modes + list(self.lookup_modes.values())
        self.name = name
        self.seeds_per_step = max(m.seeds_per_step for m in every)
        self.max_width = max(m.max_width for m in every)
        self.greedy_only = any(m.greedy_only for m in self.greedy_modes + self.sampled_modes)
        self.current: Mode = self.greedy_modes[0]
        # by sequence (identity), dropped with it: a finished sequence's plan goes when it does
        self._plans: weakref.WeakKeyDictionary[DecodeSequence, SequencePlan] = weakref.WeakKeyDictionary()

    def plan_of(self, seq: DecodeSequence) -> SequencePlan:
        """`seq`'s per-sequence plan state, made on first use."""
        plan = self._plans.get(seq)
        if plan is None:
            plan = self._plans[seq] = SequencePlan()
        return plan

    @property
    def step_width(self) -> int:
        """The widest layout of the mode the last `layouts` call chose."""
        return self.current.max_width

    @property
    def step_seed_columns(self) -> int:
        return self.current.seeds_per_step

    def choose(self, seqs: list[DecodeSequence]) -> Mode:
        sampled = any(not s.sampling.greedy for s in seqs)
        modes = self.sampled_modes if sampled else self.greedy_modes
        mode = modes[self.plan.bucket(len(seqs), sampled)]
        self._last = None
        # sampled batches follow the plan alone: an arm chosen by timing would make a seeded
        # request's output depend on the machine's load (each arm draws its own random numbers)
        if self.check is None or mode.name == "ar" or sampled:
            return mode
        key = (sampled, size_class(len(seqs)))
        lookup = self.lookup_modes.get(id(mode))
        arms = ("plan", "lookup", "ar") if lookup is not None else ("plan", "ar")
        # until an engine reports step times the plan is followed as written (the offline
        # engine reports none, so its choices stay a function of the batch alone)
        arm = self.check.arm(key, arms) if self.check.observations else "plan"
        if arm == "ar" and self._candidate_came_true(mode, seqs):
            arm = self.check.probe_plan(key)
        elif arm != "ar":  # what speculative steps emit is measured, not watched
            for s in seqs:
                watch = self.plan_of(s).watch
                if watch is not None:
                    watch.forget(s.history)
        self._last = (key, arm)
        return self.ar_mode if arm == "ar" else lookup if arm == "lookup" else mode

    def _candidate_came_true(self, mode: Mode, seqs: list[DecodeSequence]) -> bool:
        """Whether, for some sequence AR steps serve, `watch_tokens` of the context candidate
        `mode` would have verified came true (module doc)."""
        need = self.check.config.watch_tokens
        if not need or not CandidateWatch.watches(mode):
            return False
        hit = False
        for s in seqs:
            plan = self.plan_of(s)
            if plan.watch is None or plan.watch.mode is not mode:
                plan.watch = CandidateWatch(mode, s)
            hit = plan.watch.came_true(s.history) >= need or hit  # every watch sees every token
        return hit

    def observe(self, outcomes: list[StepOutcome], seconds: float) -> None:
        """The wall-clock period of the last step (from its start to the next step's start,
        as the engine sees it) and what it emitted, for the online check."""
        if self.check is None or self._last is None or seconds <= 0 or not outcomes:
            return
        tokens = sum(len(o.emit) for o in outcomes) / len(outcomes)
        self.check.observe(*self._last, tokens, seconds)
        self._last = None

    def start(self, seq: DecodeSequence) -> None:
        seq.state = None  # the first step's bucket starts it
        self.plan_of(seq).owner = None

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        mode = self.choose(seqs)
        for s in seqs:
            plan = self.plan_of(s)
            if plan.owner is not mode:
                mode.start(s)
                plan.owner = mode
        self.current = mode
        return mode.layouts(seqs)

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        return self.current.finish(seqs, batch, logits, ctx)
