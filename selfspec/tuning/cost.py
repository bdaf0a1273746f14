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
from dataclasses import dataclass


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


#: Sweeps of the forward-cost grid (`measure`), the fastest kept per point: a slowdown of the
#: shared machine lasts longer than one point's reps, rarely as long as a sweep.
GRID_PASSES = 2


def measure(forward: Callable[[int, int], Callable[[], None]], batch_sizes: list[int], widths: list[int],
            reps: int = 5, progress=None, passes: int = GRID_PASSES) -> CostTable:
    """`forward(batch, width)` prepares one grid point and returns the call to time. Each point
    is the median of `reps` forwards, taken in `passes` sweeps of the whole grid, the fastest
    sweep kept."""
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
