"""The tuner's choice on synthetic cost tables (flat -> the widest that commits most, linear ->
width 1), its buckets, and the cost interpolation."""

from __future__ import annotations

import json

import pytest

from selfspec.decoding.width_plan import WidthPlan
from selfspec.tuning.acceptance import Candidate
from selfspec.tuning.choose import buckets, choose, servable
from selfspec.tuning.cost import CostTable, StepOverhead

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


def test_a_near_tie_goes_to_the_narrower():
    # stride 2 beats AR by 1% at batch 2 only: within the tolerance, batch 2 runs AR steps
    cands = [CANDIDATES[0], Candidate("isd", {"stride": 2}, 3, {"greedy": 1.0, "sampled": 1.0})]
    costs = CostTable([1, 2, 3], [1, 3], [[10.0, 11.0], [10.0, 9.9], [10.0, 11.0]])
    assert [c.best.mode for c in choose(costs, cands, "greedy", 3, tolerance=0.0, margin=0.0)] == ["ar", "isd", "ar"]
    assert [c.best.mode for c in choose(costs, cands, "greedy", 3, margin=0.0)] == ["ar", "ar", "ar"]
    # two speculative candidates 2% apart: the narrower wins whichever is ahead, and whatever
    # the batch before chose (the wide one, clearly ahead at batch 1)
    wide = Candidate("isd", {"stride": 4}, 7, {"greedy": 3.0})
    narrow = Candidate("isd", {"stride": 3}, 5, {"greedy": 2.0})
    costs = CostTable([1, 2, 3], [1, 5, 7], [[9.0, 10.0, 10.0], [9.0, 10.0, 15.3], [9.0, 10.0, 14.7]])
    picked = choose(costs, [CANDIDATES[0], narrow, wide], "greedy", 3, margin=0.0)
    assert [c.best.width for c in picked] == [7, 5, 5]
    assert [c.best.width for c in choose(costs, [CANDIDATES[0], narrow, wide], "greedy", 3, tolerance=0.0,
                                         margin=0.0)] == [7, 5, 7]
    # a ragged lookup padded to 17 that sends 7 real tokens a step, 1% ahead of a 12-token one
    # that sends 9: the near-tie goes to the fewer padded tokens (the ragged step pays for its
    # widest request in parts), the real tokens deciding only between equal paddings
    flat = CostTable([1, 4], [1, 16], [[10.0, 10.0], [10.0, 10.0]])
    capped = Candidate("ngram", {"num_draft": 12, "caps": True}, 13, {"greedy": 5.0}, {"greedy": 9.0}, True)
    adaptive = Candidate("ngram", {"num_draft": 16, "caps": True, "adaptive": True}, 17, {"greedy": 5.05},
                         {"greedy": 7.0}, True)
    assert adaptive.priced_width("greedy") < capped.priced_width("greedy")
    assert [c.best for c in choose(flat, [CANDIDATES[0], adaptive, capped], "greedy", 4)] == [capped] * 4
    same_pad = Candidate("ngram", {"num_draft": 12, "caps": True, "adaptive": True}, 13, {"greedy": 4.98},
                         {"greedy": 7.0}, True)
    assert [c.best for c in choose(flat, [CANDIDATES[0], adaptive, capped, same_pad], "greedy", 4)] == [same_pad] * 4


def test_speculation_must_beat_ar_by_the_margin():
    # stride 2 predicted 5% faster than AR at batch 1 and 20% at batch 2: only batch 2 speculates
    cands = [CANDIDATES[0], Candidate("isd", {"stride": 2}, 3, {"greedy": 1.0, "sampled": 1.0})]
    costs = CostTable([1, 2], [1, 3], [[10.5, 10.0], [12.0, 10.0]])
    assert [c.best.mode for c in choose(costs, cands, "greedy", 2, tolerance=0.0)] == ["ar", "isd"]
    assert [c.best.mode for c in choose(costs, cands, "greedy", 2, tolerance=0.0, margin=0.0)] == ["isd", "isd"]


def test_replan_chooses_again_from_a_saved_report_with_another_margin(tmp_path, capsys):
    """`selfspec tune --replan TUNE.json` plans from an earlier run's measurements without
    measuring: the same report planned with margin 0.15 and 0 gives AR steps where stride 2 is
    predicted 5% faster (batch 1) only under the margin, and states where it came from."""
    import yaml

    from selfspec.cli import main

    cands = [CANDIDATES[0], Candidate("isd", {"stride": 2}, 3, {"greedy": 1.0, "sampled": 1.0})]
    costs = CostTable([1, 2], [1, 3], [[10.5, 10.0], [12.0, 10.0]])
    free = StepOverhead.linear(0.0, 0.0).to_dict()
    report = {"schema": "selfspec.tune/v1", "model": "tiny-idlm", "host": "h", "threads": 1, "dtype": "float32",
              "temperature": 0.7, "costs": costs.to_dict(),
              "modes": {"isd": {"candidates": [c.to_dict() for c in cands],
                                "step_overhead": {"greedy": free, "sampled": free}}}}
    saved = tmp_path / "tune.json"
    saved.write_text(json.dumps(report))
    plans = {}
    for margin in ("0.15", "0"):
        out = tmp_path / f"plan-{margin}-{{mode}}.yaml"
        assert main(["tune", "--replan", str(saved), "--margin", margin, "--out", str(out),
                     "--json", str(tmp_path / "again.json")]) == 0
        path = tmp_path / f"plan-{margin}-isd.yaml"
        assert f"re-planned from {saved} with --margin {float(margin)}" in path.read_text()
        plans[margin] = yaml.safe_load(path.read_text())["plan"]["greedy"]
    assert [(b["max_batch"], b["mode"]) for b in plans["0.15"]] == [(1, "ar"), (None, "isd")]
    assert [(b["max_batch"], b["mode"]) for b in plans["0"]] == [(None, "isd")]
    assert json.loads((tmp_path / "again.json").read_text())["margin"] == 0.0
    assert "x AR steps)" in capsys.readouterr().out  # no stock AR timings: levels over the mode's AR steps
    # with the stock AR server's steps in the report (twice the mode's AR step), the replayed
    # levels are over stock AR, as the bench reads them
    report["stock_ar"] = {"step_overhead": {"greedy": StepOverhead({1: 10.0, 2: 10.0}).to_dict(),
                                            "sampled": StepOverhead({1: 10.0, 2: 10.0}).to_dict()}}
    saved.write_text(json.dumps(report))
    assert main(["tune", "--replan", str(saved), "--out", str(tmp_path / "s-{mode}.yaml"),
                 "--json", str(tmp_path / "again.json")]) == 0
    assert "x stock AR)" in capsys.readouterr().out
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["modes"]["isd"]["levels_ar"] == "stock" and "stock_ar" in again
    c1 = again["modes"]["isd"]["levels"]["greedy"]["1"]
    assert c1["ar_tok_s"] == pytest.approx(1e3 / 20.5)  # stock AR: 10.5 ms forward + 10 ms more
    assert main(["tune", "--replan", str(tmp_path / "missing.json")]) == 2
    assert "--replan" in capsys.readouterr().err


def test_greedy_only_candidates_never_serve_sampled_batches():
    jacobi = Candidate("jacobi", {"block_size": 8}, 8, {"greedy": 5.0, "sampled": float("nan")})
    plan = choose(table(lambda b, w: 10.0), [CANDIDATES[0], jacobi], "sampled", 4)
    assert {c.best.mode for c in plan} == {"ar"}


def test_every_modes_plan_may_run_lookup_steps_where_its_own_are_too_wide():
    """Lookup steps (the context candidate alone) are candidates of every tuned mode; on a
    roofline a JACOBI plan runs its blocks at batch 1, lookup steps at mid sizes, AR beyond; the
    written plan builds, its lookup bucket an `NgramMode` with the bucket's own options."""
    from selfspec.decoding import registry
    from selfspec.decoding.ngram import NgramMode
    from selfspec.tuning.acceptance import candidates_for

    for mode in ("isd", "risd", "sjd", "jacobi"):
        assert {c.label for c in candidates_for(mode) if c.mode == "ngram"} == {
            "lookup=4", "lookup=8", "lookup=12", "lookup=16", "lookup=8x2", "lookup=12x2", "lookup=12c", "lookup=16c",
            "lookup=8ca", "lookup=12ca", "lookup=16ca"}
    lookup = next(c for c in candidates_for("jacobi") if c.label == "lookup=4")
    cands = [CANDIDATES[0], Candidate("jacobi", {"block_size": 4, "context_tokens": 8}, 12, {"greedy": 3.2}),
             Candidate(lookup.mode, lookup.options, 5, {"greedy": 1.8})]
    plan = choose(table(lambda b, w: 5.0 * max(1.0, b * w / 16)), cands, "greedy", 32)
    assert [plan[b - 1].best.mode for b in (1, 4, 32)] == ["jacobi", "ngram", "ar"]
    written = [b.to_dict() for b in buckets(plan)]
    planned = registry.build_planned("jacobi", {}, {"greedy": written, "sampled": [{"max_batch": None, "mode": "ar"}]},
                                     registry.ModeResources(vocab_size=64))
    step = planned.greedy_modes[planned.plan.bucket(4, False)]
    assert isinstance(step, NgramMode) and step.config.num_draft == 4 and step.config.corpus
    from selfspec.tuning.command import _own_steps_note

    assert not _own_steps_note("jacobi", {"greedy": written})  # batch 1 runs JACOBI
    assert "no batch size runs JACOBI's own steps" in _own_steps_note("jacobi", {"greedy": written[1:]})[0]
    # a greedy-only mode's sampled batches run AR steps, lookup candidates or not
    assert [c.mode for c in servable(cands, "sampled", greedy_only=True)] == ["ar"]
    assert servable(cands, "greedy", greedy_only=True) == cands


def test_written_plans_spell_out_shared_option_lists(tmp_path):
    """Lookup buckets share their `match_sizes` list; the YAML writes it out at each bucket
    (no &id001 / *id001 aliases) and reads back as the same plan."""
    import argparse

    import yaml

    from selfspec.tuning.acceptance import candidates_for
    from selfspec.tuning.command import _yaml_text

    lookups = [c for c in candidates_for("sjd") if c.mode == "ngram"]
    plan = {"greedy": [{"max_batch": 2, **lookups[0].to_dict()["options"], "mode": "ngram"},
                       {"max_batch": None, "mode": "ngram", **lookups[1].options}],
            "sampled": [{"max_batch": None, "mode": "ar"}]}
    args = argparse.Namespace(model="m", modes="sjd", batch_sizes="1,2", temperature=0.7, threads=1, dtype="float32",
                              context=64, limit=2, prompts="p.jsonl", max_new_tokens=8, corpus_prompts=0)
    text = _yaml_text("sjd", plan, table(lambda b, w: 1.0), [], [], args)
    assert "&id" not in text and "*id" not in text
    assert WidthPlan.from_dict(yaml.safe_load(text)["plan"], "sjd") == WidthPlan.from_dict(plan, "sjd")


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
    from selfspec.decoding.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine
    from selfspec.tuning import acceptance

    engine = HFEngine.from_pretrained("tiny-idlm")
    prompts = [engine.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(description=")]
    samplings = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.7)}
    warm = acceptance.warm_corpus(engine, prompts, 48)
    assert warm.tokens == len(prompts[0]) + 48
    runs = {}
    for name, corpus in (("cold", None), ("warm", warm)):
        (cand,) = [c for c in acceptance.candidates_for("isd", [{"stride": 2, "context_tokens": 8}]) if c.mode == "isd"]
        acceptance.measure(engine, [cand], prompts, 48, samplings, corpus=corpus)
        runs[name] = cand.tokens_per_step
    assert runs["warm"]["greedy"] > runs["cold"]["greedy"] + 1.5, runs
    assert runs["warm"]["sampled"] == runs["cold"]["sampled"]
    assert warm.tokens == len(prompts[0]) + 48  # each run drew on a copy


def test_the_tuner_measures_real_query_tokens_of_unpadded_layouts():
    """`measure(ragged=True)` builds ISD's layouts unpadded (as the CPU worker does) and keeps the
    real query tokens per step: below the padded width when the context candidate is short."""
    from selfspec.decoding.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine
    from selfspec.tuning import acceptance

    engine = HFEngine.from_pretrained("tiny-idlm")
    prompts = [engine.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(description=")]
    (cand,) = [c for c in acceptance.candidates_for("isd", [{"stride": 3, "context_tokens": 16}]) if c.mode == "isd"]
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


def test_written_config_round_trips_into_the_server_config(tmp_path, tiny_base_path):
    """What `selfspec tune` writes is a serving config: the server resolves its plan, and its
    verify width is the widest bucket's."""
    import argparse

    import yaml
    from sglang_fixtures import resolve_in_process

    from selfspec.sglang_ext.config import load_yaml_config
    from selfspec.tuning.command import _yaml_text

    costs = table(lambda b, w: 5.0 * max(1.0, b * w / 16))
    plan = {kind: [b.to_dict() for b in buckets(choose(costs, CANDIDATES, kind, 32))] for kind in ("greedy", "sampled")}
    args = argparse.Namespace(model="tiny-base", modes="isd", batch_sizes="1,4,16,32", temperature=0.7, threads=1,
                              dtype="float32", context=192, limit=8, prompts="p.jsonl", max_new_tokens=64,
                              corpus_prompts=32)
    path = tmp_path / "tuned.yaml"
    path.write_text(_yaml_text("isd", plan, costs, CANDIDATES, ["a line"], args))
    assert path.read_text().startswith("# Width plan for ISD")
    loaded = load_yaml_config(path)
    assert WidthPlan.from_dict(loaded["plan"], "isd") == WidthPlan.from_dict(plan, "isd")
    assert yaml.safe_load(path.read_text())["mode"] == "ISD"
    from sglang.srt.arg_groups.overrides import resolving_view

    sa = resolving_view(resolve_in_process(["--model-path", str(tiny_base_path), "--device", "cpu", "--attention-backend",
                             "torch_native", "--max-total-tokens", "4096", "--selfspec-config", str(path)]))
    from selfspec.decoding import registry

    widest = registry.build_planned("isd", {}, loaded["plan"], registry.ModeResources(mask_token_id=0)).max_width
    assert widest > 1
    assert sa.speculative_algorithm == "ISD"
    assert int(sa.speculative_num_draft_tokens) == widest


def test_step_overhead_prices_wide_steps_by_their_query_tokens():
    from selfspec.tuning.cost import StepOverhead

    ov = StepOverhead(ar_ms={1: 2.0, 32: 5.0}, verify_ms={10: 1.0, 100: 10.0})
    assert ov.ms(1) == pytest.approx(2.0) and ov.ms(1, width=1) == pytest.approx(2.0)  # AR: no verify part
    assert ov.ms(1, width=10) == pytest.approx(3.0)
    assert ov.ms(10, width=10) == pytest.approx(2.0 + 3.0 * 9 / 31 + 10.0)  # 100 query tokens
    assert ov.ms(4, width=5) < ov.ms(4, width=25)  # more rows cost more at the same batch
    lin = StepOverhead.linear(1.5, 0.25)
    assert [lin.ms(b) for b in (1, 8, 64)] == pytest.approx([1.75, 3.5, 17.5]) and lin.ms(8, 16) == lin.ms(8)
    assert StepOverhead().ms(8, 16) == 0.0
    # a lookup step is priced by its own measured excess, where there is one
    look = StepOverhead(ar_ms={1: 2.0}, verify_ms={10: 5.0}, lookup_ms={10: 1.0})
    assert look.ms(1, 10, lookup=True) == pytest.approx(3.0) and look.ms(1, 10) == pytest.approx(7.0)
    assert ov.ms(1, 10, lookup=True) == ov.ms(1, 10)  # none measured: as any verify step


def test_lookup_steps_are_chosen_by_their_own_price():
    """RISD's own step carries its adapter; a lookup step of the same width does not. Priced by
    the mode's verify excess the lookup loses; by its own, it wins."""
    own = Candidate("risd", {"stride": 2, "context_tokens": 8}, 10, {"greedy": 4.2})
    lookup = Candidate("ngram", {"num_draft": 8}, 9, {"greedy": 4.0})
    costs = table(lambda b, w: 5.0 + 0.1 * b * w)
    same = StepOverhead(ar_ms={1: 2.0, 32: 2.0}, verify_ms={9: 5.0, 300: 20.0})
    own_price = StepOverhead(ar_ms=same.ar_ms, verify_ms=same.verify_ms, lookup_ms={9: 1.0, 300: 10.0})
    cands = [CANDIDATES[0], own, lookup]
    assert choose(costs, cands, "greedy", 1, same, margin=0.0)[0].best.mode == "risd"
    assert choose(costs, cands, "greedy", 1, own_price, margin=0.0)[0].best.mode == "ngram"


def test_a_ragged_forward_prices_the_real_query_tokens():
    """Where the served forward carries each request's real tokens only, a candidate whose weak
    matches draft short (`caps`) is priced by what it sends: at a batch where every query token
    costs, it beats the full-length lookup that commits a little more; priced by the padded
    width (a GPU's fixed-width forward) the two cost the same and the longer one wins."""
    costs = table(lambda b, w: 10.0 + 0.2 * b * w)

    def lookups(ragged: bool) -> list[Candidate]:
        full = Candidate("ngram", {"num_draft": 12}, 13, {"greedy": 5.5}, {"greedy": 12.5}, ragged)
        capped = Candidate("ngram", {"num_draft": 12, "caps": True}, 13, {"greedy": 5.3}, {"greedy": 8.5}, ragged)
        return [CANDIDATES[0], full, capped]

    assert lookups(True)[2].priced_width("greedy") == 8.5 and lookups(False)[2].priced_width("greedy") == 13.0
    assert lookups(True)[2].label == "lookup=12c"
    assert {c.best.label for c in choose(costs, lookups(True), "greedy", 16, tolerance=0.0)} == {"lookup=12c"}
    assert {c.best.label for c in choose(costs, lookups(False), "greedy", 16, tolerance=0.0)} == {"lookup=12"}


def test_calibration_plan_alternates_ar_and_the_candidate_by_batch():
    from selfspec.tuning.calibrate import calibration_batches, calibration_plan

    assert calibration_batches([1, 2, 4, 8, 16, 32]) == ([2, 8, 32], [1, 9, 33])
    assert calibration_batches([1, 2]) == ([2], [1])
    assert calibration_batches([1, 2, 3, 4]) == ([2, 3], [1, 4])  # AR at 4 would collide with verify at 4
    cand = CANDIDATES[2]
    plan = WidthPlan.from_dict(calibration_plan([2, 8, 32], [1, 9, 33], cand, None), "isd")
    assert plan.online is None  # the calibration follows the plan blindly
    for a in (2, 8, 32):
        assert plan.greedy[plan.bucket(a, False)].mode == "ar"
    for v in (1, 9, 33):
        verify = plan.greedy[plan.bucket(v, False)]
        assert (verify.mode, verify.options["stride"]) == ("isd", 4)
        assert plan.sampled[plan.bucket(v, True)].mode == "ar"  # no sampled candidate: AR everywhere


def test_fit_overhead_recovers_the_served_step_cost():
    from selfspec.tuning.calibrate import fit_overhead, middle_width

    costs = table(lambda b, w: 2.0 + b * w)
    true_ar = {1: 2.0, 8: 4.0, 32: 9.0}  # what a served step costs beyond the forward, every step
    width = 7
    ar = {b: costs.time_ms(b, 1) + x for b, x in true_ar.items()}
    verify_extra = {2: 1.0, 9: 3.0, 33: 12.0}  # beyond that, for a width-7 step
    from selfspec.tuning.cost import StepOverhead

    truth = StepOverhead(ar_ms=true_ar)
    verify = {b: costs.time_ms(b, width) + truth.ms(b) + x for b, x in verify_extra.items()}
    ov = fit_overhead(costs, ar, verify, width)
    assert ov.ar_ms == pytest.approx(true_ar)
    assert ov.verify_ms == pytest.approx({b * width: x for b, x in verify_extra.items()})
    for b, ms in verify.items():  # the fitted model reproduces every measured step
        assert costs.time_ms(b, width) + ov.ms(b, width) == pytest.approx(ms)
    assert ov.measured == {"ar": ar, "verify@7": verify}
    # a step measured faster than its forward is priced at the forward, never below
    assert fit_overhead(costs, {1: 0.5}, {}, 1).ms(1) == 0.0
    assert middle_width(CANDIDATES, "greedy").width == 7
    # a lookup step's excess, keyed by its query tokens like the verify candidate's
    look = {2: costs.time_ms(2, 9) + truth.ms(2) + 0.5, 9: costs.time_ms(9, 9) + truth.ms(9) + 2.0}
    ov = fit_overhead(costs, ar, verify, width, look, 9)
    assert ov.lookup_ms == pytest.approx({18: 0.5, 81: 2.0}) and ov.measured["lookup@9"] == look
    assert ov.verify_ms == pytest.approx({b * width: x for b, x in verify_extra.items()})
    assert middle_width([CANDIDATES[0], Candidate("jacobi", {}, 8, {"greedy": 2.0, "sampled": float("nan")})],
                        "sampled") is None
    # lookups timed at two widths: priced by batch and width, reproducing both, linear between
    short = {b: costs.time_ms(b, 3) + truth.ms(b) + x for b, x in ((1, 4.0), (8, 6.0))}
    ov = fit_overhead(costs, ar, verify, width, look, 9, short, 3)
    assert set(ov.lookup_by_width) == {9, 3}
    assert ov.lookup_by_width[9] == pytest.approx({2: 0.5, 9: 2.0})
    assert ov.lookup_by_width[3] == pytest.approx({1: 4.0, 8: 6.0})
    for steps, w in ((look, 9), (short, 3)):
        for b, ms in steps.items():
            assert costs.time_ms(b, w) + ov.ms(b, w, lookup=True) == pytest.approx(ms)
    at = lambda w: ov.ms(8, w, lookup=True) - truth.ms(8)  # noqa: E731
    assert at(6) == pytest.approx((at(3) + at(9)) / 2) and at(3) > at(9)  # short drafts dearer per token here
    assert ov.ms(9, width) == pytest.approx(truth.ms(9) + 3.0)  # verify steps priced as before
    assert StepOverhead.from_dict(json.loads(json.dumps(ov.to_dict()))) == ov
    # the mode's own steps timed at two widths (a narrow one at the AR batches): priced by batch
    # and width, reproducing both; a 3-token step at batch 1 costs its measured 0.5 ms more than
    # an AR step, where the 7-token step's excess keyed by query tokens extrapolates to 0.55
    narrow = {b: costs.time_ms(b, 3) + truth.ms(b) + x for b, x in ((1, 0.5), (8, 1.5), (32, 5.0))}
    ov = fit_overhead(costs, ar, verify, width, look, 9, short, 3, narrow, 3)
    assert ov.verify_by_width[3] == pytest.approx({1: 0.5, 8: 1.5, 32: 5.0})
    for steps, w in ((verify, width), (narrow, 3)):
        for b, ms in steps.items():
            assert costs.time_ms(b, w) + ov.ms(b, w) == pytest.approx(ms)
    assert ov.ms(1, 3) - truth.ms(1) == pytest.approx(0.5) and ov.measured["verify@3"] == narrow
    assert fit_overhead(costs, ar, verify, width).ms(1, 3) - truth.ms(1) == pytest.approx(1.0 - 11 * 2.0 / 49)
    assert StepOverhead.from_dict(json.loads(json.dumps(ov.to_dict()))) == ov


@pytest.mark.server
def test_served_calibration_times_ar_and_verify_steps(tmp_path, tiny_base_path, monkeypatch):
    """Servers of a greedy-only mode: AR steps timed at batch 1 and 2 under an AR-only plan, the
    median candidate's verify steps at batch 1 and the narrowest's at 2 under the calibration
    plan (its sampled batches are never sent: the mode refuses them), and the fitted overhead
    prices a wide step above an AR step; then the stock AR server's steps."""
    from selfspec.tuning import calibrate

    monkeypatch.setattr(calibrate, "LONG", 64)  # fewer tokens: the test times, it does not tune
    costs = table(lambda b, w: 1.0)
    lookups = [Candidate("ngram", {"num_draft": k, "corpus": True}, k + 1, {"greedy": 2.0, "sampled": 1.5})
               for k in (4, 8, 12)]
    cands = [Candidate("ar", {}, 1, {"greedy": 1.0, "sampled": 1.0}),
             Candidate("jacobi", {"block_size": 2, "context_tokens": 0}, 3, {"greedy": 1.3, "sampled": float("nan")}),
             Candidate("jacobi", {"block_size": 4, "context_tokens": 0}, 5, {"greedy": 1.5, "sampled": float("nan")}),
             Candidate("jacobi", {"block_size": 8, "context_tokens": 0}, 9, {"greedy": 1.6, "sampled": float("nan")}),
             *lookups]
    assert calibrate.lookup_candidate(cands, "greedy") is lookups[1]
    capped = [Candidate("ngram", {"num_draft": k, "caps": True}, k + 1, {"greedy": 2.0}) for k in (12, 16)]
    assert calibrate.lookup_candidate(cands + capped, "greedy") is lookups[1]  # capped steps are not timed
    out = calibrate.server_overhead(str(tiny_base_path), "jacobi", costs, cands, list(range(100, 140)), [1, 2],
                                    temperature=0.7, log_dir=str(tmp_path))
    greedy, sampled = out["greedy"], out["sampled"]
    assert set(greedy.measured) == {"ar", "verify@5", "verify@3", "lookup@9", "lookup@5"}
    assert set(greedy.measured["ar"]) == {1, 2} and set(greedy.measured["verify@5"]) == {1}
    # the narrowest own candidate (block 2) at batch 2: the mode's steps priced by two widths
    assert set(greedy.measured["verify@3"]) == {2} and set(greedy.verify_by_width) == {5, 3}
    # the lookup step, timed at batch 1 on a server of its own, prices lookups alone; the short
    # lookup (4 tokens) timed at batch 2 on the same server gives its second width
    assert set(greedy.measured["lookup@9"]) == {1} and set(greedy.lookup_ms) == {9}
    assert set(greedy.measured["lookup@5"]) == {2} and set(greedy.lookup_by_width) == {9, 5}
    # batch 1's AR step is measured, not extrapolated from batch 2
    assert greedy.ms(1) == pytest.approx(max(greedy.measured["ar"][1] - costs.time_ms(1, 1), 0.0))
    assert all(ms > 1.0 for steps in greedy.measured.values() for ms in steps.values())
    assert greedy.ms(2) == pytest.approx(greedy.measured["ar"][2] - costs.time_ms(2, 1))
    # the fitted model gives back the measured verify step (never below the AR step's price)
    verify_model = costs.time_ms(1, 5) + greedy.ms(1, width=5)
    assert verify_model == pytest.approx(max(greedy.measured["verify@5"][1], costs.time_ms(1, 5) + greedy.ms(1)))
    assert sampled.ar_ms == greedy.ar_ms and not sampled.verify_ms  # greedy-only: sampled batches run AR
    # a request's own cost (a prefill of 40 tokens, HTTP): measured, less than the short run
    assert 1.0 < greedy.request_ms < calibrate.SHORT * greedy.measured["ar"][1]
    assert sampled.request_ms == greedy.request_ms
    assert StepOverhead.from_dict(json.loads(json.dumps(greedy.to_dict()))) == greedy
    plan = (tmp_path / "calibration.yaml").read_text()
    assert "online: false" in plan and "block_size: 4" in plan and "block_size: 2" in plan
    ar_plan = (tmp_path / "calibration-ar.yaml").read_text()
    assert "online: false" in ar_plan and "jacobi" not in ar_plan.split("plan:")[1] and "ngram" not in ar_plan
    lookup_plan = (tmp_path / "calibration-lookup.yaml").read_text()
    assert "ngram" in lookup_plan.split("sampled:")[0] and "ngram" not in lookup_plan.split("sampled:")[1]
    assert "num_draft: 4" in lookup_plan and "num_draft: 8" in lookup_plan
    # the stock AR server (no speculative algorithm), what the bench's AR row runs: its steps
    # timed at batch 1 and 2 for both kinds, priced as AR steps
    stock = calibrate.stock_ar_overhead(str(tiny_base_path), costs, list(range(100, 140)), [1, 2], 0.7,
                                        log_dir=str(tmp_path))
    assert set(stock) == {"greedy", "sampled"}
    for ov in stock.values():
        assert set(ov.measured["ar"]) == {1, 2} and all(ms > 1.0 for ms in ov.measured["ar"].values())
        assert ov.ms(2) == pytest.approx(ov.measured["ar"][2] - costs.time_ms(2, 1)) and ov.request_ms > 1.0


def test_stock_ar_of_an_adapter_is_its_base():
    """The tune's stock AR server serves what the bench's AR row serves: for the RISD adapter
    its base (served by the adapter's name, it would run RISD: a first RISD tune timed those
    steps as stock AR's, 10 ms at batch 1, and predicted AR steps 1.8x 'stock AR')."""
    from selfspec.models import resolve_model
    from selfspec.tuning.calibrate import stock_ar_model

    assert stock_ar_model("tiny-idlm-lora") == str(resolve_model("tiny-base"))
    assert stock_ar_model("tiny-idlm") == str(resolve_model("tiny-idlm"))


def test_the_demo_says_what_the_plan_runs_at_its_batch_sizes(tmp_path):
    """`make demo` names the step the ISD plan runs for one request and for its burst: a tuned
    plan may serve a batch size with lookup or AR steps rather than ISD's own."""
    from pathlib import Path

    from selfspec.demo import plan_step

    cfg = tmp_path / "plan.yaml"
    cfg.write_text("mode: ISD\nplan:\n  greedy:\n  - {max_batch: 1, mode: isd, stride: 3}\n"
                   "  - {max_batch: 4, mode: ngram, num_draft: 12, caps: true}\n  - {max_batch: null, mode: ar}\n"
                   "  sampled: [{max_batch: null, mode: ar}]\n")
    assert plan_step(cfg, 1) == "ISD steps (stride=3)"
    assert plan_step(cfg, 3) == "lookup steps (num_draft=12, caps=True)"
    assert plan_step(cfg, 8) == "plain AR steps"
    assert plan_step(Path("serving_configs/isd-n4.yaml"), 1) == "ISD steps (no width plan)"


def test_a_level_replay_thins_the_batch_as_requests_finish():
    """`level.replay_level`: a request copying a loop (10 tokens a step) finishes in 10 steps and
    leaves its partner (1 a step) to run 90 more at batch 1: 200 tokens in 100 steps, where the
    steady batch of both (their pooled tokens per step) predicts 1.8x as much. Equal requests
    replay to the steady prediction; each step runs the pick for its batch."""
    from selfspec.tuning.level import replay_level

    flat = table(lambda b, w: 10.0)
    lookup = Candidate("ngram", {"num_draft": 12}, 13, {"greedy": 200 / 110}, {"greedy": 13.0},
                       per_request={"greedy": [[100, 10, 130], [100, 100, 1300]]})
    level = replay_level(flat, lambda b: lookup, "greedy", concurrency=2, requests=2, tokens=100)
    assert level.steps == 100 and level.tok_s == pytest.approx(200.0)
    from selfspec.tuning.choose import throughput

    assert throughput(flat, lookup, "greedy", 2) == pytest.approx(1.82 * level.tok_s, rel=0.01)
    even = Candidate("ngram", {"num_draft": 4}, 5, {"greedy": 2.0}, per_request={"greedy": [[100, 50, 250]]})
    assert replay_level(flat, lambda b: even, "greedy", 2, 4, 100).tok_s == pytest.approx(
        throughput(flat, even, "greedy", 2))
    ar = CANDIDATES[0]
    tail_ar = replay_level(flat, lambda b: lookup if b > 1 else ar, "greedy", 2, 2, 100)
    assert tail_ar.steps == 10 + 90 * 1 and tail_ar.tok_s == pytest.approx(200.0)  # 1 token a step either way
    # ragged candidates are priced by the mean query tokens of the requests in flight
    ragged = Candidate("ngram", {"num_draft": 12}, 13, {"greedy": 1.0}, {"greedy": 3.0}, True,
                       {"greedy": [[100, 100, 300]]})
    linear = table(lambda b, w: float(b * w))
    assert replay_level(linear, lambda b: ragged, "greedy", 4, 4, 100).tok_s == pytest.approx(1e3 * 4 / 12)
    # each request's prefill and handling is paid once, at every concurrency: 4 requests of
    # 10 ms on top of 100 steps of 12 ms
    per_request = StepOverhead(request_ms=10.0)
    assert replay_level(linear, lambda b: ragged, "greedy", 4, 4, 100, per_request).tok_s == pytest.approx(
        1e3 * 400 / (100 * 12 + 4 * 10))
    with pytest.raises(ValueError, match="concurrency"):
        replay_level(flat, lambda b: ar, "greedy", 0, 1, 1)


def test_shared_steps_pool_across_the_modes_of_a_model():
    """`calibrate.pool_shared_steps`: the AR and lookup steps every worker of one model runs alike
    are priced from the median of the modes' servers (one slow point on SJD's server decided its
    batch-1 plan); each mode keeps its own steps, an adapter mode is pooled only with its kind,
    refitting reproduces an unpooled fit, and pooling twice changes nothing."""
    from selfspec.tuning.calibrate import fit_overhead, pool_shared_steps, refit

    costs = table(lambda b, w: 2.0 + b * w)
    ar_at = {"isd": 5.7, "jacobi": 5.4, "sjd": 5.6, "risd": 7.0}
    lookup_at = {"isd": 8.0, "jacobi": 7.7, "sjd": 9.3, "risd": 12.0}
    own = {"isd": 8.1, "jacobi": 10.4, "sjd": 8.5, "risd": 11.0}
    overheads = {}
    for m in ar_at:
        ar = {1: costs.time_ms(1, 1) + ar_at[m], 8: costs.time_ms(8, 1) + 3.0}
        verify = {1: costs.time_ms(1, 7) + own[m], 9: costs.time_ms(9, 7) + 9.0}
        look = {1: costs.time_ms(1, 13) + lookup_at[m], 9: costs.time_ms(9, 13) + 8.0}
        short = {8: costs.time_ms(8, 5) + 4.0}
        narrow = {8: costs.time_ms(8, 3) + 3.5}
        ov = fit_overhead(costs, ar, verify, 7, look, 13, short, 5, narrow, 3)
        ov.request_ms = {"isd": 20.0, "jacobi": 24.0, "sjd": 30.0, "risd": 40.0}[m]
        assert refit(costs, ov.measured, ov.request_ms) == ov
        overheads[m] = {"greedy": ov}
    overheads["jacobi"]["sampled"] = StepOverhead(ar_ms=dict(overheads["jacobi"]["greedy"].ar_ms))  # greedy-only
    pooled = pool_shared_steps(costs, overheads, lambda m: m == "risd")
    plain = [pooled[m]["greedy"] for m in ("isd", "jacobi", "sjd")]
    for ov in plain:
        assert ov.ms(1, 13, lookup=True) == pytest.approx(plain[0].ms(1, 13, lookup=True))
        assert ov.measured["lookup@13"][1] == pytest.approx(costs.time_ms(1, 13) + 8.0)  # the median of 8.0, 7.7, 9.3
        assert ov.measured["ar"][1] == pytest.approx(costs.time_ms(1, 1) + 5.6) and ov.request_ms == 24.0
    for m, ov in zip(("isd", "jacobi", "sjd"), plain):
        assert ov.measured["verify@7"] == overheads[m]["greedy"].measured["verify@7"]  # its own steps stay its own
    assert pooled["risd"] == overheads["risd"]  # an adapter mode's steps carry its adapter: not pooled with these
    assert pooled["jacobi"]["sampled"] is overheads["jacobi"]["sampled"]
    assert pool_shared_steps(costs, pooled, lambda m: m == "risd") == pooled


def test_the_widest_bucket_is_settled_by_its_replayed_level():
    """`level.settle_widest`: steady, a long adaptive draft (a request copying a loop takes 16
    steps of 9 query tokens, one writing new text 62 of 5) beats a short uniform one (32 and 58
    steps of 5) at batch 32 by more than the tolerance; but a level of 32 requests at 32 lasts as
    long as its slowest requests, which the long draft does not speed up, and the short draft's
    cheaper steps put its replayed level ahead: the widest bucket takes it."""
    from selfspec.tuning.choose import throughput
    from selfspec.tuning.level import replay_level, settle_widest

    costs = table(lambda b, w: 4.0 + 0.05 * b * w)
    long_ = Candidate("ngram", {"num_draft": 8, "adaptive": True}, 9, {"greedy": 256 / 78}, {"greedy": 454 / 78}, True,
                      {"greedy": [[128, 16, 144], [128, 62, 310]]})
    short = Candidate("ngram", {"num_draft": 4}, 5, {"greedy": 256 / 90}, {"greedy": 5.0},
                      per_request={"greedy": [[128, 32, 160], [128, 58, 290]]})
    cands = [CANDIDATES[0], long_, short]
    steady = choose(costs, cands, "greedy", 32)
    assert steady[-1].best is long_
    assert throughput(costs, long_, "greedy", 32) > 1.035 * throughput(costs, short, "greedy", 32)
    level = lambda c: replay_level(costs, lambda b: c, "greedy", 32, 32, 128).tok_s  # noqa: E731
    assert level(short) > 1.02 * level(long_)
    settled = settle_widest(costs, steady, cands, "greedy", 32, 128)
    widest = [ch.batch for ch in steady if ch.best is long_]
    assert widest and widest[-1] == 32
    assert all(settled[b - 1].best is short for b in widest)
    assert all(s.best is t.best for s, t in zip(steady, settled) if s.batch < widest[0])  # the rest as chosen
    # where the long draft speeds up the slowest requests too, its level wins and it stays
    faster = Candidate("ngram", {"num_draft": 8, "adaptive": True}, 9, {"greedy": 256 / 56}, {"greedy": 344 / 56}, True,
                       {"greedy": [[128, 16, 144], [128, 40, 200]]})
    cands = [CANDIDATES[0], faster, short]
    steady = choose(costs, cands, "greedy", 32)
    assert steady[-1].best is faster
    assert [c.best for c in settle_widest(costs, steady, cands, "greedy", 32, 128)] == [c.best for c in steady]


def test_replan_pools_shared_steps_and_keeps_each_modes_own(tmp_path):
    """`selfspec tune --replan` of a two-mode report: the written report prices both modes' lookup
    steps from the median of their servers and keeps what each server measured
    (`step_overhead_unpooled`), from which a replan of the replan plans the same."""
    from selfspec.cli import main
    from selfspec.tuning.calibrate import fit_overhead

    costs = table(lambda b, w: 2.0 + b * w)
    lookup = Candidate("ngram", {"num_draft": 12}, 13, {"greedy": 4.0, "sampled": 1.5})
    modes = {}
    for mode, slow in (("isd", 0.5), ("sjd", 2.5), ("jacobi", 1.0)):
        ar = {1: costs.time_ms(1, 1) + 2.0, 8: costs.time_ms(8, 1) + 3.0}
        look = {1: costs.time_ms(1, 13) + slow, 9: costs.time_ms(9, 13) + 4.0}
        ov = fit_overhead(costs, ar, {}, 1, look, 13).to_dict()
        modes[mode] = {"candidates": [c.to_dict() for c in (CANDIDATES[0], lookup)],
                       "step_overhead": {"greedy": ov, "sampled": ov}}
    report = {"schema": "selfspec.tune/v1", "model": "tiny-idlm", "host": "h", "threads": 1, "dtype": "float32",
              "temperature": 0.7, "costs": costs.to_dict(), "modes": modes}
    (tmp_path / "tune.json").write_text(json.dumps(report))
    for src, dst in (("tune.json", "again.json"), ("again.json", "thrice.json")):
        assert main(["tune", "--replan", str(tmp_path / src), "--out", str(tmp_path / "p-{mode}.yaml"),
                     "--json", str(tmp_path / dst)]) == 0
    again, thrice = (json.loads((tmp_path / f).read_text())["modes"] for f in ("again.json", "thrice.json"))
    for mode in modes:
        pooled = StepOverhead.from_dict(again[mode]["step_overhead"]["greedy"])
        assert pooled.measured["lookup@13"][1] == pytest.approx(costs.time_ms(1, 13) + 1.0)  # median of 0.5, 2.5, 1.0
        kept = {k: StepOverhead.from_dict(v) for k, v in again[mode]["step_overhead_unpooled"].items()}
        assert kept == {k: StepOverhead.from_dict(v) for k, v in modes[mode]["step_overhead"].items()}
        assert thrice[mode]["step_overhead"] == again[mode]["step_overhead"]
        assert thrice[mode]["plan"] == again[mode]["plan"]
