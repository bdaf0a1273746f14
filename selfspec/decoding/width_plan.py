"""A step's width chosen from the batch it runs in: the plan `selfspec tune` writes, and the
mode that follows it.

Self-speculation pays while a forward of several query tokens per request costs little more
than a forward of one. That depends on the batch: the wider the batch, the sooner the device
turns from flat to linear in query tokens. A `WidthPlan` lists, for batches of greedy rows and
for batches with sampled rows, buckets of batch sizes and the mode configuration each runs
(`mode: ar` is a plain one-token step, `mode: ngram` the lookup step: the context candidate alone). `PlannedMode` runs one mode object per bucket and picks
the bucket from each step's batch.

Lossless at every width: each bucket's mode is lossless on its own, and a sequence that moves to
another bucket's mode is started afresh by that mode (`Mode.start` from its committed history,
as after prefill), so what it carries over is only committed tokens. The first step after a
switch is the new mode's opening step (ISD: a propose-only step). The seed columns of a step are
a prefix of the widest bucket's, so every bucket reads its seeds where it would alone.

The plan is a prediction; `OnlineCheck` verifies it while serving. The serving engine reports
each step's wall-clock period (`PlannedMode.observe`; the offline engine does not, so its
choices stay a function of the batch alone); per batch-size class the check keeps the
measured rate (tokens per second per request, over the last ~100 steps of the class) of the
bucket's mode, of plain AR steps and, where the bucket runs the mode's own step with a context
candidate, of that candidate alone (a lookup step: whether the mode's own proposals pay for
their query tokens depends on the model), runs the fastest and now and then probes another for
a few steps, the more rarely the further the running one leads. A plan whose speculation does not
pay on the machine it runs on (the cost model mispredicted, the load is not the tuner's) then
falls back to AR steps by measurement, at the price of the probes.

AR steps cannot measure what the plan would gain on a repetitive stretch, and a rare probe seldom
lands on one: a served JACOBI plan at C=4 ran AR through the loops its context candidate would
have copied (TPF 2.5 against 3.6 with the check off). So while AR steps serve a batch, each
sequence's `CandidateWatch` keeps the context candidate the plan's mode would verify and checks it
against the tokens AR then emits; when `watch_tokens` of them came true, the plan is probed at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from selfspec.decoding.step import DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome


#: Steps any mode's plan may run besides its own: a plain AR step, and the lookup step (the
#: context candidate alone, `ngram.py`), which pays at batches too wide for the mode's own
#: proposals. Their options are their own, not the plan mode's.
PLAN_STEP_MODES = ("ar", "ngram")


@dataclass(frozen=True)
class PlanBucket:
    max_batch: int | None  # serves batches of up to this many requests; None: any larger batch
    mode: str  # the plan's own mode, or one of PLAN_STEP_MODES
    options: dict[str, Any] = field(default_factory=dict)  # mode options over the plan's base options

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_batch": self.max_batch, "mode": self.mode}
        out.update(self.options)
        return out


@dataclass(frozen=True)
class OnlineCheckConfig:
    probe_every: int = 48  # steps on the faster arm between two probes of the other, at parity
    # (stretched by how far the faster arm leads, up to 4x)
    probe_steps: int = 6  # steps per probe (the probed mode's opening step included)
    # weight of the past in an arm's rate, per step (of either arm): ~100 steps of memory. A
    # speculative mode's rate swings with the text (a 17-token candidate run, then a stretch of
    # 1-token steps) and AR steps cannot see a repetitive stretch coming back, so the plan must
    # lose over a long window before AR takes over: with 0.8 (~5 steps) a greedy batch-1 ISD
    # server ran AR on over half its steps, with 0.95 an SJD one on 39% of them, 13% slower
    # than with no check (`selfspec bench serve` with `online: false` in the plan against the
    # default).
    decay: float = 0.99
    margin: float = 0.03  # the other arm must be this much faster to take over
    # AR steps probe the plan at once when this many tokens of a sequence's context candidate came
    # true (0: off); a 3-token copy is rare in text that does not repeat itself
    watch_tokens: int = 3

    def __post_init__(self) -> None:
        if self.probe_every < 1 or self.probe_steps < 1:
            raise ValueError("online check: probe_every and probe_steps must be >= 1")
        if self.watch_tokens < 0:
            raise ValueError("online check: watch_tokens must be >= 0 (0 = off)")
        if not 0 <= self.decay < 1 or self.margin < 0:
            raise ValueError("online check: decay in [0, 1), margin >= 0")


@dataclass(frozen=True)
class WidthPlan:
    greedy: tuple[PlanBucket, ...]  # for batches whose rows are all greedy
    sampled: tuple[PlanBucket, ...]  # for batches with at least one sampled row
    online: OnlineCheckConfig | None = OnlineCheckConfig()  # None: follow the plan blindly

    def bucket(self, batch_size: int, sampled: bool) -> int:
        """Index (in `greedy` or `sampled`) of the bucket serving this batch."""
        buckets = self.sampled if sampled else self.greedy
        for i, b in enumerate(buckets):
            if b.max_batch is None or batch_size <= b.max_batch:
                return i
        return len(buckets) - 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"greedy": [b.to_dict() for b in self.greedy],
                               "sampled": [b.to_dict() for b in self.sampled]}
        if self.online != OnlineCheckConfig():
            out["online"] = False if self.online is None else dict(vars(self.online))
        return out

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
        """A plan from its YAML / JSON form: {greedy: [buckets], sampled: [buckets], online: ...}
        (one list alone serves both), each bucket {max_batch: N | null, mode: M, option: value,
        ...} in increasing max_batch, the last one open (null); `online`: true (the default),
        false, or a mapping of `OnlineCheckConfig` fields. ValueError naming the problem otherwise."""
        if isinstance(data, list):
            data = {"greedy": data, "sampled": data}
        if not isinstance(data, dict) or "greedy" not in data:
            raise ValueError("a width plan is {greedy: [buckets], sampled: [buckets]} or one list of buckets")
        unknown = sorted(set(data) - {"greedy", "sampled", "online"})
        if unknown:
            raise ValueError(f"unknown width plan key(s) {unknown}: use greedy, sampled and online")
        lists = {k: _buckets(data[k], mode, k) for k in ("greedy", "sampled") if data.get(k) is not None}
        return WidthPlan(lists["greedy"], lists.get("sampled", lists["greedy"]), _online(data.get("online", True)))


def _online(value: Any) -> OnlineCheckConfig | None:
    if value is True:
        return OnlineCheckConfig()
    if value is False or value is None:
        return None
    if isinstance(value, dict):
        fields = set(OnlineCheckConfig.__dataclass_fields__)
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"width plan online: unknown key(s) {unknown}; known: {sorted(fields)}")
        return OnlineCheckConfig(**value)
    raise ValueError(f"width plan online: true, false or a mapping, got {value!r}")


def size_class(batch_size: int) -> int:
    """Batch sizes grouped at ratio sqrt(2): 1, 2, 3, 4, 5-6, 7-9, 10-13, 14-18, 19-26, 27-36, ..."""
    return round(2 * math.log2(max(batch_size, 1)))


_MAX_PROBE_STRETCH = 4.0


class _Arm:
    __slots__ = ("tokens", "seconds", "last")

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.last = 0  # the key's observation count when this arm was last observed

    @property
    def known(self) -> bool:
        return self.seconds > 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


#: the arms a key may run: the plan's bucket, the lookup step of the bucket's own candidate
#: (where the bucket runs the mode's own step with one), plain AR steps
ARMS = ("plan", "lookup", "ar")


class OnlineCheck:
    """For each key (sampled or not, batch-size class): which arm runs, from their measured
    rates (see module doc): the plan's mode ("plan"), plain AR steps ("ar") and, where the plan
    runs the mode's own step with a context candidate, that candidate alone ("lookup": whether
    the mode's own proposals pay for their query tokens depends on the model, which a policy
    written without measuring cannot know). Starts with the plan and probes the other arms
    early, so a wrong plan is left within a few dozen steps."""

    def __init__(self, config: OnlineCheckConfig):
        self.config = config
        self._arms: dict[Any, dict[str, _Arm]] = {}
        self._best: dict[Any, str] = {}
        self._since_probe: dict[Any, int] = {}
        self._probing: dict[Any, tuple[str, int]] = {}  # the arm being probed and its steps left
        self._observed: dict[Any, int] = {}  # observations per key
        self.switches = 0  # times the faster arm changed
        self.observations = 0
        self.watch_probes = 0  # plan probes a `CandidateWatch` started

    def arm(self, key: Any, arms: tuple[str, ...] = ("plan", "ar")) -> str:
        """The arm the next step of this key runs among `arms` (and the probe schedule advanced)."""
        cfg = self.config
        best = self._best.setdefault(key, "plan")
        stats = self._arms.setdefault(key, {})
        for a in arms:
            stats.setdefault(a, _Arm())
        probing, left = self._probing.get(key, ("", 0))
        if left > 0 and probing in arms:
            self._probing[key] = (probing, left - 1)
            return probing
        others = [a for a in arms if a != best]
        if best not in arms or not others:
            return best if best in arms else arms[0]
        # the arm to probe next: one never measured, else the one measured longest ago
        target = min(others, key=lambda a: (stats[a].known, stats[a].last))
        since = self._since_probe.get(key, 0) + 1
        if stats[target].known:
            # the further ahead the running arm, the less a probe can find and the more it costs:
            # probe every probe_every steps at parity, up to 4x as rarely
            other = stats[target].rate
            lead = stats[best].rate / other if other > 0 else _MAX_PROBE_STRETCH
            wait = int(cfg.probe_every * min(max(lead, 1.0), _MAX_PROBE_STRETCH))
        else:
            wait = 2 * cfg.probe_steps
        if since > wait:
            self._since_probe[key] = 0
            self._probing[key] = (target, cfg.probe_steps - 1)
            return target
        self._since_probe[key] = since
        return best

    def probe_plan(self, key: Any) -> str:
        """Run the plan from this step on: a probe of it now where another arm is the faster
        (its usual length), the end of a probe otherwise."""
        if self._best.get(key, "plan") != "plan":
            self._probing[key] = ("plan", self.config.probe_steps - 1)
            self._since_probe[key] = 0
        else:
            self._probing[key] = ("", 0)
        self.watch_probes += 1
        return "plan"

    def observe(self, key: Any, arm: str, tokens_per_request: float, seconds: float) -> None:
        self.observations += 1
        count = self._observed[key] = self._observed.get(key, 0) + 1
        stats = self._arms.setdefault(key, {})
        a = stats.setdefault(arm, _Arm())
        # the past fades per step of the key, not per step of the arm: a probe's fresh steps
        # outweigh what the arm measured dozens of steps ago (the text has changed since)
        d = self.config.decay ** (count - a.last)
        a.tokens = d * a.tokens + tokens_per_request
        a.seconds = d * a.seconds + seconds
        a.last = count
        best = self._best.get(key, "plan")
        known = {name: s.rate for name, s in stats.items() if s.known}
        if best not in known or len(known) < 2:
            return
        fastest = max(known, key=known.__getitem__)
        if fastest != best and known[fastest] > known[best] * (1 + self.config.margin):
            self._best[key] = fastest
            self.switches += 1

    def summary(self) -> dict[str, Any]:
        """Per key, the arm it runs and each arm's measured rate (tokens / s / request)."""
        return {f"{'sampled' if k[0] else 'greedy'}-{k[1]}": {"runs": self._best.get(k, "plan"),
                                                                 **{f"{a}_rate": round(v[a].rate, 2) for a in v}}
                for k, v in self._arms.items()}


class CandidateWatch:
    """The context candidate a mode would verify for a sequence, kept while AR steps serve it:
    `came_true` says how many of its tokens the sequence has emitted since (a candidate that
    missed is replaced by the next one)."""

    def __init__(self, mode: Mode, seq: DecodeSequence):
        from selfspec.decoding.ngram import context_index

        cfg = mode.config
        self.mode = mode
        self.tokens = cfg.context_tokens
        self.index = context_index(seq, cfg, mode.corpus)
        self.start = 0  # history length when the candidate was proposed
        self.candidate: list[int] = []

    @staticmethod
    def watches(mode: Mode) -> bool:
        """Whether `mode` verifies context candidates (ISD, RISD, SJD, JACOBI with context_tokens)."""
        return getattr(getattr(mode, "config", None), "context_tokens", 0) > 0 and hasattr(mode, "corpus")

    def forget(self, history: list[int]) -> None:
        """Drop the kept candidate (the next `came_true` proposes afresh from `history`)."""
        self.start, self.candidate = len(history), []

    def came_true(self, history: list[int]) -> int:
        """Tokens of the kept candidate the sequence emitted since it was proposed; once it
        missed or ran out, the next candidate is kept."""
        emitted = history[self.start :]
        n, most = 0, min(len(emitted), len(self.candidate))
        while n < most and emitted[n] == self.candidate[n]:
            n += 1
        if n < len(emitted) or n == len(self.candidate):
            self.start, self.candidate = len(history), self.index.propose(history, self.tokens)
        return n


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
        if bucket_mode not in (mode, *PLAN_STEP_MODES):
            raise ValueError(f"width plan {name}[{i}]: mode {bucket_mode!r}; a {mode} plan runs "
                             f"{', '.join((mode, *PLAN_STEP_MODES))}")
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
                if s.watch is not None:
                    s.watch.forget(s.history)
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
            if s.watch is None or s.watch.mode is not mode:
                s.watch = CandidateWatch(mode, s)
            hit = s.watch.came_true(s.history) >= need or hit  # every watch sees every token
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
