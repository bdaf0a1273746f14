"""A served benchmark level replayed from the tuner's measurements: what `selfspec bench serve`
reads at concurrency C, where `choose.throughput` prices a full batch of C requests for ever.

A bench level is N requests with C in flight. Requests differ in how much each step commits: a
request copying a loop from its context finishes in a dozen lookup steps and its slot goes to
the next in the queue, one writing new text runs on; once the queue is empty the batch thins to
the slowest requests, which then run at a small batch whose steps commit few tokens each. The
steady prediction misses both (session q: +19–36% at C=16 for capped lookups, whose requests
differ most; README "A verify step's hidden copy").

The replay: request i is the tuner's prompt i mod P, writing `tokens` tokens. Each step the b
requests in flight run the plan's candidate for b; each advances by its own prompt's tokens per
step under that candidate (committed / steps of its acceptance run, `Candidate.per_request`); the
step costs the forward of b requests at their mean query tokens per step (the padded width where
the forward is not ragged) plus the step overhead (`cost.StepOverhead`). Output tok/s = all
tokens over the steps' summed time plus each request's own cost besides its steps
(`StepOverhead.request_ms`: prefill and request handling, paid in full even at C > 1: SGLang's
prefill batches pause the decode batch). It is the same for every plan of a level, but a larger
share of a faster plan's time: left out, the predicted speed-ups read high by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from selfspec.tuning.acceptance import Candidate
from selfspec.tuning.choose import MARGIN, TOLERANCE, Choice, pick
from selfspec.tuning.cost import CostTable, StepOverhead


@dataclass
class LevelReplay:
    tok_s: float  # output tokens per second of the level
    steps: int  # decode steps it took
    mean_batch: float  # requests per step, averaged over its steps


def _rates(cand: Candidate, kind: str) -> list[tuple[float, float]]:
    """Per prompt (tokens per step, query tokens per step) of `cand`; its means where it has no
    per-prompt record (a tune from before they were kept)."""
    rows = [r for r in cand.per_request.get(kind, []) if r[1] > 0]
    if rows:
        return [(r[0] / r[1], r[2] / r[1]) for r in rows]
    tps = cand.tokens_per_step.get(kind, 1.0 if cand.mode == "ar" else float("nan"))
    return [(tps, cand.query_tokens_per_step.get(kind, float(cand.width)))]


def replay_level(costs: CostTable, pick: Callable[[int], Candidate], kind: str, concurrency: int, requests: int,
                 tokens: int, overhead: StepOverhead | None = None) -> LevelReplay:
    """The level of `requests` requests of `tokens` tokens each, `concurrency` in flight, each
    step running `pick(batch)`."""
    if concurrency < 1 or requests < 1 or tokens < 1:
        raise ValueError("a level needs concurrency, requests and tokens >= 1")
    rates: dict[int, list[tuple[float, float]]] = {}  # id(candidate) -> per prompt rates

    def rate(cand: Candidate, req: int) -> tuple[float, float]:
        table = rates.setdefault(id(cand), _rates(cand, kind))
        return table[req % len(table)]

    left = {}  # request -> tokens still to write
    queue = list(range(requests))
    elapsed_ms, steps, batch_sum = 0.0, 0, 0
    while queue or left:
        while queue and len(left) < concurrency:
            left[queue.pop(0)] = float(tokens)
        b = len(left)
        cand = pick(b)
        per = {r: rate(cand, r) for r in left}
        if any(not math.isfinite(tps) or tps <= 0 for tps, _ in per.values()):
            raise ValueError(f"candidate {cand.label} has no {kind} acceptance to replay")
        width = (sum(q for _, q in per.values()) / b) if cand.ragged else float(cand.width)
        width = max(1.0, width)
        extra = overhead.ms(b, width, lookup=cand.is_lookup) if overhead is not None else 0.0
        elapsed_ms += costs.time_ms(b, width) + extra
        steps += 1
        batch_sum += b
        for r, (tps, _) in per.items():
            left[r] -= tps
        left = {r: n for r, n in left.items() if n > 1e-9}
    if overhead is not None:
        elapsed_ms += requests * overhead.request_ms
    return LevelReplay(1e3 * requests * tokens / elapsed_ms, steps, batch_sum / steps)


def plan_levels(costs: CostTable, chosen: list[Candidate], ar: Candidate, kind: str, levels: list[int], requests: int,
                tokens: int, overhead: StepOverhead | None = None,
                ar_overhead: StepOverhead | None = None) -> dict[int, tuple[float, float]]:
    """Per concurrency level (`requests` requests, at least C, of `tokens` tokens), the replayed
    tok/s of the plan whose candidate at batch b is chosen[b - 1] (the last beyond) and of AR
    steps, priced by `ar_overhead` where given (stock AR's, `calibrate.stock_ar_overhead`: what the
    bench compares with), else by the plan's own."""
    pick = lambda b: chosen[min(b, len(chosen)) - 1]  # noqa: E731
    out = {}
    for c in levels:
        n = max(requests, c)
        out[c] = (replay_level(costs, pick, kind, c, n, tokens, overhead).tok_s,
                  replay_level(costs, lambda b: ar, kind, c, n, tokens, ar_overhead or overhead).tok_s)
    return out


def settle_widest(costs: CostTable, choices: list[Choice], candidates: list[Candidate], kind: str, requests: int,
                  tokens: int, overhead: StepOverhead | None = None, tolerance: float = TOLERANCE,
                  margin: float = MARGIN) -> list[Choice]:
    """`choose.choose`'s choices with the widest bucket (the run of batches up to the largest that
    share its candidate) chosen again by the level it serves, replayed at the largest batch, by the
    rule every choice follows (`choose.pick`).
    The steady-state choice prices a full batch for ever; a level at that batch thins as requests
    finish and its slowest requests, which set its length, gain least from long drafts (at
    batch 32 an 8-token adaptive lookup was priced 8% ahead of a 4-token one steady and level
    with it replayed; served, the 4-token one was 5% faster: README "Shared steps pooled")."""
    top = len(choices)
    lo = top
    while lo > 1 and choices[lo - 2].best is choices[top - 1].best:
        lo -= 1
    below = [ch.best for ch in choices[: lo - 1]]

    def level(cand: Candidate) -> float:
        run = lambda b: cand if b >= lo else below[b - 1]  # noqa: E731
        return replay_level(costs, run, kind, top, max(requests, top), tokens, overhead).tok_s

    usable = [c for c in candidates if math.isfinite(choices[-1].tokens_per_s.get(c.label, math.nan))]
    widest = pick(usable, kind, level, tolerance, margin)
    return [*choices[: lo - 1], *(Choice(ch.batch, widest, ch.tokens_per_s) for ch in choices[lo - 1:])]
