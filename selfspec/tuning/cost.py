"""Forward time of this machine by batch size and query tokens per request.

The grid is measured with the HF engine's step runner on the model the plan is for: each
point is one forward of `width` query tokens for each of `batch` sequences whose KV already
holds `context` tokens, the median of `reps` timed runs after a warm-up. Between grid points the
time is interpolated linearly in both coordinates; beyond the largest batch it is extrapolated
along the last segment (the device is in its linear regime there).
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CostTable:
    batch_sizes: list[int]  # increasing
    widths: list[int]  # increasing query tokens per request
    ms: list[list[float]]  # ms[i][j]: forward time at batch_sizes[i], widths[j]

    def __post_init__(self) -> None:
        if sorted(set(self.batch_sizes)) != list(self.batch_sizes) or sorted(set(self.widths)) != list(self.widths):
            raise ValueError("cost grid coordinates must be increasing")
        if len(self.ms) != len(self.batch_sizes) or any(len(r) != len(self.widths) for r in self.ms):
            raise ValueError("cost grid shape does not match its coordinates")

    def time_ms(self, batch: int, width: int) -> float:
        """Interpolated forward time (ms) of `batch` requests with `width` query tokens each."""
        return _interp(self.batch_sizes, [_interp(self.widths, row, width) for row in self.ms], batch)

    def monotone(self) -> CostTable:
        """The closest table (least squares, row by row then column by column) in which more
        work never costs less: one noisy fast point would otherwise pick a width by luck, and
        one noisy slow point raised to a running maximum would spread to every wider point."""
        rows = [_isotonic(row) for row in self.ms]
        cols = [_isotonic([rows[i][j] for i in range(len(rows))]) for j in range(len(self.widths))]
        ms = [[cols[j][i] for j in range(len(self.widths))] for i in range(len(rows))]
        for i in range(len(ms)):  # the column pass can leave a row slightly out of order
            for j in range(1, len(ms[i])):
                ms[i][j] = max(ms[i][j], ms[i][j - 1])
        return CostTable(list(self.batch_sizes), list(self.widths), ms)

    def to_dict(self) -> dict:
        return {"batch_sizes": self.batch_sizes, "widths": self.widths, "ms": self.ms}


@dataclass
class StepOverhead:
    """What a served step costs beyond the grid's forward, measured on a server of the mode
    (`calibrate.py`) or given by hand. Three parts, each piecewise-linear through measured points
    and extended along the end segments:

    - `ar_ms` (batch -> ms), paid by every step: scheduling, request bookkeeping, sampling;
    - `verify_ms` (query tokens batch·width -> ms), paid on top by a step wider than one token:
      SGLang's extend path, the step mask, the verify rules over every query row. It grows with
      the rows, which is why a calibration at width 1 alone predicted wide steps too cheap;
    - `lookup_ms`, the same for a lookup step (a plan's `mode: ngram` bucket), where measured:
      a chain with no MASK rows, no adapter and no proposals to build, it cost 5 ms less than
      RISD's own step at batch 1 and 13 query tokens, and priced as one it lost the plans
      their lookup steps (README "Lookup steps priced as lookup steps").
    """

    ar_ms: dict[int, float] = field(default_factory=dict)
    verify_ms: dict[int, float] = field(default_factory=dict)
    lookup_ms: dict[int, float] = field(default_factory=dict)
    # "ar" / "verify@W" / "lookup@W" -> batch -> step ms
    measured: dict[str, dict[int, float]] = field(default_factory=dict)
    # lookup steps timed at two widths: width -> batch -> excess ms. Where present it prices a
    # lookup step by its batch and width (linear in the width between and beyond the two): the
    # served forward's cost grows more slowly with query tokens than the HF engine's grid says
    # (a C=16 ragged step of 95 real tokens took 2.2 ms less than one of 136, where the grid
    # put 5.8 ms between them), so an excess keyed by total tokens alone priced short drafts
    # too cheap (README "Draft lengths that follow each request").
    lookup_by_width: dict[int, dict[int, float]] = field(default_factory=dict)
    # what a request costs besides its decode steps (prefill, HTTP, detokenizing), batch-1 AR
    # server: paid once per request of a bench level. Left out, a fast plan's predicted speed-up
    # read high by the share it takes of its shorter request time (~5% of a 128-token ISD
    # request at C=1 here)
    request_ms: float = 0.0
    # the mode's own verify steps timed at two widths, the same way: keyed by total query tokens
    # alone, the excess measured at 13 tokens (batch 1) priced a 4-token ISD step 1.0 ms dearer
    # than it served, and the tuner chose AR steps at batch 1 where stride 3 served 1.17x them
    # (README "Stock AR in the tuner's levels, own steps timed at two widths")
    verify_by_width: dict[int, dict[int, float]] = field(default_factory=dict)

    @staticmethod
    def linear(base_ms: float, per_request_ms: float = 0.0) -> StepOverhead:
        """base + per_request × batch on every step, nothing extra for verify steps."""
        return StepOverhead({1: base_ms + per_request_ms, 2: base_ms + 2 * per_request_ms})

    def ms(self, batch: int, width: int = 1, lookup: bool = False) -> float:
        """A step of `batch` requests, `width` query tokens each; `lookup`: a lookup step (priced
        by `lookup_ms` where it was measured, else as any verify step)."""
        out = _curve(self.ar_ms, batch)
        by_width = self.lookup_by_width if lookup else self.verify_by_width
        if width > 1 and len(by_width) >= 2:
            widths = sorted(by_width)
            out += _interp(widths, [_curve(by_width[w], batch) for w in widths], width)
        elif width > 1:
            out += _curve(self.lookup_ms if lookup and self.lookup_ms else self.verify_ms, batch * width)
        return out

    def to_dict(self) -> dict:
        return {"ar_ms": self.ar_ms, "verify_ms": self.verify_ms, "lookup_ms": self.lookup_ms,
                "measured_step_ms": self.measured, "lookup_by_width": self.lookup_by_width,
                "verify_by_width": self.verify_by_width, "request_ms": self.request_ms}

    @staticmethod
    def from_dict(d: dict) -> StepOverhead:
        """The inverse of `to_dict`, from its JSON form too (keys written as strings)."""
        pts = lambda m: {int(float(k)): float(v) for k, v in (m or {}).items()}  # noqa: E731
        return StepOverhead(pts(d.get("ar_ms")), pts(d.get("verify_ms")), pts(d.get("lookup_ms")),
                            {what: pts(m) for what, m in (d.get("measured_step_ms") or {}).items()},
                            {int(w): pts(m) for w, m in (d.get("lookup_by_width") or {}).items()},
                            float(d.get("request_ms") or 0.0),
                            {int(w): pts(m) for w, m in (d.get("verify_by_width") or {}).items()})


def _curve(points: dict[int, float], x: float) -> float:
    if not points:
        return 0.0
    xs = sorted(points)
    return _interp(xs, [points[k] for k in xs], x)


def _isotonic(ys: list[float]) -> list[float]:
    """Pool-adjacent-violators: the non-decreasing sequence nearest to ys in least squares."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    out: list[float] = []
    for s, n in blocks:
        out += [s / n] * int(n)
    return out


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended along the first / last segment."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


#: Sweeps of the forward-cost grid (`measure`).
GRID_PASSES = 2


def measure(forward: Callable[[int, int], Callable[[], None]], batch_sizes: list[int], widths: list[int],
            reps: int = 5, progress=None, passes: int = GRID_PASSES) -> CostTable:
    """`forward(batch, width)` prepares one grid point and returns the call to time. Each point
    is the median of `reps` forwards, taken in `passes` sweeps of the whole grid, the fastest
    sweep kept: a slowdown of the shared machine lasts longer than one point's reps (one such
    spike, 15 ms for ~11 at batch 4 width 12, turned a tuned ISD plan's batch-4 bucket from
    an 8- to a 4-token candidate), rarely as long as a sweep."""
    if passes < 1:
        raise ValueError(f"cost grid: passes must be >= 1, got {passes}")
    ms = [[float("inf")] * len(widths) for _ in batch_sizes]
    for _ in range(passes):
        for i, b in enumerate(batch_sizes):
            for j, w in enumerate(widths):
                run = forward(b, w)
                run()  # warm-up
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    run()
                    times.append(1e3 * (time.perf_counter() - t0))
                ms[i][j] = min(ms[i][j], statistics.median(times))
                if progress is not None:
                    progress.update(1)
    return CostTable(list(batch_sizes), list(widths), ms)


def hf_forward(engine, context: int = 192) -> Callable[[int, int], Callable[[], None]]:
    """Grid points on the HF engine: a KV cache of `batch` sequences holding `context` tokens,
    then forwards of `width` causal query tokens that are never committed."""
    import torch

    from selfspec.decoding.step import StepLayout, collate
    from selfspec.engines.kv_cache import SlotKVCache

    vocab = engine.vocab_size

    def point(batch: int, width: int) -> Callable[[], None]:
        gen = torch.Generator().manual_seed(batch * 1000 + width)
        cache = SlotKVCache(engine.num_layers, batch, context + width + 8, engine.device, engine.dtype)
        prompt = torch.randint(0, vocab, (batch, context), generator=gen).tolist()
        with torch.inference_mode():
            engine.runner.forward(cache, collate([StepLayout(p) for p in prompt], device=engine.device))
        cache.commit([list(range(context))] * batch)
        step = collate([StepLayout(torch.randint(0, vocab, (width,), generator=gen).tolist()) for _ in range(batch)],
                       device=engine.device)

        def run() -> None:
            with torch.inference_mode():
                engine.runner.forward(cache, step)

        return run

    return point
