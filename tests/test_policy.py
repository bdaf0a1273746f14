"""The built-in policy (`selfspec/decoding/widths/policy.py`): the plan every served mode runs without a
plan file. Its plan per mode, its bad options named, and decoding under it lossless at every
batch class on the HF engine: greedy exact vs AR while the batch shrinks through the own-step,
long-lookup and narrow-lookup buckets. (Sampled batches run plain AR steps.) (Served: `test_sglang_plan.py` checks that each mode's default
really speculates.)"""

from __future__ import annotations

from collections import Counter

import pytest

from selfspec.decoding import registry
from selfspec.decoding.widths.policy import POLICY_NAMES, PolicyConfig, policy_plan
from selfspec.decoding.widths.width_plan import WidthPlan
from selfspec.engines.hf import HFEngine
from model_helpers import (
    add_mask_token, compare_greedy, random_prompts, tiny_qwen3,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SERVED = [s.name for s in registry.MODES.values() if s.sglang_algorithm]
#: thresholds scaled to a 24-sequence batch that shrinks as sequences stop
SMALL = PolicyConfig(own_max_batch=8, lookup_max_batch=16, context_tokens=6, lookup_tokens=6, wide_tokens=2)


def _plan(mode: str, policy: PolicyConfig = PolicyConfig()):
    spec = registry.get(mode)
    return policy_plan(spec.name, spec.policy_options, policy)


def _served_by(plan: WidthPlan, batch_size: int, sampled: bool = False):
    return (plan.sampled if sampled else plan.greedy)[plan.bucket(batch_size, sampled)]


@pytest.mark.parametrize("policy", [PolicyConfig(), SMALL, PolicyConfig(own_max_batch=0),
                                    PolicyConfig(own_max_batch=3, lookup_max_batch=3), PolicyConfig(lookup_tree=0)],
                         ids=["default", "small", "no-own", "no-long", "chain"])
@pytest.mark.parametrize("mode", SERVED)
def test_the_policy_speculates_at_every_batch_size(mode, policy):
    """At each boundary the policy's fields draw: greedy batches of up to `own_max_batch` run the
    mode's own step with the candidate, then up to `lookup_max_batch` the long lookup (a draft
    tree, or a chain adaptive and cut to its match; from the corpus), beyond it the narrow lookup; sampled batches plain AR steps
    at every size; the run-time check on. A bound of 0 (or equal bounds) leaves its step out."""
    plan = WidthPlan.from_dict(_plan(mode, policy), mode)
    assert plan.online is not None
    own, long_top = policy.own_max_batch, policy.lookup_max_batch
    for b in sorted({1, own, own + 1, long_top, long_top + 1, 10 * long_top + 50} - {0}):
        step = _served_by(plan, b)
        if b <= own:
            assert step.mode == mode and step.options["context_tokens"] == policy.context_tokens, (b, step)
            assert step.options["context_length_factor"] == policy.context_length_factor
        elif b <= long_top:
            assert (step.mode, step.options["num_draft"]) == ("ngram", policy.lookup_tokens), (b, step)
            assert step.options["corpus"]
            if policy.lookup_tree:  # a draft tree in the budget
                assert step.options["tree"] == policy.lookup_tree and "adaptive" not in step.options
            else:  # a chain cut by its match and its recent acceptance
                assert step.options["adaptive"] and step.options["length_factor"] == policy.lookup_length_factor
        else:
            assert (step.mode, step.options["num_draft"]) == ("ngram", policy.wide_tokens), (b, step)
            assert step.options.get("length_factor", 0.0) == policy.wide_length_factor, (b, step)
        assert _served_by(plan, b, sampled=True).mode == "ar", b
    assert all(b.mode != mode for b in WidthPlan.from_dict(_plan(mode, PolicyConfig("lookup")), mode).greedy)
    assert _plan(mode, PolicyConfig("own")) is None
    assert {b.mode for b in WidthPlan.from_dict(_plan(mode, PolicyConfig("ar")), mode).greedy} == {"ar"}


@pytest.mark.parametrize("value, problem", [
    ("fast", "choose one of auto, own, lookup, ar"),
    ({"own_max_batch": -1}, "own_max_batch=-1"),
    ({"lookup_max_batch": 2, "own_max_batch": 4}, "lookup_max_batch=2 is below own_max_batch=4"),
    ({"wide_tokens": 0}, "wide_tokens=0"),
    ({"context_length_factor": -1.0}, "context_length_factor=-1.0: a number"),
    ({"widest": 3}, "unknown policy option"),
    (3, "a name"),
])
def test_bad_policy_options_are_named(value, problem):
    with pytest.raises(ValueError, match=problem):
        PolicyConfig.parse(value)
    assert POLICY_NAMES[0] == "auto" and PolicyConfig.parse(None) == PolicyConfig()


@pytest.fixture(scope="module")
def setup():
    model = tiny_qwen3(128, seed=11).eval()
    mask_id = add_mask_token(model)
    prompts = random_prompts(24, 128, 1, 16, seed=5)
    engine = HFEngine(model, mask_token_id=mask_id)
    plain = engine.generate(prompts, 24, stop_token_ids=[], batch_size=24)
    # the most frequent generated token stops sequences at different steps
    stop = Counter(t for o in plain for t in o.token_ids).most_common(1)[0][0]
    reference = engine.generate(prompts, 24, stop_token_ids=[stop], batch_size=24)
    return engine, model, prompts, stop, reference


def test_risd_runs_isds_policy():
    """RISD's plan is ISD's (its own step is ISD's with the adapter gated on at MASK rows), so the
    HF tests below cover it through ISD; its served exactness is `test_sglang_risd.py`'s."""
    rename = lambda plan: str(plan).replace("'risd'", "'isd'")  # noqa: E731
    assert rename(_plan("risd")) == str(_plan("isd"))


@pytest.mark.parametrize("mode", [m for m in SERVED if m != "risd"])
def test_greedy_is_exact_through_every_bucket_of_the_policy(setup, buckets_used, mode):
    engine, model, prompts, stop, reference = setup
    outs = engine.generate(prompts, 24, stop_token_ids=[stop], mode=mode, plan=_plan(mode, SMALL), batch_size=24)
    cmp = compare_greedy(model, prompts, [o.token_ids for o in outs], [o.token_ids for o in reference])
    assert not cmp.failures and cmp.excused == 0, "\n".join(cmp.failures)
    ran = {type(m).__name__ for _, m in buckets_used}
    assert {"NgramMode"} < ran and len({id(m) for _, m in buckets_used}) == 3, buckets_used
