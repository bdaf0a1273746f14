"""Width plans (`selfspec/decoding/widths/width_plan.py`): the step's mode configuration follows the
batch size, and decoding stays lossless when it changes between steps (greedy exact vs AR,
sampled output distributed as AR sampling), on the HF engine. Sequences finish at different
steps (a frequent stop token), so the batch shrinks across bucket boundaries mid-generation."""

from __future__ import annotations

from collections import Counter

import pytest

from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.widths.width_plan import WidthPlan
from selfspec.engines.hf import HFEngine
from model_helpers import (
    add_mask_token, chi_square_pvalue, compare_greedy, exact_distribution, random_prompts, tiny_qwen3,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 128
MAX_NEW = 24


@pytest.fixture(scope="module")
def setup():
    model = tiny_qwen3(VOCAB, seed=11).eval()
    mask_id = add_mask_token(model)
    prompts = random_prompts(24, VOCAB, 1, 16, seed=5)
    engine = HFEngine(model, mask_token_id=mask_id)
    plain = engine.generate(prompts, MAX_NEW, stop_token_ids=[], batch_size=24)
    # the most frequent generated token stops sequences at different steps
    stop = Counter(t for o in plain for t in o.token_ids).most_common(1)[0][0]
    reference = engine.generate(prompts, MAX_NEW, stop_token_ids=[stop], batch_size=24)
    return engine, model, prompts, stop, reference


PLANS = {
    "isd": [{"max_batch": 8, "stride": 3, "context_tokens": 4}, {"max_batch": 14, "mode": "ar"},
            {"max_batch": 18, "stride": 1, "context_tokens": 4}, {"max_batch": None, "stride": 2}],
    # lookup buckets (mode: ngram) in the other modes' plans: the context candidate alone
    "sjd": [{"max_batch": 8, "window": 4, "context_tokens": 3},
            {"max_batch": 14, "mode": "ngram", "num_draft": 4, "match_sizes": [2, 1], "corpus": True},
            {"max_batch": None, "window": 1}],
    "jacobi": [{"max_batch": 12, "block_size": 4, "context_tokens": 3},
               {"max_batch": 18, "mode": "ngram", "num_draft": 3, "match_sizes": [1], "corpus": True},
               {"max_batch": None, "mode": "ar"}],
}


@pytest.mark.parametrize("mode", sorted(PLANS))
def test_greedy_exact_when_the_width_changes_between_steps(setup, buckets_used, mode):
    engine, model, prompts, stop, reference = setup
    outs = engine.generate(prompts, MAX_NEW, stop_token_ids=[stop], mode=mode, plan=PLANS[mode], batch_size=24)
    cmp = compare_greedy(model, prompts, [o.token_ids for o in outs], [o.token_ids for o in reference])
    assert not cmp.failures and cmp.excused == 0, "\n".join(cmp.failures)
    used = {id(m) for _, m in buckets_used}
    assert len(used) == len(PLANS[mode]), f"not every bucket ran: {[(b, type(m).__name__) for b, m in buckets_used]}"


def test_each_step_runs_its_batch_sizes_bucket(setup, buckets_used):
    engine, _, prompts, stop, _ = setup
    mode = engine.build_mode("isd", None, PLANS["isd"])
    engine.generate(prompts, MAX_NEW, stop_token_ids=[stop], mode=mode, batch_size=24)
    for size, used in buckets_used:
        assert used is mode.greedy_modes[mode.plan.bucket(size, False)], size


def test_sampling_keeps_the_ar_distribution_across_switches(buckets_used):
    model = tiny_qwen3(8, hidden_size=32, seed=4, initializer_range=0.3).eval()
    mask_id = add_mask_token(model)
    engine = HFEngine(model, mask_token_id=mask_id)
    prompt, steps, sampling, n, stop = [1, 2, 3], 3, SamplingParams(1.0), 20_000, 5
    plan = {"greedy": [{"max_batch": None, "mode": "ar"}],
            "sampled": [{"max_batch": 19_000, "mode": "ar"},
                        {"max_batch": 19_400, "mode": "ngram", "num_draft": 2, "match_sizes": [1]},
                        {"max_batch": None, "stride": 3, "context_tokens": 2, "context_match_sizes": [1]}]}
    outs = engine.generate([prompt] * n, steps + 1, sampling, seed=list(range(n)), stop_token_ids=[stop],
                           mode="isd", plan=plan, batch_size=n)
    # the exact law of the first `steps` tokens, cut after the stop token
    exact: Counter = Counter()
    for seq, p in exact_distribution(model, prompt, steps, sampling).items():
        cut = seq[: seq.index(stop) + 1] if stop in seq else seq
        exact[cut] += p
    counts = Counter(tuple(o.token_ids[:steps]) for o in outs)
    stat, pvalue, dof = chi_square_pvalue(counts, dict(exact))
    assert pvalue > 0.01, (stat, dof)
    assert len({id(m) for _, m in buckets_used}) == 3, [b for b, _ in buckets_used]


@pytest.mark.parametrize("plan, problem", [
    ([{"max_batch": 4, "stride": 3}, {"max_batch": 2, "mode": "ar"}], "integer above 4"),
    ([{"max_batch": None, "stride": 3}, {"max_batch": 8, "mode": "ar"}], "only the last bucket"),
    ([{"max_batch": 4, "mode": "sjd"}], "runs isd, ar, ngram"),
    ([{"max_batch": 4, "mode": "ar", "stride": 2}], "takes no options"),
    ({"greedy": [], "sampled": None}, "non-empty list"),
    ({"fast": [{"max_batch": 1}]}, "greedy"),
])
def test_bad_plans_are_named(plan, problem):
    with pytest.raises(ValueError, match=problem):
        WidthPlan.from_dict(plan, "isd")


def test_plan_round_trips_and_bad_bucket_options_fail_at_build(setup):
    plan = WidthPlan.from_dict(PLANS["isd"], "isd")
    assert WidthPlan.from_dict(plan.to_dict(), "isd") == plan
    engine = setup[0]
    with pytest.raises(ValueError, match="stride"):
        engine.build_mode("isd", None, [{"max_batch": None, "stride": 1}])
    with pytest.raises(ValueError, match="unknown ngram option"):  # a lookup bucket takes its own options
        engine.build_mode("jacobi", None, [{"max_batch": None, "mode": "ngram", "block_size": 2}])


def _run_check(check, key, rate, steps):
    arms = []
    for _ in range(steps):
        arm = check.arm(key)
        arms.append(arm)
        check.observe(key, arm, rate[arm] * 0.01, 0.01)  # 10 ms steps
    return arms


def test_online_check_runs_the_faster_arm_and_follows_a_change():
    from selfspec.decoding.widths.online_check import OnlineCheck
    from selfspec.decoding.widths.width_plan import OnlineCheckConfig

    check = OnlineCheck(OnlineCheckConfig(probe_every=20, probe_steps=3, decay=0.5))
    key = (True, 4)
    arms = _run_check(check, key, {"plan": 100.0, "ar": 180.0}, 300)
    assert arms[:6] == ["plan"] * 6 and "ar" in arms[6:9]  # the plan first, then an early AR probe
    assert arms[100:].count("ar") > 0.85 * 200  # AR measured faster: AR, with plan probes
    assert 0 < arms[100:].count("plan") < 0.15 * 200
    arms = _run_check(check, key, {"plan": 150.0, "ar": 100.0}, 300)  # the load changed
    assert arms[100:].count("plan") > 0.85 * 200
    assert check.switches == 2
    assert check.summary()["sampled-4"]["runs"] == "plan"
    other = _run_check(check, (True, 6), {"plan": 101.0, "ar": 100.0}, 100)  # within the margin: the plan
    assert other[50:].count("plan") > 0.8 * 50  # (probes of AR aside)


def _drive(mode, seqs, rates: dict[str, tuple[int, float]], steps: int = 120) -> list[str]:
    """The arm names a planned mode chooses when each arm's step emits and takes `rates[name]`."""
    from selfspec.decoding.step import StepOutcome

    chosen = []
    for _ in range(steps):
        m = mode.choose(seqs)
        chosen.append(m.name)
        emitted, seconds = rates[m.name]
        mode.observe([StepOutcome([0] * emitted, list(range(emitted)))] * len(seqs), seconds)
    return chosen


def test_planned_mode_falls_back_to_ar_steps_where_they_are_measured_faster(setup):
    from selfspec.decoding.step import DecodeSequence

    engine = setup[0]
    mode = engine.build_mode("isd", None, [{"max_batch": None, "stride": 3}])
    greedy = [DecodeSequence([1, 2, 3]) for _ in range(4)]
    # ISD: 2 tokens per request in 30 ms; AR: 1 token in 10 ms
    chosen = _drive(mode, greedy, {"isd": (2, 0.03), "ar": (1, 0.01)})
    assert chosen[0] == "isd" and chosen[-40:].count("ar") > 30
    # sampled batches follow the plan alone: a timing-chosen arm would make a seeded request's
    # output depend on the machine's load
    sampled = [DecodeSequence([1, 2, 3], SamplingParams(temperature=0.7)) for _ in range(4)]
    assert set(_drive(mode, sampled, {"isd": (2, 0.03), "ar": (1, 0.01)})) == {"isd"}
    assert WidthPlan.from_dict({"greedy": PLANS["isd"], "online": False}, "isd").online is None
    off = engine.build_mode("isd", None, {"greedy": PLANS["isd"], "online": False})
    assert off.check is None
    with pytest.raises(ValueError, match="unknown key"):
        WidthPlan.from_dict({"greedy": PLANS["isd"], "online": {"every": 3}}, "isd")


def test_the_check_serves_the_candidate_alone_where_the_modes_own_proposals_do_not_pay(setup):
    """A bucket running the mode's own step with a context candidate has a third arm, that
    candidate alone (a lookup step): measured faster, it serves; measured slower, the plan does."""
    from selfspec.decoding.modes.ngram import NgramMode
    from selfspec.decoding.step import DecodeSequence

    engine = setup[0]
    greedy = [DecodeSequence([1, 2, 3]) for _ in range(2)]
    mode = engine.build_mode("isd", None, [{"max_batch": None, "stride": 2, "context_tokens": 8}])
    (lookup,) = mode.lookup_modes.values()
    assert isinstance(lookup, NgramMode) and lookup.config.num_draft == 8
    chosen = _drive(mode, greedy, {"isd": (3, 0.03), "ngram": (3, 0.02), "ar": (1, 0.01)}, 300)
    assert {"isd", "ngram", "ar"} <= set(chosen[:40]) and chosen[-100:].count("ngram") > 80
    mode = engine.build_mode("isd", None, [{"max_batch": None, "stride": 2, "context_tokens": 8}])
    chosen = _drive(mode, greedy, {"isd": (3, 0.02), "ngram": (3, 0.03), "ar": (1, 0.01)}, 300)
    assert chosen[-100:].count("isd") > 80
    assert not engine.build_mode("isd", None, [{"max_batch": None, "stride": 2}]).lookup_modes  # no candidate


@pytest.mark.parametrize("decay, keeps_plan", [(None, True), (0.8, False)])
def test_online_check_keeps_a_faster_plan_whose_rate_swings(decay, keeps_plan):
    """A speculative mode's steps swing between long candidate runs and 1-token steps (greedy
    ISD on looping text: a 17-token run in one step of five, else 1 token, 10 ms a step: 4.2x
    AR's 1 token per 6.5 ms on average). The default memory keeps it on the plan; a ~5-step
    memory (decay 0.8, the old default) read runs of 1-token steps as slower than AR and spent
    a large share of the steps on AR, as a served greedy batch-1 ISD server did."""
    import random

    from selfspec.decoding.widths.online_check import OnlineCheck
    from selfspec.decoding.widths.width_plan import OnlineCheckConfig

    rng = random.Random(0)
    check = OnlineCheck(OnlineCheckConfig() if decay is None else OnlineCheckConfig(decay=decay))
    key, arms = (False, 0), []
    for _ in range(2000):
        arm = check.arm(key)
        arms.append(arm)
        if arm == "plan":
            check.observe(key, arm, 17 if rng.random() < 0.2 else 1, 0.010)
        else:
            check.observe(key, arm, 1, 0.0065)
    share = arms[200:].count("plan") / 1800
    assert (share > 0.75) == keeps_plan, share  # 0.87-0.89 vs 0.42-0.57 over seeds 0-4


def test_online_check_probes_less_the_further_the_running_arm_leads():
    from selfspec.decoding.widths.online_check import OnlineCheck
    from selfspec.decoding.widths.width_plan import OnlineCheckConfig

    def probe_share(plan_rate: float) -> float:
        check = OnlineCheck(OnlineCheckConfig())
        arms = _run_check(check, (False, 0), {"plan": plan_rate, "ar": 100.0}, 3000)
        return arms[500:].count("ar") / 2500

    near, far = probe_share(110.0), probe_share(400.0)
    assert 0.08 < near < 0.13  # 6 probe steps per 48 + 6
    assert 0.02 < far < 0.04  # 6 per 4 x 48 + 6


@pytest.mark.parametrize("text, watch_tokens, probes_plan", [
    ("loop", 3, True),  # the candidate copies the loop: three tokens come true, the plan is probed
    ("fresh", 3, False),  # text that does not repeat: no candidate, AR steps go on
    ("loop", 0, False),  # the watch off: only the scheduled probes
])
def test_ar_steps_probe_the_plan_when_its_context_candidate_comes_true(text, watch_tokens, probes_plan):
    """Where the online check runs AR steps, a repetitive stretch (which a context candidate
    would copy, many tokens a step) is noticed from the tokens AR emits: served JACOBI at C=4
    otherwise ran AR through loops (TPF 2.5 against 3.6 with the check off)."""
    from selfspec.decoding import registry
    from selfspec.decoding.registry import ModeResources
    from selfspec.decoding.step import DecodeSequence, StepOutcome

    plan = {"greedy": [{"max_batch": None, "block_size": 2, "context_tokens": 8}],
            "online": {"watch_tokens": watch_tokens}}
    mode = registry.build_planned("jacobi", {}, plan, ModeResources(vocab_size=VOCAB))
    loop = [5, 6, 7, 8, 9]
    seq = DecodeSequence([1, 2, 3] + loop * 2)

    def step(emit: int | None) -> str:
        m = mode.choose([seq])
        if m.name == "ar":  # AR: 1 token in 10 ms; the plan: 1 token in 30 ms (no candidate so far)
            if emit is not None:
                seq.history.append(emit)
            mode.observe([StepOutcome([0], [0])], 0.01)
        else:
            mode.observe([StepOutcome([0], [0])], 0.03)
        return m.name

    for _ in range(60):  # the check learns that AR steps are faster here
        step(None)
    assert mode.check.summary()["greedy-0"]["runs"] == "ar"
    arms, fresh = [], iter(range(20, 120))
    for i in range(6):
        arms.append(step(loop[i % 5] if text == "loop" else next(fresh)))
    assert ("jacobi" in arms) == probes_plan, arms
    assert (mode.check.watch_probes > 0) == probes_plan
    if probes_plan:
        assert arms[:3] == ["ar"] * 3 and arms[3] == "jacobi"  # right after the third copied token


def test_a_planned_modes_per_sequence_state_goes_with_the_sequence(setup):
    """The planned mode keeps its bucket owner and candidate watch per sequence by identity and
    holds no sequence alive: a finished sequence's plan state goes with it."""
    import gc
    import weakref

    from selfspec.decoding.step import DecodeSequence

    mode = setup[0].build_mode("isd", None, [{"max_batch": None, "stride": 3, "context_tokens": 4}])
    seqs = [DecodeSequence([1, 2, 3]), DecodeSequence([1, 2, 3])]  # equal contents, distinct sequences
    mode.layouts(seqs)
    plans = [mode.plan_of(s) for s in seqs]
    assert plans[0] is not plans[1] and all(p.owner is mode.current for p in plans)
    mode.start(seqs[0])
    assert seqs[0].state is None and plans[0].owner is None and plans[1].owner is mode.current
    gone = weakref.ref(seqs[0])
    del seqs[0]
    gc.collect()
    assert gone() is None and len(mode._plans) == 1
