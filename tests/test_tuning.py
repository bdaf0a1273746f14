"""The tuner's choice on synthetic cost tables (flat -> the widest that commits most, linear ->
width 1), its buckets, and the cost interpolation."""

from __future__ import annotations

import pytest

from selfspec.decoding.width_plan import WidthPlan
from selfspec.tuning.acceptance import Candidate
from selfspec.tuning.choose import buckets, choose
from selfspec.tuning.cost import CostTable

BATCHES = [1, 4, 16, 32]
WIDTHS = [1, 4, 8, 16]
CANDIDATES = [
    Candidate("ar", {}, 1, {"greedy": 1.0, "sampled": 1.0}),
    Candidate("isd", {"stride": 2}, 3, {"greedy": 1.6, "sampled": 1.3}),
    Candidate("isd", {"stride": 4}, 7, {"greedy": 2.4, "sampled": 1.4}),
    Candidate("isd", {"stride": 4, "context_tokens": 8}, 15, {"greedy": 3.0, "sampled": 1.5}),
]


def table(fn) -> CostTable:
    return CostTable(BATCHES, WIDTHS, [[fn(b, w) for w in WIDTHS] for b in BATCHES])


def test_flat_cost_picks_the_widest_that_commits_most():
    plan = choose(table(lambda b, w: 10.0), CANDIDATES, "greedy", 32)
    assert {c.best.label for c in plan} == {"stride=4,context_tokens=8"}


def test_linear_cost_picks_width_one():
    plan = choose(table(lambda b, w: 0.5 * b * w), CANDIDATES, "greedy", 32)
    assert {c.best.mode for c in plan} == {"ar"}


def test_roofline_narrows_with_the_batch_and_buckets_follow():
    # flat until 16 query tokens per forward, then linear: wide at batch 1, AR at large batches
    plan = choose(table(lambda b, w: 5.0 * max(1.0, b * w / 16)), CANDIDATES, "greedy", 32)
    widths = [c.best.width for c in plan]
    assert widths[0] == 15 and widths[-1] == 1 and widths == sorted(widths, reverse=True), widths
    bk = buckets(plan)
    assert bk[-1].max_batch is None and bk[-1].mode == "ar"
    caps = [b.max_batch for b in bk[:-1]]
    assert caps == sorted(caps)
    parsed = WidthPlan.from_dict([b.to_dict() for b in bk], "isd")  # a valid plan
    for c in plan:
        assert parsed.greedy[parsed.bucket(c.batch, False)].options == c.best.options


def test_greedy_only_candidates_never_serve_sampled_batches():
    jacobi = Candidate("jacobi", {"block_size": 8}, 8, {"greedy": 5.0, "sampled": float("nan")})
    plan = choose(table(lambda b, w: 10.0), [CANDIDATES[0], jacobi], "sampled", 4)
    assert {c.best.mode for c in plan} == {"ar"}


def test_cost_interpolation_and_extrapolation():
    t = table(lambda b, w: 2.0 + b * w)
    assert t.time_ms(4, 4) == pytest.approx(18.0)
    assert t.time_ms(2, 4) == pytest.approx(10.0)  # between grid batches: linear, exact for this form
    assert t.time_ms(4, 6) == pytest.approx(26.0)  # between grid widths
    assert t.time_ms(64, 4) == pytest.approx(2.0 + 64 * 4)  # past the grid: along the last segment
    with pytest.raises(ValueError, match="increasing"):
        CostTable([4, 1], WIDTHS, [[1.0] * 4] * 2)
