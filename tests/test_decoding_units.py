"""Unit tests of the pure pieces: n-gram pool, Jacobi blocks (spawn, promotion, pseudo-verify),
SJD history-offset drafts, the n-gram proposer, stop conditions, metrics, metadata, seeds,
step collation and the slot KV cache."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.modes.jacobi import Block, JacobiConfig, JacobiState, build_layout, pseudo_verify, update_blocks
from selfspec.checkpoints.metadata import MetadataError, SelfspecMetadata, load_metadata, resolve_mask_token_id, write_metadata
from selfspec.decoding.metrics import SequenceMetrics, aggregate
from selfspec.decoding import registry
from selfspec.decoding.registry import parse_mode_config, parse_option_string
from selfspec.decoding.modes.ngram import SuffixIndex, propose_ngram
from selfspec.decoding.modes.ngram_pool import NgramPool
from selfspec.decoding.progress import SequenceProgress
from selfspec.decoding.requests.seeds import base_seeds, step_seeds
from selfspec.decoding.modes.sjd import history_drafts, next_window
from selfspec.decoding.step import StepLayout, collate
from selfspec.engines.kv_cache import SlotKVCache, step_attention_mask


# ---------------------------------------------------------------- n-gram pool
def test_pool_stores_ngrams_of_rejected_segments_by_first_token():
    pool = NgramPool(ngram_size=3, per_key=2)
    assert pool.add([5, 6, 7, 5, 8]) == 3  # (5,6,7) (6,7,5) (7,5,8)
    assert pool.candidates(5, 4) == [[6, 7]]
    assert pool.candidates(7, 4) == [[5, 8]]
    assert pool.candidates(9, 4) == []
    assert pool.add([1, 2]) == 0  # shorter than an n-gram
    pool.add([5, 1, 1])
    pool.add([5, 2, 2])  # third n-gram for key 5: the oldest (5,6,7) is evicted
    assert pool.candidates(5, 4) == [[2, 2], [1, 1]]
    pool.add([5, 1, 1])  # re-adding refreshes
    assert pool.candidates(5, 4) == [[1, 1], [2, 2]]
    assert pool.candidates(5, 1) == [[1, 1]]
    assert len(pool) == 4
    with pytest.raises(ValueError):
        NgramPool(ngram_size=1)


# ---------------------------------------------------------------- Jacobi blocks
def test_jacobi_layout_is_a_tree_over_the_pending_token():
    st = JacobiState(Block([1, 2]), [Block([3, 4, 5], 1)], NgramPool(3), candidates=[[7, 8], [9]])
    lay, starts = build_layout(0, st)
    assert lay.tokens == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert lay.offsets == [0, 1, 2, 3, 4, 5, 1, 2, 1]
    assert lay.branch == [0, 1, 1, 1, 1, 1, 2, 2, 3]
    assert starts == [6, 8]
    vis = collate([lay]).local[0]
    assert vis[7].tolist() == [True, False, False, False, False, False, True, True, False]  # cand 1, 2nd token
    assert vis[5].tolist() == [True] * 6 + [False] * 3  # main branch: causal, no candidates
    assert vis[8].tolist() == [True] + [False] * 7 + [True]


def test_pseudo_verify_freezes_matching_prefix_plus_one_and_updates_the_rest():
    blk = Block([10, 11, 12, 13], accepted=1)
    out = pseudo_verify(blk, [99, 11, 20, 21])  # 11 matches; 12 -> 20 is the free pseudo token
    assert out.tokens == [10, 11, 20, 21] and out.accepted == 3
    assert pseudo_verify(Block([1, 2], 0), [1, 2]).accepted == 2  # capped at n
    assert pseudo_verify(Block([1, 2], 2), [7, 7]).tokens == [1, 2]  # fully frozen


def cfg(**kw):
    base = dict(block_size=4, max_blocks=2, spawn_ratio=0.5, pool_size=2, verify_size=2, ngram_size=3)
    base.update(kw)
    return JacobiConfig(**base)


def test_ra_partial_acceptance_updates_draft_and_spawns():
    c = cfg()
    assert c.spawn_threshold == 2
    st = JacobiState(Block([1, 2, 3]), [], NgramPool(3))  # accepted 0: pending + 3 drafts = n
    # committed 2 (1 draft + free token): RA accepted 2 >= threshold -> spawn a PA
    preds = [1, 9, 30, 31]  # preds[r] predicts relative position r + 1
    update_blocks(st, c, committed=2, predictions=preds, main_predictions=preds, fresh=[70, 71, 72, 73])
    assert st.ra.accepted == 2 and st.ra.tokens == [30]  # new pending (9) at rel 2; draft for rel 3
    assert len(st.pseudo) == 1 and st.pseudo[0].tokens == [30, 70, 71, 72] and st.pseudo[0].accepted == 0


def test_no_spawn_below_threshold_or_at_max_blocks():
    st = JacobiState(Block([1, 2, 3]), [], NgramPool(3))
    update_blocks(st, cfg(), committed=1, predictions=[5, 6, 7, 8], main_predictions=[5, 6, 7, 8], fresh=[0] * 4)
    assert st.ra.accepted == 1 and st.ra.tokens == [6, 7] and st.pseudo == []
    st = JacobiState(Block([1, 2, 3]), [], NgramPool(3))
    update_blocks(st, cfg(max_blocks=1), committed=3, predictions=[1, 2, 9, 8], main_predictions=[1, 2, 9, 8],
                  fresh=[0] * 4)
    assert st.pseudo == []


def test_promotion_of_the_pseudo_block_when_ra_is_full():
    c = cfg()
    # RA: pending + 1 draft left (accepted 2); PA_1 holds 4 tokens with 2 frozen
    st = JacobiState(Block([5], accepted=2), [Block([40, 41, 42, 43], accepted=2)], NgramPool(3))
    # main branch: [pending, 5 | 40 41 42 43]; preds[r] predicts rel r+1
    preds = [5, 40, 41, 50, 51, 52]  # draft 5 accepted, free token 40 at rel 2 = PA's first position
    update_blocks(st, c, committed=2, predictions=preds, main_predictions=preds, fresh=[90, 91, 92, 93])
    # PA pseudo-verified first: tokens 40 41 frozen, 42 -> 50 free pseudo token, 43 -> 51
    # then promoted: its first position holds the pending token (40), the rest is the RA draft
    assert st.ra.tokens == [41, 50, 51] and st.ra.accepted == 0
    # the new RA has not reached the threshold: no spawn yet
    assert st.pseudo == []


def test_promotion_without_pseudo_block_starts_a_fresh_block():
    st = JacobiState(Block([], accepted=3), [], NgramPool(3))  # only the pending token left
    update_blocks(st, cfg(max_blocks=1), committed=1, predictions=[7], main_predictions=[7], fresh=[1, 2, 3, 4])
    assert st.ra.tokens == [1, 2, 3] and st.ra.accepted == 0


def test_jacobi_config_validation():
    with pytest.raises(ValueError):
        JacobiConfig(block_size=1)
    with pytest.raises(ValueError):
        JacobiConfig(spawn_ratio=0)
    with pytest.raises(ValueError):
        JacobiConfig(init="zeros")


# ---------------------------------------------------------------- SJD drafts
def test_history_offset_drafts():
    hist = [10, 11, 12, 13, 14]
    assert history_drafts(hist, 3, 4) == [11, 12, 13]  # position t copies t - 4
    assert history_drafts(hist, 3, 1) == [14, 14, 14]
    assert history_drafts(hist, 4, 2) == [13, 14, 13, 14]  # later drafts copy earlier drafts
    assert history_drafts([7], 2, 5) == [7, 7]  # before the start: the first token


def test_next_window_reuses_predictions_after_the_rejection():
    hist = [1, 2, 3, 4, 5, 6]  # already extended by this step's emitted tokens
    preds = [20, 21, 22, 23, 24]  # rows 0 … W (W = 4)
    drafts, reused = next_window(hist, 1, preds, 4, 3)  # accepted 1: rows 2 … 4 reused
    assert drafts[:3] == [22, 23, 24] and reused == 3
    assert drafts[3:] == history_drafts(hist + [22, 23, 24], 1, 3)
    drafts, reused = next_window(hist, 4, preds, 4, 2)  # all accepted: history only
    assert reused == 0 and drafts == history_drafts(hist, 4, 2)


# ---------------------------------------------------------------- n-gram proposer
def test_ngram_proposer_uses_latest_earlier_match():
    h = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3]
    assert propose_ngram(h, 2) == [7, 8]  # latest earlier (1, 2, 3) is at 5..7
    assert propose_ngram(h, 10) == [7, 8, 4, 1, 2, 3, 7, 8, 4, 1]  # copies on past the end at the match's lag
    assert propose_ngram([9, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # a loop of period 2 drafts all k tokens
    assert propose_ngram([5, 6, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # falls back to the 2-gram
    assert propose_ngram([1, 2, 3, 4], 3) == []
    idx = SuffixIndex((3, 2))
    seq = [4, 5, 6, 4, 5]
    assert idx.propose(seq, 2) == [6, 4]
    seq += [6, 4, 5]
    assert idx.propose(seq, 2) == [6, 4]  # incremental index agrees with a fresh one
    assert idx.propose(seq, 2) == propose_ngram(seq, 2)


# ---------------------------------------------------------------- progress, metrics
def test_progress_stops_exactly():
    p = SequenceProgress(5, frozenset({9}))
    assert p.commit([1, 2]) == 2 and not p.finished
    assert p.commit([3, 9, 4, 5]) == 2 and p.finish_reason == "stop" and p.tokens == [1, 2, 3, 9]
    assert p.commit([6]) == 0
    p = SequenceProgress(3)
    assert p.commit([1, 2, 3, 4]) == 3 and p.finish_reason == "length"
    p = SequenceProgress(2, {7})
    p.commit([1, 7])
    assert p.finish_reason == "stop"  # a stop token at the budget's last slot counts as a stop
    assert SequenceProgress(0).finish_reason == "length"


def test_metrics():
    m = SequenceMetrics()
    m.record_prefill(1)
    m.record_step(7, 3)
    m.record_step(7, 1)
    assert m.forwards == 3 and m.committed_tokens == 5 and m.query_tokens == 15
    assert m.tokens_per_forward == pytest.approx(5 / 3)
    assert m.mean_accepted_length == 2.0 and m.compute_overhead == 3.0
    agg = aggregate([m, m])
    assert agg["sequences"] == 2 and agg["committed_tokens"] == 10 and agg["accept_hist"] == {"1": 2, "3": 2}
    json.dumps(m.to_dict())


# ---------------------------------------------------------------- metadata, modes, seeds
def test_metadata_roundtrip(tmp_path):
    assert load_metadata(tmp_path) is None
    (tmp_path / "adapter").mkdir()
    write_metadata(tmp_path, {"mode": "risd", "stride": 4, "mask_token_id": 5, "adapter": "adapter",
                              "lora": {"rank": 8, "targets": ["q_proj"], "base_sha256": "ab"}, "recipe": {"x": 1},
                              "custom": True})
    meta = load_metadata(tmp_path)
    assert meta.mode == "risd" and meta.stride == 4 and meta.mask_token_id == 5
    assert meta.lora.rank == 8 and meta.lora.targets == ["q_proj"] and meta.recipe == {"x": 1}
    assert meta.adapter_path == str((tmp_path / "adapter").resolve())
    assert meta.extra == {"custom": True}
    assert SelfspecMetadata.from_dict(meta.to_dict()).to_dict() == meta.to_dict()
    # older files wrote upper-case modes; every reader sees the registry's lower-case name
    write_metadata(tmp_path, {"mode": "RISD"})
    assert load_metadata(tmp_path).mode == "risd" and registry.get(load_metadata(tmp_path).mode).needs_adapter

    class Tok:
        mask_token, mask_token_id = "[MASK]", 3

    assert resolve_mask_token_id(None, meta, Tok()) == 5
    assert resolve_mask_token_id(7, meta, Tok()) == 7
    assert resolve_mask_token_id(None, None, Tok()) == 3
    assert resolve_mask_token_id(None, None, None) is None


def test_mode_config_parsing():
    cfg_ = parse_mode_config("isd", {"tau": 0.5}, defaults={"stride": 6, "unrelated": 1})
    assert cfg_.stride == 6 and cfg_.tau == 0.5
    assert parse_mode_config("isd", {"stride": 2}, defaults={"stride": 6}).stride == 2
    assert parse_mode_config("ar", None) is None
    with pytest.raises(ValueError):
        parse_mode_config("sjd", {"windw": 3})
    assert parse_option_string("stride=4, tau=0.5,fixed_width=false,adapter=/x") == {
        "stride": 4, "tau": 0.5, "fixed_width": False, "adapter": "/x"}


def test_metadata_describes_every_checkpoint_kind(tmp_path):
    meta = SelfspecMetadata(mode="jacobi", jacobi=registry_jacobi(), recipe={"cmd": "x"})
    meta.write(tmp_path)
    back = load_metadata(tmp_path)
    assert back.jacobi.block_size == 16 and back.jacobi.max_blocks == 2 and back.jacobi.spawn_ratio == 0.85
    assert back.option("block_size") == 16 and back.option("verify_size") == 4 and back.option("stride") is None
    assert back.to_dict() == meta.to_dict() and back.to_dict()["format_version"] == 1


def registry_jacobi():
    from selfspec.checkpoints.metadata import JacobiMetadata

    return JacobiMetadata(block_size=16, max_blocks=2, spawn_ratio=0.85, verify_size=4)


@pytest.mark.parametrize("text, problem", [("{not json", "not valid JSON"), ('{"stride": "four"}', "malformed"),
                                           ("[1, 2]", "JSON object")])
def test_malformed_metadata_names_the_file(tmp_path, text, problem):
    (tmp_path / "selfspec.json").write_text(text)
    with pytest.raises(MetadataError, match=problem) as info:
        load_metadata(tmp_path)
    assert str(tmp_path / "selfspec.json") in str(info.value)


def test_registry_is_the_one_list_of_modes():
    assert registry.MODE_NAMES == ("ar", "ngram", "isd", "risd", "jacobi", "sjd")
    assert set(registry.SGLANG_ALGORITHMS) == {"ISD", "RISD", "JACOBI", "SJD"}
    assert registry.for_sglang_algorithm("risd").needs_adapter and registry.get("ISD").needs_mask_token
    assert registry.get("jacobi").greedy_only and not registry.get("sjd").greedy_only
    assert registry.get("ngram").builtin_sglang_algorithm == "NGRAM" and registry.for_sglang_algorithm("NGRAM") is None
    with pytest.raises(ValueError, match="choose one of ar, ngram"):
        registry.get("eagle")
    # every mode builds from its defaults alone, given the resources it says it needs
    for spec in registry.MODES.values():
        mode = registry.build(spec.name, parse_mode_config(spec.name, None),
                              registry.ModeResources(mask_token_id=1, vocab_size=64))
        assert isinstance(mode, spec.mode_class) and mode.max_width >= 1


@pytest.mark.parametrize("mode, options, problem", [
    ("jacobi", "ngram_size=1", "ngram_size must be >= 2"),
    ("sjd", "window=4.5", "window=4.5: expected an integer"),
    ("isd", "fixed_width=3", "expected true or false"),
    ("isd", "tau=fast", "expected a number"),
    ("jacobi", "num_blocks=2", "unknown jacobi option"),
])
def test_bad_mode_options_fail_when_parsed(mode, options, problem):
    with pytest.raises(ValueError, match=problem):
        parse_mode_config(mode, options)


def test_seed_streams():
    assert base_seeds(5, 3) == [5, 6, 7]
    assert base_seeds([1, 2], 2) == [1, 2]
    with pytest.raises(ValueError):
        base_seeds([1], 2)
    base = torch.tensor([1, 2])
    a = step_seeds(base, torch.tensor([0, 0]), 4)
    b = step_seeds(base[1:], torch.tensor([0]), 4)
    assert torch.equal(a[1:], b)  # a row's seeds do not depend on the other rows
    c = step_seeds(base, torch.tensor([2, 2]), 2)
    assert torch.equal(c, a[:, 2:])  # the counter walks one stream
    assert bool((a >= 0).all()) and bool((a < 2**31).all())


# ---------------------------------------------------------------- collation and KV cache
def test_collate_pads_after_real_tokens():
    batch = collate([StepLayout([1, 2, 3], gate=[False, True, True]), StepLayout([4])], pad_token=0)
    assert batch.tokens.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch.widths == [3, 1] and batch.gate.tolist() == [[False, True, True], [False, False, False]]
    assert batch.local[1, 0].tolist() == [True, False, False]  # the real token sees no padding
    assert batch.local[1, 2].tolist() == [True, True, True]  # padding sees the trunk and itself
    assert batch.offsets.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_slot_cache_commit_moves_a_non_prefix_chain():
    cache = SlotKVCache(1, 2, 4, "cpu", torch.float32)
    cache.begin_step(3)
    k = torch.arange(2 * 3, dtype=torch.float32).view(2, 1, 3, 1)
    cache.update(k, k, 0)
    cache.commit([[0, 2], [1]])  # row 0 keeps step tokens 0 and 2; row 1 keeps token 1
    assert cache.lengths.tolist() == [2, 1]
    assert cache.keys[0][0, 0, :2, 0].tolist() == [0.0, 2.0]
    assert cache.keys[0][1, 0, :1, 0].tolist() == [4.0]
    slots = cache.begin_step(2)  # grows past capacity 4: row 0 needs slots 2, 3
    assert slots.tolist() == [[2, 3], [1, 2]]
    cache.update(torch.ones(2, 1, 2, 1), torch.ones(2, 1, 2, 1), 0)
    assert cache.keys[0][0, 0, :2, 0].tolist() == [0.0, 2.0]  # committed prefix untouched
    cache.select(torch.tensor([1]))
    assert cache.lengths.tolist() == [1] and cache.keys[0].shape[0] == 1


def test_step_mask_sees_committed_prefix_and_layout():
    lengths = torch.tensor([2, 0])
    local = torch.tensor([[True, False], [True, True]]).expand(2, 2, 2)
    mask = step_attention_mask(lengths, local, 4, torch.float32)
    seen = mask[:, 0] == 0
    assert seen[0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert seen[1].tolist() == [[True, False, False, False], [True, True, False, False]]


# ------------------------------------------------------------------------------ counter-based RNG
def _tensor_path(fn, *args):
    """Run `fn` with the small-draw Python path switched off (the tensor path for every size)."""
    from selfspec.decoding.requests import rng

    saved, rng.SMALL_DRAW = rng.SMALL_DRAW, -1
    try:
        return fn(*args)
    finally:
        rng.SMALL_DRAW = saved


@pytest.mark.parametrize("seed_shape,offset_shape", [((5,), (5,)), ((3, 1), (1, 7)), ((), ()), ((1,), (40,))])
def test_small_draws_hash_the_same_bits_as_the_tensor_path(seed_shape, offset_shape):
    from selfspec.decoding.requests import rng

    g = torch.Generator().manual_seed(len(seed_shape) * 10 + len(offset_shape))
    seed = torch.randint(0, 1 << 31, seed_shape, generator=g)
    offset = torch.randint(0, 1 << 31, offset_shape, generator=g)
    seed.view(-1)[0] = (1 << 31) - 1  # the extremes of the 31-bit seed range
    for fn in (rng.hash_u32, rng.uniform):
        want = _tensor_path(fn, seed, offset)
        got = fn(seed, offset)
        assert got.dtype == want.dtype and torch.equal(got, want)
    base, counter = torch.tensor([5, (1 << 31) - 1, 77]), torch.tensor([0, 12, (1 << 40) + 3])
    for width in (1, 4, 10):  # 3 x 10 is still a small draw; wider ones take the tensor path
        want = _tensor_path(step_seeds, base, counter, width)
        assert torch.equal(step_seeds(base, counter, width), want)
        assert torch.equal(step_seeds(base.tolist(), counter.tolist(), width), want)  # the worker's host lists
    for fn in (rng.uniform_at,):  # one offset for every seed
        assert torch.equal(fn(seed, 9), _tensor_path(rng.uniform, seed, torch.full_like(seed, 9)))
        assert torch.equal(_tensor_path(fn, seed, 9), rng.uniform(seed, torch.full_like(seed, 9)))


def test_race_argmax_draws_the_gumbel_max_winner():
    """The exponential-race form picks the token log w + gumbel picks (the Triton kernels' form)
    and never a zero-weight token."""
    from selfspec.decoding.requests import rng

    g = torch.Generator().manual_seed(3)
    weights = torch.softmax(torch.randn(400, 64, generator=g) * 3, -1)
    weights[:, ::3] = 0.0
    seeds = rng.draw_seeds((400, 1), g)
    got = rng.race_argmax(weights, seeds)
    want = (weights.log() + rng.gumbel(seeds, torch.arange(1, 65).unsqueeze(0))).argmax(-1)
    assert torch.equal(got, want)
    assert bool((weights.gather(1, got.unsqueeze(1)) > 0).all())


@pytest.mark.parametrize("path", ["cpu", "torch"])
def test_tensor_hash_and_uniform_are_hash_int(monkeypatch, path):
    """The [B, V] hash (numpy uint32 on the CPU, int32 tensors elsewhere: "torch" runs that one
    here) gives `hash_int`'s bits for seeds and offsets over the whole int64 range (>= 2^31,
    negative), and uniform is (hash >> 9 + 0.5) / 2^23 of them."""
    from selfspec.decoding.requests import rng

    if path == "torch":
        monkeypatch.setattr(rng, "_on_cpu", lambda *tensors: False)
    g = torch.Generator().manual_seed(11)
    seed = torch.cat([torch.randint(0, 1 << 31, (20, 1), generator=g), torch.randint(-(1 << 62), 1 << 62, (20, 1), generator=g),
                      torch.tensor([[0], [(1 << 31) - 1], [1 << 31], [(1 << 32) - 1], [-1]])])
    offset = torch.cat([torch.arange(1, 65), torch.randint(-(1 << 62), 1 << 62, (60,), generator=g),
                        torch.tensor([(1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, -1, -(1 << 31)])])
    want = [[rng.hash_int(s, o) for o in offset.tolist()] for s in seed.squeeze(1).tolist()]
    for s, o in ((seed, offset), (seed.int(), offset.int()), (seed.T.contiguous().T, offset.unsqueeze(0))):
        assert rng.hash_u32(s, o).tolist() == want
    u = rng.uniform(seed, offset)
    assert u.dtype == torch.float32
    assert u.tolist() == [[((h >> 9) + 0.5) / (1 << 23) for h in row] for row in want]
    assert torch.equal(rng.uniform(seed[3, 0], offset[5]), u[3, 5])  # 0-d


@pytest.mark.parametrize("path", ["cpu", "torch"])
def test_race_argmax_is_first_argmax_of_the_race_formula(monkeypatch, path):
    """race_argmax == first_argmax(w / -log(uniform(seed, v + 1))) bit for bit, on weights with
    ties and zeros (float32 and float64, [B, V] and [V]); the uniforms checked against `hash_int`."""
    from selfspec.decoding.requests import rng

    if path == "torch":
        monkeypatch.setattr(rng, "_on_cpu", lambda *tensors: False)
    g = torch.Generator().manual_seed(12)
    for trial in range(40):
        bsz, vocab = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 3000, (1,), generator=g))
        weights = torch.softmax(torch.randn(bsz, vocab, generator=g) * float(torch.rand((), generator=g) * 10), -1)
        weights[:, torch.rand(vocab, generator=g) < 0.3] = 0.0
        if trial % 4 == 1:  # many exact ties
            weights = torch.randint(0, 3, (bsz, vocab), generator=g).float()
        if trial % 4 == 2:
            weights[0] = 0.0  # an all-zero row
        if trial % 5 == 3:
            weights = weights.double()
        seed = rng.draw_seeds((bsz, 1), g)
        u = rng.uniform(seed, torch.arange(1, vocab + 1))
        row, col = int(torch.randint(0, bsz, (1,), generator=g)), int(torch.randint(0, vocab, (1,), generator=g))
        assert float(u[row, col]) == ((rng.hash_int(int(seed[row]), col + 1) >> 9) + 0.5) / (1 << 23)
        want = first_argmax(weights / -torch.log(u))
        assert torch.equal(rng.race_argmax(weights, seed), want), trial
        assert torch.equal(rng.race_argmax(weights[row], seed[row]), want[row]), trial


def test_first_argmax_is_torch_argmax_with_its_tie_rule():
    """The greedy rule's argmax (numpy on the CPU) returns what torch.argmax does: the first of
    tied maxima, on rows, views and strided slices."""
    from selfspec.decoding.argmax import first_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (6, 5, 50), generator=g).float()  # many ties
    for t in (x, x[2, 3], x[:, 1], x.transpose(0, 1), x[..., ::2], x.double()):
        got, want = first_argmax(t), t.argmax(-1)
        assert got.dtype == want.dtype and torch.equal(got, want)
