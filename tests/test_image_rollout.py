"""Image-token models and HB-SJD rollouts: data, tokenizer, the tensor rules against SJD's list
rules, greedy equality with cached AR in every schedule and execution, CFG pairing, and the
distribution of probabilistic verification."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from selfspec.images import hbsjd
from selfspec.images.cfg import guided_logits, restrict_to_codes
from selfspec.decoding.modes.sjd import history_drafts, next_window
from selfspec.images.rollout import ImageRolloutEngine, RolloutConfig
from selfspec.images.gpt import ImageTokenLayout

LAYOUT = ImageTokenLayout()


def linear_costs(batch: int, per_image: float, compaction: float) -> hbsjd.CompactionCosts:
    """A hand-built cost table: a forward costs 1 + per_image × b, a compaction `compaction`."""
    sizes = tuple(range(1, batch + 1))
    return hbsjd.CompactionCosts(sizes, tuple(1.0 + per_image * b for b in sizes), (compaction,) * batch)


# a compaction repays itself once rounds left × images finished > 2.5
SOME_ROUNDS = linear_costs(8, per_image=0.1, compaction=0.25)


def tiny_image_model(seed: int = 0, peaked: float = 1.0, hidden: int = 32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=LAYOUT.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)
    return model


def background_model(noise: float, strength: float = 1.0):
    """A random model that, like a digit's background, mostly predicts one code whatever the
    context (every embedding shares one direction that two head rows read), the rest depending
    on the context: Jacobi windows converge, so rounds accept several drafts."""
    model = tiny_image_model(1)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        d = torch.randn(emb.shape[1])
        d /= d.norm()
        emb.copy_(d * 4 + noise * torch.randn_like(emb))
        model.lm_head.weight.normal_(0, 0.3)
        model.lm_head.weight[5] += 3 * strength * d
        model.lm_head.weight[9] += 2.6 * strength * d
    return model


@pytest.fixture(scope="module")
def copy_model():
    return background_model(1.0)


# ------------------------------------------------------------------------------ the tensor rules
def test_history_fill_matches_sjd_history_drafts():
    rnd = random.Random(0)
    for _ in range(50):
        b, w, off = rnd.randint(1, 5), rnd.randint(1, 8), rnd.randint(1, 20)
        lengths = [rnd.randint(1, 30) for _ in range(b)]
        reused = [rnd.randint(0, w) for _ in range(b)]
        seqs = [[rnd.randint(0, 50) for _ in range(n)] for n in lengths]
        drafts = [[rnd.randint(0, 50) for _ in range(w)] for _ in range(b)]
        seq_t = torch.zeros(b, 40, dtype=torch.long)
        for i, s in enumerate(seqs):
            seq_t[i, : len(s)] = torch.tensor(s)
        got = hbsjd.history_fill(seq_t, torch.tensor(lengths), torch.tensor(drafts), torch.tensor(reused), off)
        for i in range(b):
            keep = drafts[i][: reused[i]]
            assert got[i].tolist() == keep + history_drafts(seqs[i] + keep, w - reused[i], off)


def test_reuse_predictions_matches_sjd_next_window():
    rnd = random.Random(1)
    for _ in range(50):
        b, w = rnd.randint(1, 4), rnd.randint(1, 8)
        preds = torch.randint(0, 50, (b, w + 1))
        accept = torch.tensor([rnd.randint(0, w) for _ in range(b)])
        new, reused = hbsjd.reuse_predictions(preds, accept + 1, w)
        for i in range(b):
            hist = [rnd.randint(0, 50) for _ in range(5)]
            want, count = next_window(hist, int(accept[i]), preds[i].tolist(), w, 3)
            assert int(reused[i]) == count
            assert new[i, :count].tolist() == want[:count]


def test_keep_counts_per_schedule():
    accept = torch.tensor([3, 1, 4])
    length = torch.tensor([10, 10, 10])
    active = torch.tensor([True, True, True])
    assert hbsjd.keep_counts(accept, length, 100, active, "independent", None).tolist() == [4, 2, 5]
    assert hbsjd.keep_counts(accept, length, 100, active, "lockstep", None).tolist() == [2, 2, 2]
    # a finished image neither commits nor holds the others back
    done = torch.tensor([True, False, True])
    assert hbsjd.keep_counts(accept, length, 100, done, "lockstep", None).tolist() == [4, 0, 4]
    # never past the end of the image
    assert hbsjd.keep_counts(accept, torch.tensor([98, 10, 10]), 100, active, "independent", None).tolist() == [2, 2, 5]
    # window schedule: an image that has completed the window idles
    end = torch.tensor([12, 12, 12])
    assert hbsjd.keep_counts(accept, torch.tensor([12, 10, 11]), 100, active, "window", end).tolist() == [0, 2, 5]


def test_cfg_fusion_and_code_restriction():
    c, u = torch.randn(3, 272), torch.randn(3, 272)
    torch.testing.assert_close(guided_logits(c, u, 2.0), u + 2.0 * (c - u))
    assert guided_logits(c, u, 1.0) is c
    r = restrict_to_codes(c, 256)
    assert torch.isinf(r[:, 256:]).all() and torch.equal(r[:, :256], c[:, :256])


# ------------------------------------------------------------------------------ greedy equality
def naive_guided_greedy(model, labels, prefix, scale, layout=LAYOUT):
    """Cached-nothing reference: every token from a full forward of both rows, fused."""
    seq = torch.cat([LAYOUT.class_ids(labels)[:, None], prefix], 1)
    with torch.no_grad():
        while seq.shape[1] < 1 + layout.tokens:
            uncond = seq.clone()
            uncond[:, 0] = LAYOUT.null_id
            c = model(input_ids=seq).logits[:, -1].float()
            u = model(input_ids=uncond).logits[:, -1].float()
            nxt = restrict_to_codes(guided_logits(c, u, scale), 256).argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], 1)
    return seq[:, 1:]


@pytest.mark.parametrize("scale,plen", [(1.0, 180), (2.0, 180), (2.0, 0)])
def test_cached_ar_with_cfg_equals_full_recompute(scale, plen):
    """Cached AR with guidance against full recomputation of both rows, with a prefix and from
    the class token alone (where the unconditional row's first token is the null class)."""
    model = tiny_image_model(2, peaked=4.0)
    short = ImageTokenLayout(tokens=24, grid=4) if plen == 0 else LAYOUT
    labels, prefix = torch.tensor([0, 3, 7]), torch.randint(0, 256, (3, plen))
    ar = ImageRolloutEngine(model, short).rollout(labels, prefix, RolloutConfig(window=0, cfg_scale=scale))
    assert torch.equal(ar.codes, naive_guided_greedy(model, labels, prefix, scale, short))
    assert torch.equal(ar.codes[:, :plen], prefix)


@pytest.mark.parametrize("schedule", hbsjd.SCHEDULES)
@pytest.mark.parametrize("execution", ["full", "compact", "hybrid"])
def test_greedy_hbsjd_equals_cached_ar(copy_model, schedule, execution):
    engine = ImageRolloutEngine(copy_model, LAYOUT)
    labels = torch.arange(7) % 10
    for plen, window, offset in [(98, 6, 14), (0, 4, 3), (150, 9, 1)]:
        prefix = torch.randint(0, 256, (7, plen), generator=torch.Generator().manual_seed(plen))
        ar = engine.rollout(labels, prefix, RolloutConfig(window=0))
        cfg = RolloutConfig(window=window, history_offset=offset, schedule=schedule, execution=execution,
                            costs=SOME_ROUNDS)
        out = engine.rollout(labels, prefix, cfg)
        assert torch.equal(out.codes, ar.codes), (plen, window, offset)
        assert out.tokens_per_round > 1.0  # the windows converge: more than one token per round
        assert out.rounds < ar.rounds


def test_synchronous_schedules_need_more_rounds(copy_model):
    engine = ImageRolloutEngine(copy_model, LAYOUT)
    labels, prefix = torch.arange(12) % 10, torch.randint(0, 256, (12, 60))
    rounds = {s: engine.rollout(labels, prefix, RolloutConfig(window=8, schedule=s)).rounds for s in hbsjd.SCHEDULES}
    assert rounds["lockstep"] >= rounds["independent"]
    assert rounds["window"] > rounds["independent"]


def test_execution_modes_shrink_the_batch(copy_model):
    engine = ImageRolloutEngine(copy_model, LAYOUT)
    labels, prefix = torch.arange(8) % 10, torch.randint(0, 256, (8, 98))

    def rollout(execution, costs=None):
        return engine.rollout(labels, prefix, RolloutConfig(window=6, execution=execution, costs=costs))

    full, compact = rollout("full"), rollout("compact")
    assert {t["rows"] for t in full.trace} == {16} and full.compactions == 0  # every image's rows, to the end
    assert min(t["rows"] for t in compact.trace) < 16
    assert [t["rows"] for t in compact.trace] == [2 * t["active"] for t in compact.trace]  # at every finish
    flat = rollout("hybrid", linear_costs(8, per_image=0.0, compaction=1e-3))  # an unsaturated GPU: never pays
    assert [t["rows"] for t in flat.trace] == [t["rows"] for t in full.trace]
    steep = rollout("hybrid", linear_costs(8, per_image=1.0, compaction=1e-3))  # a CPU: pays at every finish
    assert [t["rows"] for t in steep.trace] == [t["rows"] for t in compact.trace]
    assert torch.equal(flat.codes, full.codes) and torch.equal(steep.codes, compact.codes)


def test_hybrid_compacts_when_the_rounds_left_repay_it():
    """One finished image of 8 saves 0.1 a round against a compaction of 0.5: ten rounds left
    repay it, two do not. The one-round rule (γ = the largest b with t_f(8) − t_f(b) ≥ t_c(b),
    here 3) would stay full in both cases."""
    costs = linear_costs(8, per_image=0.1, compaction=0.5)
    assert hbsjd.should_compact(costs, batch=8, active=7, rounds=10)
    assert not hbsjd.should_compact(costs, batch=8, active=7, rounds=2)
    assert hbsjd.should_compact(costs, batch=8, active=3, rounds=2)  # five finished: two rounds repay it
    assert not hbsjd.should_compact(costs, batch=8, active=8, rounds=100)  # nothing to remove
    assert not hbsjd.should_compact(linear_costs(8, 0.0, 1e-6), batch=8, active=1, rounds=100)  # flat: never
    assert hbsjd.should_compact(costs, batch=5, active=4, rounds=6)  # after a compaction: from the current batch


def test_rounds_left_and_cost_table():
    length, active = torch.tensor([197, 150, 180, 197]), torch.tensor([False, True, True, False])
    assert hbsjd.rounds_left(length, 197, active, tokens_per_round=4.7) == pytest.approx(47 / 4.7)
    assert hbsjd.rounds_left(length, 197, active, tokens_per_round=0.0) == 47  # before any commit: one a round
    assert hbsjd.rounds_left(torch.tensor([196]), 197, torch.tensor([True]), 5.0) == 1.0  # this round at least
    noisy = hbsjd.CompactionCosts.from_sweep({"1": {"forward_s": 1.0, "compact_s": 0.1},
                                              "4": {"forward_s": 4.0, "compact_s": 0.4},
                                              "6": {"forward_s": 3.0, "compact_s": 0.6},  # a noisy dip
                                              "8": {"forward_s": 8.0, "compact_s": 0.8}})
    assert noisy.forward(4) == noisy.forward(6) == pytest.approx(3.5)  # made non-decreasing
    assert noisy.forward(2) == pytest.approx(1.0 + 2.5 / 3) and noisy.forward(7) == pytest.approx(5.75)
    assert noisy.forward(16) == 8.0 and noisy.compact(5) == pytest.approx(0.5)
    assert hbsjd.CompactionCosts.from_sweep(noisy.to_sweep()) == noisy
    with pytest.raises(ValueError, match="increasing"):
        hbsjd.CompactionCosts((2, 1), (1.0, 1.0), (0.1, 0.1))


def test_rollout_config_errors():
    with pytest.raises(ValueError, match="costs"):
        RolloutConfig(execution="hybrid")
    with pytest.raises(ValueError, match="schedule"):
        RolloutConfig(schedule="sync")
    with pytest.raises(ValueError, match="temperature"):
        RolloutConfig(verify="prob", temperature=0.0)


# ------------------------------------------------------------------------------ sampling
def _first_tokens_dist(model, labels, prefix, temperature, scale):
    with torch.no_grad():
        seq = torch.cat([LAYOUT.class_ids(labels)[:, None], prefix], 1)
        uncond = seq.clone()
        uncond[:, 0] = LAYOUT.null_id
        c, u = model(input_ids=seq).logits[0, -1].float(), model(input_ids=uncond).logits[0, -1].float()
        return torch.softmax(restrict_to_codes(guided_logits(c, u, scale), 256) / temperature, -1)[:256]


def _pooled_chisquare(counts: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> float:
    order = np.argsort(-expected)
    big = order[expected[order] >= min_expected]
    rest = order[expected[order] < min_expected]
    obs = np.append(counts[big], counts[rest].sum()).astype(np.float64)
    exp = np.append(expected[big], expected[rest].sum()).astype(np.float64)
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_probabilistic_verification_keeps_ar_distribution():
    """Many copies of one image with 4 codes left: the first generated code against the model's
    own guided distribution at T = 0.7 (exactly, chi-square), and the later codes' marginals
    against the AR engine's own samples. Ignoring the temperature (T = 1) fails the first test."""
    layout = ImageTokenLayout(tokens=12, grid=4)  # short images: thousands of rollouts are cheap
    n, plen, temp = 4000, layout.tokens - 4, 0.7
    labels = torch.full((n,), 4)
    prefix = torch.randint(0, 256, (1, plen), generator=torch.Generator().manual_seed(5)).expand(n, -1)
    model = background_model(0.5, strength=0.4)
    engine = ImageRolloutEngine(model, layout)
    sjd = engine.rollout(labels, prefix, RolloutConfig(window=3, history_offset=1, verify="prob", temperature=temp),
                         seed=1)
    ar = engine.rollout(labels, prefix, RolloutConfig(window=0, verify="prob", temperature=temp), seed=2)
    assert sjd.tokens_per_round > 1.2  # drafts were accepted: the test exercises p/q acceptance
    p = _first_tokens_dist(model, labels[:1], prefix[:1], temp, 2.0).numpy()
    first = np.bincount(sjd.codes[:, plen].numpy(), minlength=256)
    assert _pooled_chisquare(first, p * n) > 1e-3
    p_t1 = _first_tokens_dist(model, labels[:1], prefix[:1], 1.0, 2.0).numpy()
    assert _pooled_chisquare(first, p_t1 * n) < 1e-6
    for pos in (plen + 1, plen + 2, plen + 3):
        a = np.bincount(sjd.codes[:, pos].numpy(), minlength=256)
        b = np.bincount(ar.codes[:, pos].numpy(), minlength=256)
        keep = (a + b) >= 10
        table = np.stack([np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())])
        table = table[:, table.sum(0) > 0]
        from scipy.stats import chi2_contingency

        assert chi2_contingency(table).pvalue > 1e-3
