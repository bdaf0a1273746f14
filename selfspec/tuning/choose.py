"""The plan: per batch size, the candidate with the most expected output tokens per second.

A step of batch b where every request runs candidate c costs T(b, width_c) + overhead(b, width_c)
(the forward, then what a server step costs besides, `cost.StepOverhead`; width_c the query
tokens a request's step carries: the real ones where the forward is ragged) and commits
b · tokens_per_step_c tokens, so its throughput is b · tokens_per_step_c / (T + overhead).
Every batch size from 1 to `max_batch` gets its best candidate; runs of equal choices become
one bucket, the last one open. Among candidates predicted within `tolerance` of the best, the
narrowest is chosen: the costs are noisy and the error of a prediction grows with the query
tokens it prices (at batch 16 the tuner put a 4-token lookup 3% ahead of an 8-token one, kept
the 8 because batch 15 had chosen it, and served, the 4 ran 14% faster: README "Predicted
speed-ups and the narrower of near-ties"). And a speculative candidate is chosen over
plain AR steps only if it is predicted `margin` (`MARGIN`) faster: the whole prediction (costs,
acceptance on the tuner's prompts) is off by up to ~15% served, and a plan that speculates for a
predicted +5% measured 0.89x AR (README "Context candidates across requests"). The choice for greedy
batches uses greedy acceptance; for batches with sampled rows, the sampled acceptance (a
greedy-only mode never serves them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from selfspec.decoding.width_plan import PlanBucket
from selfspec.tuning.acceptance import Candidate
from selfspec.tuning.cost import CostTable, StepOverhead


#: how much faster than AR steps a speculative candidate must be predicted (before the tolerance).
#: 0.10 until sampled lookups the tuner put 17% ahead of AR steps at batch 4 served 0.98x stock AR
#: (README "AR steps on the verify path"): sampled speculation is the most over-predicted.
MARGIN = 0.15
#: how close to the best a candidate must be predicted to count as a near-tie (`pick`)
TOLERANCE = 0.03


@dataclass
class Choice:
    batch: int
    best: Candidate
    tokens_per_s: dict[str, float]  # candidate label -> predicted output tok/s at this batch


def throughput(costs: CostTable, cand: Candidate, kind: str, batch: int,
               overhead: StepOverhead | None = None) -> float:
    """Predicted output tokens per second of `batch` requests running `cand`."""
    tps = cand.tokens_per_step.get(kind, float("nan"))
    if not math.isfinite(tps):
        return float("nan")
    width = cand.priced_width(kind)
    extra = overhead.ms(batch, width, lookup=cand.is_lookup) if overhead is not None else 0.0
    return 1e3 * batch * tps / (costs.time_ms(batch, width) + extra)


def choose(costs: CostTable, candidates: list[Candidate], kind: str, max_batch: int,
           overhead: StepOverhead | None = None, tolerance: float = TOLERANCE, margin: float = MARGIN) -> list[Choice]:
    """The chosen candidate at every batch size 1 … max_batch: the narrowest predicted within
    `tolerance` of the best, AR's prediction raised by `margin` first (so AR steps win unless a
    candidate is predicted (1 + margin) / (1 − tolerance) times as fast)."""
    out: list[Choice] = []
    for b in range(1, max_batch + 1):
        scores = {c.label: throughput(costs, c, kind, b, overhead) for c in candidates}
        usable = [c for c in candidates if math.isfinite(scores[c.label])]
        if not usable:
            raise ValueError(f"no candidate can serve {kind} batches")
        out.append(Choice(b, pick(usable, kind, lambda c: scores[c.label], tolerance, margin), scores))
    return out


def pick(usable: list[Candidate], kind: str, score: Callable[[Candidate], float], tolerance: float = TOLERANCE,
         margin: float = MARGIN) -> Candidate:
    """The candidate a plan takes by `score` (higher is better): AR steps' raised by `margin` (they
    get the benefit of the doubt), then of those within `tolerance` of the best the fewest padded
    query tokens, then the fewest real ones, then the best score. Padded first: a ragged step pays
    for its widest request in parts (the attention groups, the logits and verify rules over the
    padded block), which steps of identical calibration requests never show; by real tokens
    alone, the 16-token capped lookups won batch 4's near-tie over the 12-token one and served
    5-8% slower than it (README "Shared steps pooled")."""
    ranked = {c.label: score(c) * (1.0 + margin if c.mode == "ar" else 1.0) for c in usable}
    top = max(ranked.values())
    near = [c for c in usable if ranked[c.label] >= (1.0 - tolerance) * top]
    return min(near, key=lambda c: (c.width, c.priced_width(kind), -ranked[c.label]))


def servable(candidates: list[Candidate], kind: str, greedy_only: bool) -> list[Candidate]:
    """The candidates a plan for `kind` batches may choose: AR steps alone for the sampled
    batches of a greedy-only mode (its server refuses sampled requests; the lookup steps could
    serve them, but the plan must not promise what the server will not do)."""
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
