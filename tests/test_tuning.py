"""`selfspec tune`: its choice on synthetic cost tables (flat -> the widest that commits most,
linear -> width 1), its buckets, the cost grid and interpolation, the acceptance runs, and the
plan it writes (a serving config that records its model; another model's server refuses it)."""

from __future__ import annotations

import json

import pytest

from selfspec.decoding.widths.width_plan import WidthPlan
from selfspec.tuning.acceptance import Candidate
from selfspec.tuning.choose import buckets, choose, servable
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


def test_monotone_fit_averages_a_spike_instead_of_spreading_it():
    t = CostTable([1, 2], [1, 2, 4, 8], [[5.0, 12.0, 6.0, 7.0], [6.0, 7.0, 8.0, 9.0]]).monotone()
    assert max(t.ms[0]) < 8.5  # the 12 ms spike is pooled with its neighbours, not carried to w=8
    assert all(a <= b for row in t.ms for a, b in zip(row, row[1:]))
    assert all(t.ms[0][j] <= t.ms[1][j] + 1e-9 for j in range(4))  # a larger batch never costs less


def test_a_slowdown_during_one_sweep_of_the_grid_does_not_reach_the_table(monkeypatch):
    """The machine slows down for a while (longer than one point's reps): the grid's other sweep
    keeps the point's real cost."""
    from selfspec.tuning import cost

    clock = {"now": 0.0, "calls": 0}
    true_ms = {(1, 1): 4.0, (1, 8): 6.0, (4, 1): 7.0, (4, 8): 11.0}

    def forward(batch, width):
        def run():
            clock["calls"] += 1
            slow = 19 <= clock["calls"] <= 24  # the first sweep's last point (6 calls a point), reps and all
            clock["now"] += (true_ms[(batch, width)] * (2.0 if slow else 1.0)) / 1e3
        return run

    monkeypatch.setattr(cost.time, "perf_counter", lambda: clock["now"])
    one = cost.measure(forward, [1, 4], [1, 8], reps=5, passes=1)
    assert one.ms[1][1] == pytest.approx(22.0)  # a single sweep keeps the spike
    clock["calls"] = 0
    two = cost.measure(forward, [1, 4], [1, 8], reps=5, passes=2)
    assert [v for row in two.ms for v in row] == pytest.approx([4.0, 6.0, 7.0, 11.0])


def test_greedy_acceptance_runs_draw_on_a_warm_corpus():
    """The tuner's greedy acceptance runs see a corpus holding other prompts' outputs, as a
    server's context candidates do; sampled runs never use it. A corpus holding the prompt's own
    continuation (a server asked the same twice) makes the candidate accept far more."""
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine
    from selfspec.tuning import acceptance

    engine = HFEngine.from_pretrained("tiny-idlm")
    prompts = [engine.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(description=")]
    samplings = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.7)}
    warm = acceptance.warm_corpus(engine, prompts, 48)
    assert warm.tokens == len(prompts[0]) + 48
    runs = {}
    for name, corpus in (("cold", None), ("warm", warm)):
        cand = acceptance.Candidate("isd", {"stride": 2, "context_tokens": 8})
        acceptance.measure(engine, [cand], prompts, 48, samplings, corpus=corpus)
        runs[name] = cand.tokens_per_step
    assert runs["warm"]["greedy"] > runs["cold"]["greedy"] + 1.5, runs
    assert runs["warm"]["sampled"] == runs["cold"]["sampled"]
    assert warm.tokens == len(prompts[0]) + 48  # each run drew on a copy


def test_the_tuner_measures_real_query_tokens_of_unpadded_layouts():
    """`measure(ragged=True)` builds ISD's layouts unpadded (as the CPU worker does) and keeps the
    real query tokens per step: below the padded width when the context candidate is short."""
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine
    from selfspec.tuning import acceptance

    engine = HFEngine.from_pretrained("tiny-idlm")
    prompts = [engine.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(description=")]
    cand = acceptance.Candidate("isd", {"stride": 3, "context_tokens": 16})
    acceptance.measure(engine, [cand], prompts, 48, {"greedy": SamplingParams()}, ragged=True)
    assert cand.width == 1 + 2 * 2 + 16 + 2  # the padded width: pending, 2 proposals, 2 MASK, candidate + tail
    assert 1 < cand.query_tokens_per_step["greedy"] < cand.width
    assert cand.to_dict()["query_tokens_per_step"] == cand.query_tokens_per_step


def test_cost_interpolation_and_extrapolation():
    t = table(lambda b, w: 2.0 + b * w)
    assert t.time_ms(4, 4) == pytest.approx(18.0)
    assert t.time_ms(2, 4) == pytest.approx(10.0)  # between grid batches: linear, exact for this form
    assert t.time_ms(4, 6) == pytest.approx(26.0)  # between grid widths
    assert t.time_ms(64, 4) == pytest.approx(2.0 + 64 * 4)  # past the grid: along the last segment
    with pytest.raises(ValueError, match="increasing"):
        CostTable([4, 1], WIDTHS, [[1.0] * 4] * 2)


def test_candidates_are_the_policys_own_step_and_the_lookups():
    from selfspec.tuning.acceptance import candidates_for

    for mode in ("isd", "risd", "sjd", "jacobi"):
        labels = [c.label for c in candidates_for(mode)]
        assert labels[0] == "ar" and {"lookup=4", "lookup=8ca", "lookup=12ca", "lookup=16"} <= set(labels)
    own = [c for c in candidates_for("isd") if c.mode == "isd"]
    assert {c.options["context_tokens"] for c in own} == {0, 4, 16} and all(c.options["stride"] == 2 for c in own)


def test_written_config_round_trips_into_the_server_config(tmp_path, tiny_base_path):
    """What `selfspec tune` writes is a serving config: the server resolves its plan (its verify
    width the widest bucket's), and a server of another model refuses it, naming why."""
    import argparse

    import yaml
    from sglang_fixtures import resolve_in_process

    from selfspec.decoding import registry
    from selfspec.checkpoints.metadata import model_fingerprint
    from selfspec.sglang_ext.config import SelfSpecConfigError, load_yaml_config
    from selfspec.tuning.command import _yaml_text

    costs = table(lambda b, w: 5.0 * max(1.0, b * w / 16))
    plan = {kind: [b.to_dict() for b in buckets(choose(costs, CANDIDATES, kind, 32))] for kind in ("greedy", "sampled")}
    args = argparse.Namespace(model="tiny-base", threads=1, dtype="float32", limit=8, prompts="tune",
                              max_new_tokens=64, temperature=0.7)
    path = tmp_path / "plan.yaml"
    path.write_text(_yaml_text("isd", plan, model_fingerprint(tiny_base_path), ["a line"], args))
    text = path.read_text()
    assert text.startswith("# Width plan for ISD") and "&id" not in text and "*id" not in text
    loaded = load_yaml_config(path)
    assert WidthPlan.from_dict(loaded["plan"], "isd") == WidthPlan.from_dict(plan, "isd")
    assert yaml.safe_load(text)["mode"] == "ISD"
    from sglang.srt.arg_groups.overrides import resolving_view

    base = ["--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "4096",
            "--selfspec-config", str(path)]
    sa = resolving_view(resolve_in_process(["--model-path", str(tiny_base_path), *base]))
    widest = registry.build_planned("isd", {}, loaded["plan"], registry.ModeResources(mask_token_id=0)).max_width
    assert sa.speculative_algorithm == "ISD" and int(sa.speculative_num_draft_tokens) == widest > 1
    from selfspec.models import resolve_model

    other = resolve_model("tiny-idlm")  # the same architecture, other weights
    assert model_fingerprint(other) != model_fingerprint(tiny_base_path)
    with pytest.raises(SelfSpecConfigError, match="plan measured on another model"):
        resolve_in_process(["--model-path", str(other), *base])
