"""The plan: per batch size, the candidate with the most expected output tokens per second.

A step of batch b where every request runs candidate c costs T(b, width_c) (the forward; width_c
the query tokens a request's step carries: the real ones where the forward is ragged) and
commits b · tokens_per_step_c tokens, so its throughput is b · tokens_per_step_c / T. Every batch
size from 1 to `max_batch` gets its best candidate; runs of equal choices become one bucket,
the last one open. What the forward grid leaves out (the server's own cost per step) is left to
the served plan's run-time check (`online_check.OnlineCheck`), which measures each bucket against
plain AR steps and serves the faster. The choice for greedy batches uses greedy acceptance; for
batches with sampled rows, the sampled acceptance (a greedy-only mode never serves them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from selfspec.decoding.widths.width_plan import PlanBucket
from selfspec.tuning.acceptance import Candidate
from selfspec.tuning.cost import CostTable


@dataclass
class Choice:
    batch: int
    best: Candidate
    tokens_per_s: dict[str, float]  # candidate label -> predicted output tok/s at this batch


def throughput(costs: CostTable, cand: Candidate, kind: str, batch: int) -> float:
    """Predicted output tokens per second of `batch` requests running `cand`."""
    tps = cand.tokens_per_step.get(kind, float("nan"))
    if not math.isfinite(tps):
        return float("nan")
    return 1e3 * batch * tps / costs.time_ms(batch, cand.priced_width(kind))


def choose(costs: CostTable, candidates: list[Candidate], kind: str, max_batch: int) -> list[Choice]:
    """The best predicted candidate at every batch size 1 … max_batch."""
    out: list[Choice] = []
    for b in range(1, max_batch + 1):
        scores = {c.label: throughput(costs, c, kind, b) for c in candidates}
        usable = [c for c in candidates if math.isfinite(scores[c.label])]
        if not usable:
            raise ValueError(f"no candidate can serve {kind} batches")
        out.append(Choice(b, max(usable, key=lambda c: scores[c.label]), scores))
    return out


def servable(candidates: list[Candidate], kind: str, greedy_only: bool) -> list[Candidate]:
    """The candidates a plan for `kind` batches may choose: AR steps alone for the sampled
    batches of a greedy-only mode (its server refuses sampled requests)."""
    if kind == "sampled" and greedy_only:
        return [c for c in candidates if c.mode == "ar"]
    return list(candidates)


def buckets(choices: list[Choice]) -> list[PlanBucket]:
    """Runs of equal choices as plan buckets (the last one serves any larger batch too)."""
    out: list[PlanBucket] = []
    for ch in choices:
        if out and out[-1].mode == ch.best.mode and out[-1].options == ch.best.options:
            out[-1] = PlanBucket(ch.batch, ch.best.mode, dict(ch.best.options))
        else:
            out.append(PlanBucket(ch.batch, ch.best.mode, dict(ch.best.options)))
    last = out[-1]
    out[-1] = PlanBucket(None, last.mode, last.options)
    return out
