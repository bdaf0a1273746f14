"""A step's width chosen from the batch it runs in: the plan `selfspec tune` writes, and its
schema (the mode that follows it: `planned_mode.py`).

Self-speculation pays while a forward of several query tokens per request costs little more
than a forward of one. That depends on the batch: the wider the batch, the sooner the device
turns from flat to linear in query tokens. A `WidthPlan` lists, for batches of greedy rows and
for batches with sampled rows, buckets of batch sizes and the mode configuration each runs
(`mode: ar` is a plain one-token step, `mode: ngram` the lookup step: the context candidate
alone). `PlannedMode` runs one mode object per bucket and picks the bucket from each step's batch.

Lossless at every width: each bucket's mode is lossless on its own, and a sequence that moves to
another bucket's mode is started afresh by that mode (`Mode.start` from its committed history,
as after prefill), so what it carries over is only committed tokens. The first step after a
switch is the new mode's opening step (ISD: a propose-only step). The seed columns of a step are
a prefix of the widest bucket's, so every bucket reads its seeds where it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
