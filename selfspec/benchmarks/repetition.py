"""Repetition loops in benchmark outputs, and the numbers of the outputs that do not loop.

The tiny models' greedy outputs often end in a loop (the same few tokens over and over), which
flatters every lookup method (n-gram drafts copy the loop). Both benchmarks therefore report each
mode on all outputs and on its non-looping ones. Which outputs loop is decided per mode, from that
mode's own outputs: sampled outputs differ between modes, and a mode is judged on what it produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


def is_repetition_loop(tokens: list[int], max_period: int = 16, min_span: int = 16, min_repeats: int = 4) -> bool:
    """True when the output ends in a loop: for some period P <= max_period, its last
    max(min_span, min_repeats * P) tokens repeat with period P (t[i] == t[i - P])."""
    n = len(tokens)
    for period in range(1, max_period + 1):
        span = max(min_span, min_repeats * period)
        if span + period > n:
            break
        tail = tokens[n - span :]
        prev = tokens[n - span - period : n - period]
        if tail == prev:
            return True
    return False


@dataclass
class OutputStat:
    """One output: its generated token ids, the forwards that produced it (None: unknown), its own
    wall time in seconds (None: unknown, e.g. decoded in a batch with others) and its token count
    (None: len(token_ids); a server's usage count where that is the benchmark's basis)."""

    token_ids: list[int]
    forwards: int | None
    seconds: float | None = None
    tokens: int | None = None

    @property
    def count(self) -> int:
        return len(self.token_ids) if self.tokens is None else self.tokens

    @property
    def loops(self) -> bool:
        return is_repetition_loop(self.token_ids)


def non_loop_summary(outputs: Iterable[OutputStat]) -> dict[str, Any]:
    """The `non_loop` block of a benchmark row: the outputs that do not end in a loop, their
    tokens, forwards, TPF (tokens / forwards), summed wall time and tokens/s (tokens / their summed
    wall time). A field is None when it cannot be computed (no such output, forwards or time of
    one of them unknown); `ratio_vs_ar` is filled by `set_ratio_vs_ar`."""
    keep = [o for o in outputs if not o.loops]
    tokens = sum(o.count for o in keep)
    forwards = None if any(o.forwards is None for o in keep) else sum(o.forwards for o in keep)
    wall = None if not keep or any(o.seconds is None for o in keep) else sum(o.seconds for o in keep)
    return {
        "outputs": len(keep),
        "tokens": tokens,
        "forwards": forwards,
        "tpf": tokens / forwards if forwards else None,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else None,
        "ratio_vs_ar": None,
    }


def set_ratio_vs_ar(block: dict[str, Any] | None, ar_block: dict[str, Any] | None) -> None:
    """block["ratio_vs_ar"] = its tokens/s over AR's non-looping tokens/s (> 1 is faster)."""
    if block is None:
        return
    base = (ar_block or {}).get("tokens_per_s")
    rate = block.get("tokens_per_s")
    block["ratio_vs_ar"] = rate / base if rate is not None and base else None
